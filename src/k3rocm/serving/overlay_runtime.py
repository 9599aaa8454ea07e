"""What the overlay asks of the process it runs in, and how it writes down what it decided.

Used by the overlay wrapper inside vLLM (``vllm/models/kimi_k3/amd/mla.py``) and by
``k3rocm overlay probe --json``; one implementation, so the CLI answers exactly what a
server process would find.

The probe asks the real sources, never a test switch:

- the decode Q-prep kernel: ``import aiter.ops.cache`` registers the op as
  ``torch.ops.aiter.fused_qk_rope_concat_and_cache_mla`` (ROCm/aiter ``aiter/jit/core.py``
  ``compile_ops`` -> ``aiter/jit/utils/torch_guard.py`` ``torch_compile_guard``, which
  defines the op from the Python stub's signature). The Python function AITER exports is a
  bare ``wrapper_custom(*args, **kwargs)`` (no ``functools.wraps``), so its
  ``inspect.signature`` says nothing; the registered *schema* does. The position clamp
  (ROCm/aiter PR #4342) arrived together with the ``compute_all_q_rope`` argument: an AITER
  whose schema lacks it reads out of bounds with a one-row cos/sin cache.
- the fused q/kv RMSNorm op: ``vllm::fused_mla_dual_rms_norm``, registered by
  ``vllm/_aiter_ops.py`` (``rocm_aiter_ops.register_ops_once()`` at import) on ROCm with AITER.
- the platform: ``current_platform.is_rocm()``, ``rocm_aiter_ops.is_enabled()`` and
  ``is_mla_enabled()`` (these return None, not False, off ROCm).

Decision records (one JSON object per decision, per process and layer kind) go to the log as
``K3ROCM-DECISION {json}`` and, when ``K3_PROFILER_DIR`` is set, to
``<K3_PROFILER_DIR>/k3rocm-decisions-pid<PID>.json`` beside the profiler traces.

Stdlib only at import time (torch, vLLM and AITER are imported inside the functions).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from typing import Any

DECISION_MARKER = "K3ROCM-DECISION "
DECISION_SCHEMA = "k3rocm.overlay.decision/1"
DECISION_FILE = "k3rocm-decisions-pid{pid}.json"
FUSION_ENV = {"qk_norm": "K3_FUSE_QK_NORM", "decode_qprep": "K3_FUSE_DECODE_QPREP"}
QPREP_OP = "fused_qk_rope_concat_and_cache_mla"
QPREP_CLAMP_ARG = "compute_all_q_rope"
DUAL_NORM_OP = "fused_mla_dual_rms_norm"

_log = logging.getLogger("vllm.k3rocm")


class SwitchError(ValueError):
    """A K3_FUSE_* value that is not a switch."""


def asked(name: str) -> bool:
    """The K3_FUSE_* toggle for one fusion (1/0, default 1)."""
    env = FUSION_ENV[name]
    raw = os.environ.get(env, "").strip().lower()
    if raw in ("", "1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise SwitchError(f"{env}={os.environ[env]!r} is not a switch; use 1 or 0")


# ------------------------------------------------------------------------------ the probe


def probe_qprep_kernel() -> dict[str, Any]:
    """Is AITER's fused Q-prep op registered, and does it clamp positions?"""
    try:
        import aiter.ops.cache  # noqa: F401 - importing registers torch.ops.aiter.*
    except Exception as exc:  # noqa: BLE001 - no AITER, or one that needs a GPU
        return {"found": False, "clamps_positions": False,
                "source": f"aiter.ops.cache not importable ({type(exc).__name__}: {exc})"}
    import torch

    try:
        schema = getattr(torch.ops.aiter, QPREP_OP).default._schema
    except (AttributeError, RuntimeError):
        return {"found": False, "clamps_positions": False,
                "source": f"torch.ops.aiter.{QPREP_OP} not registered by aiter.ops.cache"}
    args = [a.name for a in schema.arguments]
    return {"found": True, "clamps_positions": QPREP_CLAMP_ARG in args,
            "source": f"torch.ops.aiter.{QPREP_OP} schema "
                      f"({'has' if QPREP_CLAMP_ARG in args else 'no'} {QPREP_CLAMP_ARG})",
            "schema": str(schema)}


def probe_dual_norm_op() -> dict[str, Any]:
    try:
        import vllm._aiter_ops  # noqa: F401 - registers vllm::* AITER ops on ROCm
    except Exception as exc:  # noqa: BLE001
        return {"found": False, "source": f"vllm._aiter_ops not importable ({exc})"}
    import torch

    found = hasattr(torch.ops.vllm, DUAL_NORM_OP)
    return {"found": found,
            "source": f"torch.ops.vllm.{DUAL_NORM_OP} "
                      f"{'registered' if found else 'not registered'} (vllm/_aiter_ops.py)"}


def platform_facts() -> dict[str, bool]:
    out = {"is_rocm": False, "aiter_enabled": False, "aiter_mla_enabled": False}
    try:
        from vllm._aiter_ops import rocm_aiter_ops
        from vllm.platforms import current_platform

        out["is_rocm"] = bool(current_platform.is_rocm())
        out["aiter_enabled"] = bool(rocm_aiter_ops.is_enabled())  # None off ROCm
        out["aiter_mla_enabled"] = bool(rocm_aiter_ops.is_mla_enabled())
    except Exception:  # noqa: BLE001 - no vLLM here: nothing is enabled
        pass
    return out


_PROBE: dict[str, Any] | None = None


