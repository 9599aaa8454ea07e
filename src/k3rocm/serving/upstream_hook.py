"""The upstream hook: upstream's own Kimi-K3 fusions (vLLM >= 0.30 amd/mla.py), switchable and
recorded. :func:`install` wraps the class's ``__init__``: a fusion whose ``K3_FUSE_*`` is 0 is
turned off (its ``attr`` and ``follows``, serving/fusions.py) and one decision record per process
and layer kind is written. Never stops the server. :func:`read_mla` is the one reader of
upstream's file; :func:`upstream_file` the one place that says which file that is.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3rocm.serving import decisions
from k3rocm.serving.fusions import ENV, FUSIONS

log = logging.getLogger("vllm.k3rocm")

CLASS = "KimiK3MultiHeadLatentAttentionWrapper"
MLA_FILE = Path("vllm/models/kimi_k3/amd/mla.py")  # under the directory holding ``vllm``
MARKER = "K3ROCM_OVERLAY = 1"  # in the overlay's amd/mla.py, never in upstream's
BACKUP_SUFFIX = ".k3rocm-upstream"  # upstream's amd/mla.py, kept when the overlay replaced it
_WRAPPED = "_k3rocm_upstream_hook"

WRITER = decisions.Writer()
_warned: set[str] = set()  # one warning per process and kind


def _warn_once(kind: str, msg: str, *args: Any) -> None:
    if kind not in _warned:
        _warned.add(kind)
        log.warning(msg, *args)


# ------------------------------------------------ upstream's file, read (nothing imported)


@dataclass(frozen=True)
class UpstreamMla:
    """What an upstream ``amd/mla.py`` holds (:func:`read_mla`)."""

    calls: dict[str, int]  # every function called (last part of its dotted name) -> first line
    # ``self.<name>`` set in the class's ``__init__`` (``register_buffer`` too) -> first line;
    # None: no such class/method (or not Python)
    init: dict[str, int] | None

    @property
    def shipped(self) -> list[str]:
        """The fusions it ships: it calls the fusion's ``op`` and its ``__init__`` sets the
        per-layer ``attr`` (vLLM 0.30/0.31: qk_norm only; 0.32+: both)."""
        return [f.name for f in FUSIONS if f.op in self.calls and f.attr in (self.init or {})]


def read_mla(text: str) -> UpstreamMla:
    """Read an upstream ``amd/mla.py`` (its ``text``)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return UpstreamMla({}, None)
    calls: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func).rsplit(".", 1)[-1]
            calls[name] = min(node.lineno, calls.get(name, node.lineno))
    init = next((fn for cls in tree.body if isinstance(cls, ast.ClassDef) and cls.name == CLASS
                 for fn in cls.body
                 if isinstance(fn, ast.FunctionDef) and fn.name == "__init__"), None)
    if init is None:
        return UpstreamMla(calls, None)
    sets: dict[str, int] = {}
    for node in ast.walk(init):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, ast.AnnAssign) else [])
        names = [t.attr for t in targets if isinstance(t, ast.Attribute)
                 and isinstance(t.value, ast.Name) and t.value.id == "self"]
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "register_buffer" and node.args
                and isinstance(node.args[0], ast.Constant)):
            names.append(str(node.args[0].value))
        for n in names:
            sets[n] = min(node.lineno, sets.get(n, node.lineno))
    return UpstreamMla(calls, sets)


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""


def upstream_file(root: Path) -> Path | None:
    """Upstream's amd/mla.py under ``root`` (the directory holding ``vllm``): the file, or the
    backup ``overlay apply`` kept when it put the overlay there; None when vLLM ships none."""
    path = Path(root) / MLA_FILE
    if MARKER in _text(path):
        path = path.with_name(path.name + BACKUP_SUFFIX)
    return path if path.is_file() else None


# --------------------------------------------------------------------------- the run-time hook


