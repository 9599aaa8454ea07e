"""Which published upstream figure, if any, a result is comparable with, and why not otherwise.

Sources: [PR52494] vLLM PR #52494 (q/kv RMSNorm fusion: 144 ``aiter::fused_qk_rmsnorm_kernel``
launches over 6 steps on MI355X TP=8, MTP k=2, ISL 128k / OSL 1k, conc 8; GSM8K 5-shot 0.9644 +-
0.0051 with its lm-eval task config, shipped as checks/gsm8k/gsm8k.yaml). [PR57640] vLLM PR
#57640 (decode Q-prep: 288 -> 144 launches, 1351.8 -> 682.8 us per rank over 6 decode steps,
plain ``vllm serve``, no MTP, no compilation override, fp8 KV, AITER MLA). [aiperf] the PRs'
latency A/B (8k/1k, concurrency 1,4,8): C=1 ITL p50/p90 moved ~0.5%. Figures whose server
settings the PRs do not state are checked on what is stated only. The figures and their conditions
are the rows of ``upstream_ref.json`` (package data); ``_facts`` says what a result had.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

MEASURES = ("bench", "bench-ab", "census", "census-ab", "gsm8k")
GSM8K_FEWSHOT = 5
_DATA = json.loads(resources.files("k3rocm.deploy").joinpath("upstream_ref.json").read_text())
# [PR52494]/[PR57640]: the fusions moved C=1 decode ITL p50/p90 by about this much (relative)
LATENCY_AB_EFFECT: float = _DATA["latency_ab_effect"]


@dataclass(frozen=True)
class Figure:
    """One row of upstream_ref.json; a condition is (what the figure had, fact, its value)."""

    key: str
    measures: tuple[str, ...]
    value: str
    setup: str
    source: str
    conditions: tuple[tuple[str, str, Any], ...]
    notes: tuple[str, ...] = ()


FIGURES: tuple[Figure, ...] = tuple(
    Figure(**{**row, "measures": tuple(row["measures"]), "notes": tuple(row["notes"]),
              "value": row["value"].format_map(_DATA),
              "conditions": tuple(tuple(c) for item in row["conditions"]
                                  for c in (_DATA["setups"][item] if isinstance(item, str)
                                            else [item]))})
    for row in _DATA["figures"])


def _show(v: Any) -> str:
    if v is None:
        return "unknown"
    if isinstance(v, bool):
        return "on" if v else "off"
    return str(v)


def _facts(s: Mapping[str, Any], env: Mapping[str, str] | None,
           workload: str | Mapping[str, Any] | None) -> dict[str, tuple[Any, str]]:
    """Fact -> (its value in this result, None if unknown; how the result reads)."""
    from k3rocm.serving import profiles

    wl = workload if isinstance(workload, Mapping) else {}
    profile, hw = s.get("profile"), None
    if isinstance(profile, str) and profile in profiles.names():
        hw = profiles.get(profile)["meta"]["hardware"]
    k, method = s.get("mtp_k"), s.get("mtp_method")
    spec = None if k is None else "off" if k == 0 else [method, k]
    steps = int(wl["steps"]) if wl.get("steps") is not None else s.get("profiler_max_iterations")
    isl, osl, c = wl.get("isl"), wl.get("osl"), wl.get("concurrency")
    load = None if None in (isl, osl, c) else [int(isl), int(osl), int(c)]
    name = workload if isinstance(workload, str) else wl.get("name")
    kv = s.get("kv_cache_dtype")
    return {
        "hardware": (hw, f"profile {profile!r} (hardware {hw or 'unknown'})"),
        "tp": (s.get("tp"), f"TP {_show(s.get('tp'))}"),
        "speculative": (spec, "MTP unknown" if k is None else "no speculative decoding"
                        if k == 0 else f"speculative decoding {method} k={k}"),
        "compilation_override": _compilation_override(s),
        "fp8_kv": (None if kv is None else str(kv).startswith("fp8"), f"KV cache {_show(kv)}"),
        "aiter_mla": _aiter_mla(env),
        "steps": (steps, f"{_show(steps)} profiled steps"),
        "load": ([131072, 1024, 8], "workload trace-128k") if workload == "trace-128k" else
                (load, f"load ISL {_show(isl)} / OSL {_show(osl)} at concurrency {_show(c)}"),
        "workload": (name, f"workload {_show(name)}"),
        "gsm8k_task": _gsm8k_task(workload),
    }


def _compilation_override(s: Mapping[str, Any]) -> tuple[bool | None, str]:
    extra, eager = s.get("extra_args"), s.get("enforce_eager")
    if extra is None or eager is None:
        return None, "vLLM argv unknown"
    try:
        words = shlex.split(extra)
    except ValueError:
        return True, f"K3_EXTRA_ARGS {extra!r} does not parse"
    flags = [w for w in words if w.startswith(("--compilation-config", "-O", "-cc"))]
    if flags:
        return True, f"compilation override {' '.join(flags)} in K3_EXTRA_ARGS"
    if eager:
        return True, "--enforce-eager (no graphs)"
    return False, "no compilation override"


def _aiter_mla(env: Mapping[str, str] | None) -> tuple[bool | None, str]:
    if env is None:
        return None, "server environment unknown"
    on = env.get("VLLM_ROCM_USE_AITER") == "1" and env.get("VLLM_ROCM_USE_AITER_MLA") != "0"
    return on, ("AITER MLA on" if on else
                f"VLLM_ROCM_USE_AITER={env.get('VLLM_ROCM_USE_AITER', 'unset')} "
                f"VLLM_ROCM_USE_AITER_MLA={env.get('VLLM_ROCM_USE_AITER_MLA', 'unset')}")


def _gsm8k_task(workload: Any) -> tuple[bool | None, str]:
    if not isinstance(workload, Mapping):
        return None, "GSM8K task settings unknown"
    shots, limit = workload.get("num_fewshot"), workload.get("limit")
    ref_task = workload.get("reference_task_config")
    if shots != GSM8K_FEWSHOT:
        return False, f"{_show(shots)}-shot"
    if limit:
        return False, (f"a subset of {limit} items (the reference's +-0.0051 is for the full "
                       "test set)")
    if ref_task is not True:
        return (None if ref_task is None else False), "not the reference task config"
    return True, "the reference task config, 5-shot, full test set"


def _resolve(settings: Any, env: Mapping[str, str] | None
             ) -> tuple[dict[str, Any], Mapping[str, str] | None]:
    """Field -> value, and the server's environment. A mapping with ``K3_*`` keys is a
    container environment: resolved as the entrypoint resolves it (vendor env rendered on top).
    """
    from k3rocm.errors import UsageError
    from k3rocm.serving.config import render

    if hasattr(settings, "model_dump"):
        return settings.model_dump(), env
    raw = {str(k): v for k, v in dict(settings or {}).items()}
    if not any(k.startswith("K3_") for k in raw):
        return raw, env
    container = {k: str(v) for k, v in raw.items() if v is not None}
    try:
        r = render(environ=container, dotenv=None, check_model=False)
    except UsageError:  # not a valid setting set: every setting unknown
        return {}, container if env is None else env
    return r.settings.model_dump(), {**container, **r.env} if env is None else env


def comparable_with(measure: str, settings: Any, env: Mapping[str, str] | None = None,
                    workload: str | Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Which upstream figure the result of ``measure`` (one of MEASURES) is comparable with.

    ``settings``: Settings, a mapping of its fields, or the server container's env (``K3_*``).
    ``env``: the server's vendor env. ``workload``: bench: its name; census: ``isl``, ``osl``,
    ``concurrency``, ``steps``; gsm8k: ``num_fewshot``, ``limit``, ``reference_task_config``.
    Returns JSON-able ``comparable``, ``figure``, ``also``, ``text``, ``reference``, ``checked``,
    ``not_comparable``.
    """
    if measure not in MEASURES:
        raise ValueError(f"measure {measure!r}: use one of {', '.join(MEASURES)}")
    settings, env = _resolve(settings, env)
    facts = _facts(settings, env, workload)
    matches: list[tuple[Figure, list[dict[str, Any]]]] = []
    why_not: dict[str, str] = {}
    for fig in FIGURES:
        if measure not in fig.measures:
            continue
        checked, reasons = [], []
        for want, fact, there in fig.conditions:
            value, have = facts[fact]
            ok = None if value is None else value == there
            checked.append({"reference": want, "result": have, "ok": ok})
            if ok is not True:
                reasons.append(f"{have} ({'unknown' if ok is None else 'differs'}; "
                               f"upstream: {want})")
        if reasons:
            why_not[fig.key] = "; ".join(reasons)
        else:
            matches.append((fig, checked))
    if matches:
        fig, checked = matches[0]
        side = _side(measure, settings, fig)
        also = [f.key for f, _ in matches[1:]]
        text = (f"comparable with the upstream {fig.value} ({fig.setup}){side}"
                + (f"; also {', '.join(also)}" if also else ""))
        ref = {"value": fig.value, "setup": fig.setup, "source": fig.source,
                "notes": list(fig.notes)}
        return {"comparable": True, "figure": fig.key, "also": also, "text": text,
                "reference": ref, "checked": checked, "not_comparable": why_not}
    if not why_not:
        text = ("not comparable with any upstream figure: the upstream PRs publish no "
                + {"bench": "absolute latency or throughput (its latency figure is a fusion "
                   "off/on difference: bench-ab on decode-8k1k)"}.get(measure, "figure for it"))
    else:
        key, reason = next(iter(why_not.items()))
        text = f"not comparable with any upstream figure: {reason} [{key}]"
    return {"comparable": False, "figure": None, "also": [], "text": text, "reference": None,
            "checked": [], "not_comparable": why_not}


def _side(measure: str, s: Mapping[str, Any], fig: Figure) -> str:
    """For a single-arm census: which side of the stock -> fused pair this run is."""
    on = s.get("fuse_decode_qprep")
    if measure != "census" or not fig.key.startswith("qprep") or on is None:
        return ""
    fused = bool(on) and s.get("overlay") != "off"
    return "; this run is the " + ("fused side" if fused else "stock side")
