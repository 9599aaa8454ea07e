"""TEST DOUBLE hook for live stand-in servers (this directory on PYTHONPATH).

With ``K3_TEST_DOUBLE_ROCM=1`` (or ``=platform``, which also makes
``current_platform.is_rocm()`` answer True to the overlay: for one-shot processes such as
``k3rocm overlay probe``, never for a serving process) every Python process (API
server, engine core, workers) applies ``rocm_vllm.activate()`` right after vLLM imports
``vllm._aiter_ops``, i.e. where
vLLM on ROCm registers its AITER ops. The platform stays CPU (vLLM must keep serving on
CPU), so the overlay's Q-prep gate still reads "platform is not ROCm". Never mounted into a
serving image.
"""

import importlib.abc
import importlib.util
import os
import sys

TARGET = "vllm._aiter_ops"


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        import rocm_vllm

        rocm_vllm.activate(platform=os.environ.get("K3_TEST_DOUBLE_ROCM") == "platform")


class _Finder(importlib.abc.MetaPathFinder):
    busy = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TARGET or self.busy:
            return None
        self.busy = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.busy = False
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


if os.environ.get("K3_TEST_DOUBLE_ROCM") in ("1", "platform"):
    sys.meta_path.insert(0, _Finder())
