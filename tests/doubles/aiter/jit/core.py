"""TEST DOUBLE of ROCm/aiter ``aiter/jit/core.py`` ``compile_ops`` (behaviour, not code).

``@compile_ops("module_x")`` over a stub: the call goes to the module's kernel (here the
torch reference of the same name in ``aiter._reference``), wrapped by
``torch_compile_guard(device="cuda", calling_func_=stub)`` exactly as the real decorator
does, so the registered schema comes from the stub.
"""

from aiter import _reference
from aiter.jit.utils.torch_guard import torch_compile_guard


def compile_ops(md_name, fc_name=None, fallback=None, gen_fake=None, develop=False):
    def decorator(stub):
        kernel = getattr(_reference, fc_name or stub.__name__)
        return torch_compile_guard(device="cuda", gen_fake=gen_fake, calling_func_=stub)(kernel)

    return decorator