def probe(refresh: bool = False) -> dict[str, Any]:
    """Everything the overlay needs to know about this process, gathered once."""
    global _PROBE
    if _PROBE is None or refresh:
        _PROBE = {"platform": platform_facts(), "qprep_kernel": probe_qprep_kernel(),
                  "dual_norm_op": probe_dual_norm_op()}
    return _PROBE


def qk_norm_platform_gate(p: dict[str, Any]) -> tuple[bool, str]:
    if not p["platform"]["aiter_enabled"]:
        return False, "AITER not enabled (needs ROCm and VLLM_ROCM_USE_AITER=1)"
    if not p["dual_norm_op"]["found"]:
        return False, f"torch.ops.vllm.{DUAL_NORM_OP} not registered"
    return True, f"{DUAL_NORM_OP} (one AITER launch)"


def qprep_platform_gate(p: dict[str, Any]) -> tuple[bool, str]:
    if not p["platform"]["is_rocm"]:
        return False, "platform is not ROCm"
    if not p["platform"]["aiter_mla_enabled"]:
        return False, "AITER MLA not enabled"
    if not p["qprep_kernel"]["found"]:
        return False, f"aiter {QPREP_OP} not found ({p['qprep_kernel']['source']})"
    if not p["qprep_kernel"]["clamps_positions"]:
        # AITER v0.1.19's per-head and _opt kernels return for slot < 0 before reading the
        # table (csrc/kernels/cache_kernels.cu): a row per position is safe without the clamp.
        return True, (f"{QPREP_OP} (identity rope; AITER predates the position clamp, no "
                      f"{QPREP_CLAMP_ARG} in its schema: cos/sin of max_model_len rows)")
    return True, f"{QPREP_OP} (identity rope, 1-row cos/sin)"


def probe_report() -> dict[str, Any]:
    """``k3rocm overlay probe --json``: the probe plus what it means for each fusion.

    Gates that need the loaded model (kv cache dtype, heads per rank, W_UK variant, the
    backend's fp8-query support, DCP) are not decided here: state ``needs-model``."""
    p = probe(refresh=True)
    fusions: dict[str, dict[str, str]] = {}
    for name, gate in (("qk_norm", qk_norm_platform_gate),
                       ("decode_qprep", qprep_platform_gate)):
        try:
            want = asked(name)
        except SwitchError as exc:
            fusions[name] = {"state": "off", "reason": str(exc)}
            continue
        ok, why = gate(p)
        if not want:
            fusions[name] = {"state": "off", "reason": f"{FUSION_ENV[name]}=0"}
        elif not ok:
            fusions[name] = {"state": "off", "reason": why}
        else:
            fusions[name] = {"state": "needs-model",
                             "reason": f"platform gates pass: {why}; the rest is decided per "
                                       "layer when the model is built and its weights loaded"}
    return {"platform": p["platform"], "qprep_kernel": p["qprep_kernel"],
            "dual_norm_op": p["dual_norm_op"], "fusions": fusions,
            "python": sys.version.split()[0]}


# ----------------------------------------------------------------------- decision records

_RECORDS: list[dict[str, Any]] = []
_SEEN: set[str] = set()


def _tp_rank() -> int | None:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - not initialized (tests, CLI)
        return None


def _vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:  # noqa: BLE001
        return "unknown"


def record_decision(layer_kind: str, phase: str, fusions: dict[str, dict[str, str]],
                    asked_: dict[str, bool]) -> dict[str, Any] | None:
    """Write one decision record (once per distinct decision of a process and layer kind)."""
    key = json.dumps([layer_kind, phase, fusions], sort_keys=True)
    if key in _SEEN:
        return None
    _SEEN.add(key)
    p = probe()
    rec = {"schema": DECISION_SCHEMA, "pid": os.getpid(),
           "process": _process_name(), "tp_rank": _tp_rank(), "layer_kind": layer_kind,
           "phase": phase, "vllm_version": _vllm_version(), "fusions": fusions,
           "asked": asked_,
           "probe": {"qprep_kernel": {k: p["qprep_kernel"][k] for k in
                                      ("found", "clamps_positions", "source")},
                     "dual_norm_op": p["dual_norm_op"]}}
    _RECORDS.append(rec)
    line = DECISION_MARKER + json.dumps(rec, sort_keys=True)
    try:  # vLLM's logger config prints "vllm.*" loggers in every process
        from vllm.logger import init_logger

        init_logger("vllm.k3rocm").info(line)
    except Exception:  # noqa: BLE001
        _log.info(line)
    _write_beside_traces()
    return rec


def _process_name() -> str:
    try:
        import multiprocessing

        return multiprocessing.current_process().name
    except Exception:  # noqa: BLE001
        return "main"


def _write_beside_traces() -> None:
    out = os.environ.get("K3_PROFILER_DIR", "").strip()
    if not out:
        return
    try:
        os.makedirs(out, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out, prefix=".k3rocm-decisions-")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(_RECORDS, fh, indent=1, sort_keys=True)
        os.chmod(tmp, 0o644)
        os.replace(tmp, os.path.join(out, DECISION_FILE.format(pid=os.getpid())))
    except OSError as exc:  # the log line above still carries the record
        _log.warning("k3rocm overlay: cannot write decisions into %s (%s)", out, exc)


def parse_decision_line(line: str) -> dict[str, Any] | None:
    """The record in one log line, or None (no marker, or not a record of this schema)."""
    at = line.find(DECISION_MARKER)
    if at < 0:
        return None
    try:
        rec = json.loads(line[at + len(DECISION_MARKER):])
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and rec.get("schema") == DECISION_SCHEMA else None
