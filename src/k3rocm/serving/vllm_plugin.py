"""vLLM general plugin (entry point ``vllm.general_plugins: k3rocm_overlay``).

vLLM calls :func:`register` in every process it starts (API server, engine core, each
worker) before it builds a model. We use that to make the AMD Kimi-K3 model build our
``KimiK3MultiHeadLatentAttentionWrapper`` instead of the base wrapper:

``vllm/models/kimi_k3/amd/linear.py`` (nightly era) does
``from vllm.model_executor.layers.mla import MLAModules, MultiHeadLatentAttentionWrapper``
and calls ``MultiHeadLatentAttentionWrapper(...)`` inside ``KimiMLAAttention.__init__``;
the name is looked up in that module's globals at construction time. Rebinding that one
global (in that one module) to our subclass switches the Kimi-K3 AMD model and nothing
else: no vLLM file is edited, DeepSeek and every other MLA model keep the stock wrapper
(unlike ``PluggableLayer.register_oot``, which would swap the wrapper for all models).

The rebinding happens when ``amd/linear.py`` is imported (a post-import hook), so a
process that never loads Kimi-K3 pays nothing but this function call.

It does nothing when
- ``K3_OVERLAY=off`` is set at run time (A/B the whole overlay without a rebuild),
- vLLM's ``amd/mla.py`` is not the k3rocm overlay (upstream code wires itself),
- ``amd/linear.py`` no longer holds the base wrapper name (logged as a warning).

Stdlib only at import time: this runs inside the serving image.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import sys
from typing import Any

# A child of vLLM's "vllm" logger, as vLLM's own plugin loader logs: its handler and level.
log = logging.getLogger("vllm.k3rocm")

TARGET_MODULE = "vllm.models.kimi_k3.amd.linear"
OVERLAY_MODULE = "vllm.models.kimi_k3.amd.mla"
WRAPPER_NAME = "MultiHeadLatentAttentionWrapper"
OUR_CLASS = "KimiK3MultiHeadLatentAttentionWrapper"
MARKER = "K3ROCM_OVERLAY = 1"
# TEST ONLY: extra modules whose MLA wrapper name is rebound too (comma separated), e.g.
# vllm.model_executor.models.deepseek_v2 for the CPU end-to-end test with a tiny model.
TEST_BIND_ENV = "K3_TEST_BIND_MODULES"

_state: dict[str, Any] = {"registered": False, "bound": []}


def overlay_is_ours() -> bool:
    """True when vLLM's amd/mla.py is the k3rocm overlay file.

    Read from disk next to the ``vllm`` package: nothing of ``vllm.models.kimi_k3`` is
    imported (its ``__init__`` pulls in the whole model and FLA utilities that touch the HIP
    driver), so a process that never builds Kimi-K3 (the API server parsing its CLI, say)
    pays one ``stat`` and one small read."""
    try:
        spec = importlib.util.find_spec("vllm")  # top level: already imported, or not at all
    except (ImportError, ValueError):
        return False
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, *OVERLAY_MODULE.split(".")[1:]) + ".py"
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as fh:
                return MARKER in fh.read()
    return False


def bind(module: Any) -> bool:
    """Rebind ``module.MultiHeadLatentAttentionWrapper`` to our subclass (idempotent).
    Contained: an overlay that fails to import or bind (an API mismatch with this vLLM, say)
    logs one line and the model is built with the stock wrapper."""
    try:
        from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper as base

        ours = getattr(importlib.import_module(OVERLAY_MODULE), OUR_CLASS)
    except Exception as exc:  # noqa: BLE001 - a broken overlay must not kill the server
        log.warning("k3rocm overlay: cannot bind into %s (%s: %s); stock MLA wrapper, fusions "
                    "off", getattr(module, "__name__", "?"), type(exc).__name__, exc)
        return False
    current = getattr(module, WRAPPER_NAME, None)
    if current is ours or getattr(module, OUR_CLASS, None) is ours:
        return True  # already ours (or an upstream-style linear.py importing our class)
    if current is not base:
        log.warning("k3rocm overlay: %s.%s is %r, not vLLM's base wrapper; not rebinding "
                    "(fusions inactive)", module.__name__, WRAPPER_NAME, current)
        return False
    setattr(module, WRAPPER_NAME, ours)
    _state["bound"].append(module.__name__)
    log.info("k3rocm overlay: %s now builds %s", module.__name__, OUR_CLASS)
    return True


class _Finder(importlib.abc.MetaPathFinder):
    """Runs :func:`bind` right after one of ``names`` is imported."""

    def __init__(self, names: set[str]):
        self.names = names

    def find_spec(self, fullname, path=None, target=None):  # noqa: D102
        if fullname not in self.names:
            return None
        self.names.discard(fullname)  # avoid recursion: let the normal finders find it
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.names.add(fullname)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_bind(module: Any) -> None:
            exec_module(module)
            bind(module)

        spec.loader.exec_module = exec_and_bind  # this spec's own loader instance
        return spec


def register() -> None:
    """vLLM general-plugin entry point. Cheap, idempotent, never raises."""
    if _state["registered"]:
        return
    _state["registered"] = True
    try:
        if os.environ.get("K3_OVERLAY", "").strip().lower() == "off":
            log.info("k3rocm overlay: K3_OVERLAY=off, stock MLA wrapper")
            return
        if not overlay_is_ours():
            return  # no overlay applied, or upstream amd/mla.py (wired upstream)
        pending = set()
        names = f"{TARGET_MODULE},{os.environ.get(TEST_BIND_ENV, '')}".split(",")
        for name in filter(None, map(str.strip, names)):
            if name in sys.modules:
                bind(sys.modules[name])
            else:
                pending.add(name)
        if pending:
            sys.meta_path.insert(0, _Finder(pending))
    except Exception as exc:  # noqa: BLE001 - a plugin must not kill the server
        log.warning("k3rocm overlay: wiring failed (%s: %s); stock MLA wrapper",
                    type(exc).__name__, exc)
