"""TEST DOUBLE of ROCm/aiter (the package the overlay meets on an MI355X node).

Only the parts the overlay and vLLM's ROCm glue touch, with the real module paths, the real
Python stubs (signatures copied as *interfaces* from ROCm/aiter ``aiter/ops/cache.py``) and
the real registration mechanism: ``aiter.jit.core.compile_ops`` ->
``aiter.jit.utils.torch_guard.torch_compile_guard`` defines ``torch.ops.aiter.<name>`` from
the stub's signature and returns a bare ``wrapper_custom(*args, **kwargs)`` (no
``functools.wraps``), so ``inspect.signature`` of an exported op is always
``(*args, **kwargs)``; only the registered schema tells its arguments.

The kernels are torch references (``aiter._reference``), run on CPU.

``K3_TEST_AITER_VARIANT`` picks the AITER generation:
- ``clamp`` (default): after ROCm/aiter PR #4342 (Jul 2026): the Q-prep stub has
  ``compute_all_q_rope: bool = False`` and the kernels clamp positions into [0, rows).
- ``preclamp``: before it: no such argument, and the kernel indexes the cos/sin cache with
  the raw position (an out-of-bounds read on a one-row cache raises IndexError here).

``calls`` counts kernel launches per device-kernel name, as a profiler would see them.
"""

import collections
import os

__version__ = "0.0.0+k3rocm-test-double"
VARIANT = os.environ.get("K3_TEST_AITER_VARIANT", "clamp").strip() or "clamp"
if VARIANT not in ("clamp", "preclamp"):
    raise ImportError(f"K3_TEST_AITER_VARIANT={VARIANT!r}: use clamp or preclamp")
calls: collections.Counter = collections.Counter()
