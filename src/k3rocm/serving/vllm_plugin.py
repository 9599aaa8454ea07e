"""vLLM general plugin (``vllm.general_plugins: k3rocm_overlay``), run in every vLLM process.

With the overlay at ``amd/mla.py``: right after ``vllm.models.kimi_k3.amd.linear`` is imported,
its global ``MultiHeadLatentAttentionWrapper`` is rebound to the overlay's class (Kimi-K3 AMD
only; no vLLM file edited; other MLA models keep the stock wrapper). With upstream's amd/mla.py
(vLLM >= 0.30): the upstream hook (upstream_hook.install) wraps its class. Nothing with
``K3_OVERLAY=off`` at run time. Stdlib only at import time.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from k3rocm.serving.upstream_hook import CLASS as OUR_CLASS
from k3rocm.serving.upstream_hook import MARKER

# A child of vLLM's "vllm" logger, as vLLM's own plugin loader logs: its handler and level.
log = logging.getLogger("vllm.k3rocm")

TARGET_MODULE = "vllm.models.kimi_k3.amd.linear"
OVERLAY_MODULE = "vllm.models.kimi_k3.amd.mla"
WRAPPER_NAME = "MultiHeadLatentAttentionWrapper"

_state: dict[str, Any] = {"registered": False, "bound": [], "upstream_hook": False}


def amd_mla_text() -> str | None:
    """vLLM's amd/mla.py as text, None when there is none."""
    try:
        spec = importlib.util.find_spec("vllm")  # top level: already imported, or not at all
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, *OVERLAY_MODULE.split(".")[1:]) + ".py"
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as fh:
                return fh.read()
    return None


def bind(module: Any) -> bool:
    """Rebind ``module.MultiHeadLatentAttentionWrapper`` to our subclass (idempotent)."""
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
    """Runs ``hooks[name](module)`` right after module ``name`` is imported (executed)."""

    def __init__(self, hooks: dict[str, Callable[[Any], Any]]):
        self.hooks = hooks
        self._busy: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):  # noqa: D102
        if fullname not in self.hooks or fullname in self._busy:
            return None
        self._busy.add(fullname)  # avoid recursion: let the normal finders find it
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None:
            return None
        exec_module, hook = spec.loader.exec_module, self.hooks[fullname]

        def exec_and_hook(module: Any) -> None:
            exec_module(module)
            hook(module)

        spec.loader.exec_module = exec_and_hook  # this spec's own loader instance
        return spec


def after_import(hooks: dict[str, Callable[[Any], Any]]) -> None:
    """Run each hook now for a module already imported, else right after its import."""
    pending = {}
    for name, hook in hooks.items():
        if name in sys.modules:
            hook(sys.modules[name])
        else:
            pending[name] = hook
    if pending:
        sys.meta_path.insert(0, _Finder(pending))


def register() -> None:
    """vLLM general-plugin entry point. Cheap, idempotent, never raises."""
    if _state["registered"]:
        return
    _state["registered"] = True
    try:
        if os.environ.get("K3_OVERLAY", "").strip().lower() == "off":
            log.info("k3rocm overlay: K3_OVERLAY=off, stock MLA wrapper")
            return
        text = amd_mla_text()
        if text is None:
            return  # no amd/mla.py: no overlay applied on a base older than 0.30
        if MARKER in text:
            after_import({TARGET_MODULE: bind})
            return
        # upstream's amd/mla.py: it wires its own class; the hook makes its fusions switchable
        from k3rocm.serving import upstream_hook

        _state["upstream_hook"] = True
        after_import({OVERLAY_MODULE: upstream_hook.install})
    except Exception as exc:  # noqa: BLE001 - a plugin must not kill the server
        log.warning("k3rocm overlay: wiring failed (%s: %s); vLLM's MLA wrapper as shipped "
                    "(no overlay, no upstream hook)", type(exc).__name__, exc)