def install(module: Any) -> bool:
    """Wrap ``module.KimiK3MultiHeadLatentAttentionWrapper.__init__`` (idempotent). Called by
    the plugin right after upstream's amd/mla.py is imported. Contained: never raises."""
    try:
        cls = getattr(module, CLASS, None)
        if not isinstance(cls, type):
            _warn_once("install", "k3rocm upstream hook: %s has no class %s; upstream's fusions "
                       "not switchable, no decision records", getattr(module, "__name__", "?"),
                       CLASS)
            return False
        if getattr(cls.__init__, _WRAPPED, False):
            return True
        upstream_init = cls.__init__

        @functools.wraps(upstream_init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            upstream_init(self, *args, **kwargs)  # upstream's gates (an error here is theirs)
            after_init(self)

        setattr(__init__, _WRAPPED, True)
        cls.__init__ = __init__
        log.info("k3rocm upstream hook: %s.%s switchable by %s", module.__name__, CLASS,
                 ", ".join(f.env for f in FUSIONS))
        return True
    except Exception as exc:  # noqa: BLE001 - the hook must not kill the server
        _warn_once("error", "k3rocm upstream hook: not installed (%s: %s); upstream's fusions "
                   "as upstream decides", type(exc).__name__, exc)
        return False


def asked(env: str) -> tuple[bool | None, str]:
    """The switch ``env`` as the overlay reads it (``_asked``; unset = the row's default, on);
    (None, why) for a value that is not a switch (the hook then leaves upstream's decision
    alone)."""
    on = next(f for f in FUSIONS if f.env == env).asked(os.environ.get(env))
    return on, "" if on is not None else f"{env}={os.environ[env]!r} is not a switch; use 1 or 0"


def _layer_kind(layer_name: str) -> str:
    """"draft" for MTP layers (numbered after the target's decoder layers), as the overlay's
    ``_layer_kind``."""
    import re

    if "mtp" in layer_name:
        return "draft"
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", layer_name)
    if m is None:
        return "target"
    try:
        from vllm.config import get_current_vllm_config

        mc = getattr(get_current_vllm_config(), "model_config", None)
    except Exception:  # noqa: BLE001 - no config (unit construction)
        mc = None
    layers = getattr(getattr(mc, "hf_text_config", None), "num_hidden_layers", None)
    if layers is None:
        return "target"
    return "draft" if int(m.group(1)) >= int(layers) else "target"


_MISSING = object()


def _not_bool(layer: Any, name: str, value: Any) -> str:
    what = (f"no {name}" if value is _MISSING else
            f"{name} = {type(value).__name__} {value!r}, not a bool")
    return f"{type(layer).__name__} has {what} (vLLM {decisions._vllm_version()})"


def _plan(layer: Any) -> tuple[dict[str, bool | None], dict[str, str], dict[str, str],
                               list[tuple[str, Any]]]:
    """Read only: what was asked, the fusions whose state is unknown (with why), notes for
    the others' reasons, and the attribute writes that turn the asked-off ones off."""
    asks: dict[str, bool | None] = {}
    unknown: dict[str, str] = {}
    notes: dict[str, str] = {}
    writes: list[tuple[str, Any]] = []
    buffers = getattr(layer, "_buffers", None) or {}
    for f in FUSIONS:
        want, bad = asked(f.env)
        asks[f.name] = want
        value = getattr(layer, f.attr, _MISSING) if f.attr else _MISSING
        if not isinstance(value, bool):
            unknown[f.name] = (_not_bool(layer, f.attr, value) if f.attr else
                               "the fusion table names no upstream attribute")
            continue
        if bad:
            notes[f.name] = f"{bad} (upstream's decision kept)"
            _warn_once("switch", "k3rocm upstream hook: %s; upstream's own decision kept", bad)
        if want is not False or not value:
            continue
        follow: list[tuple[str, Any]] = []
        for name in f.follows:
            cur = getattr(layer, name, _MISSING)
            if cur is _MISSING:
                continue  # not on this release
            if name in buffers:
                follow.append((name, None))  # free the buffer built for the fusion
            elif isinstance(cur, bool):
                follow.append((name, False))
            else:
                unknown[f.name] = _not_bool(layer, name, cur) + f", follows {f.attr}"
                break
        else:
            writes += [(f.attr, False), *follow]
    if unknown:
        _warn_once("unknown", "k3rocm upstream hook: %s not switchable on this base (%s); "
                   "upstream's behaviour untouched, decision records say 'unknown'",
                   ", ".join(ENV[n] for n in unknown), "; ".join(unknown.values()))
    return asks, unknown, notes, writes



def after_init(layer: Any) -> None:
    """Switch the asked-off fusions of one upstream layer and record what its attributes say
    then. Contained: an error logs one line and leaves upstream's decision in place."""
    done: list[tuple[str, Any]] = []
    asks: dict[str, bool | None] = {}
    try:
        asks, unknown, notes, writes = _plan(layer)
        for name, value in writes:
            done.append((name, getattr(layer, name)))
            setattr(layer, name, value)
        switched = {name for name, _ in writes}
        fusions: dict[str, dict[str, str]] = {}
        for f in FUSIONS:
            if f.name in unknown:
                fusions[f.name] = {"state": "unknown",
                                   "reason": f"{unknown[f.name]}; upstream untouched"}
                continue
            state = "on" if getattr(layer, f.attr) else "off"  # read back, never as asked
            reason = (f"upstream's gates: {state}" if f.attr not in switched else
                      f"{f.env}=0 (hook)" if state == "off" else
                      f"{f.env}=0 (hook) did not take: {f.attr} still True")
            if f.name in notes:
                reason = f"{notes[f.name]}; {reason}"
            fusions[f.name] = {"state": state, "reason": reason}
    except Exception as exc:  # noqa: BLE001 - the hook must not kill the server
        for name, value in reversed(done):
            with contextlib.suppress(Exception):
                setattr(layer, name, value)
        _warn_once("error", "k3rocm upstream hook: error (%s: %s); upstream's fusions as "
                   "upstream decided", type(exc).__name__, exc)
        why = f"hook error ({type(exc).__name__}: {exc}); upstream untouched"
        fusions = {f.name: {"state": "unknown", "reason": why} for f in FUSIONS}
        asks = {f.name: asks.get(f.name) for f in FUSIONS}
    try:
        layer_name = str(getattr(getattr(layer, "mla_attn", None), "layer_name", ""))
        WRITER.record(_layer_kind(layer_name), "construct", fusions, asks, writer="upstream")
    except Exception as exc:  # noqa: BLE001
        _warn_once("record", "k3rocm upstream hook: cannot write a decision record (%s: %s)",
                   type(exc).__name__, exc)
