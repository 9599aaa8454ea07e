"""TEST DOUBLE of ROCm/aiter ``aiter/jit/utils/torch_guard.py`` (behaviour, not code).

Real behaviour reproduced: the decorator infers the op schema from the *calling function*
(the Python stub), with every tensor argument marked as mutated when ``mutates_args`` is
"unknown" (the default that ``compile_ops`` uses), defines it in the ``aiter`` library
fragment, implements it for CPU and CUDA, registers a fake, and returns a plain
``wrapper_custom(*args, **kwargs)`` that calls ``torch.ops.aiter.<name>``: nothing of the
stub's signature survives on the returned function.
"""

import torch

_LIB = None


def torch_compile_guard(mutates_args="unknown", device="cpu", calling_func_=None,
                        gen_fake=None):
    def decorator(func):
        global _LIB
        stub = calling_func_ if calling_func_ is not None else func
        name = stub.__name__
        if _LIB is None:
            _LIB = torch.library.Library("aiter", "FRAGMENT")  # noqa: TOR901
        if not hasattr(torch.ops.aiter, name):
            schema = torch.library.infer_schema(stub, mutates_args=mutates_args)
            _LIB.define(name + schema)
            _LIB.impl(name, func, dispatch_key="CPU")
            _LIB.impl(name, func, dispatch_key="CUDA")
            _LIB._register_fake(name, gen_fake or (lambda *a, **k: None))

        def wrapper_custom(*args, **kwargs):
            return getattr(torch.ops.aiter, name)(*args, **kwargs)

        return wrapper_custom

    return decorator
