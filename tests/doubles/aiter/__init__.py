"""TEST DOUBLE of ROCm/aiter (the package the overlay meets on an MI355X node).

Only the parts the overlay and vLLM's ROCm glue touch, with the real module paths, the real
Python stubs (signatures copied as *interfaces* from ROCm/aiter ``aiter/ops/cache.py``) and
the real registration mechanism: ``aiter.jit.core.compile_ops`` ->
``aiter.jit.utils.torch_guard.torch_compile_guard`` defines ``torch.ops.aiter.<name>`` from
the stub's signature and returns a bare ``wrapper_custom(*args, **kwargs)`` (no
``functools.wraps``), so ``inspect.signature`` of an exported op is always
``(*args, **kwargs)``; only the registered schema tells its arguments.

The kernels are torch references (``aiter._reference``), run on CPU.

``K3_TEST_AITER_VARIANT`` picks the AITER generation at import (the stub, so the registered
schema, and the kernel's position handling):
- ``clamp`` (default): after ROCm/aiter PR #4342 (Jul 2026): the Q-prep stub has
  ``compute_all_q_rope: bool = False`` and the per-head and ``_opt`` kernels clamp positions
  into [0, rows) (the general kernel does not: out of bounds -> IndexError).
- ``preclamp``: before it: no such argument, and every kernel indexes the cos/sin cache with
  the raw position (an out-of-bounds read on a one-row cache raises IndexError here).
- ``grouped``: the schema of ``clamp`` (``compute_all_q_rope`` present), but the kernel does
  not clamp: the head-grouped kernel of AITER v0.1.26 as vLLM 0.34 describes it
  (``vllm@0.34.0:vllm/models/kimi_k3/amd/mla.py:274-278``): past the cos/sin cache it reads
  cos = sin = 0 at one head per block (q_pe and the cached k_pe come out zero) and faults at
  more heads per block (``GROUPED_HEADS_PER_BLOCK`` > 1 here: IndexError).

``VARIANT`` may be set at run time to swap the kernel's position handling under the schema
registered at import (so ``grouped`` and ``preclamp`` kernels can run in a process whose schema
has ``compute_all_q_rope``, the case the schema alone cannot tell apart).

``calls`` counts kernel launches per device-kernel name, as a profiler would see them.
"""

import collections
import os

__version__ = "0.0.0+k3rocm-test-double"
VARIANTS = ("clamp", "preclamp", "grouped")
VARIANT = os.environ.get("K3_TEST_AITER_VARIANT", "clamp").strip() or "clamp"
if VARIANT not in VARIANTS:
    raise ImportError(f"K3_TEST_AITER_VARIANT={VARIANT!r}: use one of {', '.join(VARIANTS)}")
GROUPED_HEADS_PER_BLOCK = 1
calls: collections.Counter = collections.Counter()
