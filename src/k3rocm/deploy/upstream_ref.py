"""Which published upstream figure, if any, a result is comparable with, and why not otherwise.

Sources: [PR52494] vLLM PR #52494 (q/kv RMSNorm fusion: 144 ``aiter::fused_qk_rmsnorm_kernel``
launches over 6 steps on MI355X TP=8, MTP k=2, ISL 128k / OSL 1k, conc 8; GSM8K 5-shot 0.9644 +-
0.0051 with its lm-eval task config, shipped as checks/gsm8k/gsm8k.yaml). [PR57640] vLLM PR
#57640 (decode Q-prep: 288 -> 144 launches, 1351.8 -> 682.8 us per rank over 6 decode steps,
plain ``vllm serve``, no MTP, no compilation override, fp8 KV, AITER MLA). [aiperf] the PRs'
latency A/B (8k/1k, concurrency 1,4,8): C=1 ITL p50/p90 moved ~0.5%. Figures whose server
settings the PRs do not state are checked on what is stated only.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

MEASURES = ("bench", "bench-ab", "census", "census-ab", "gsm8k")
TRACE_ISL, TRACE_OSL, TRACE_CONCURRENCY, TRACE_STEPS = 131072, 1024, 8, 6
LATENCY_WORKLOAD = "decode-8k1k"
# [PR52494]/[PR57640]: the fusions moved C=1 decode ITL p50/p90 by about this much (relative)
LATENCY_AB_EFFECT = 0.005
GSM8K_FEWSHOT = 5

# (what the figure had, check(facts) -> (ok, what the result had))
Check = Callable[["_Facts"], "tuple[bool | None, str]"]


@dataclass(frozen=True)
class Figure:
    key: str
    measures: tuple[str, ...]
    value: str
    setup: str
    source: str
    conditions: tuple[tuple[str, Check], ...]
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Facts:

    measure: str
    s: Mapping[str, Any]
    env: Mapping[str, str] | None
    workload: str | Mapping[str, Any] | None

    def get(self, field: str) -> Any:
        return self.s.get(field)

    def hardware(self) -> str | None:
        from k3rocm.serving import profiles

        name = self.s.get("profile")
        if not isinstance(name, str) or name not in profiles.names():
            return None
        return profiles.get(name)["meta"]["hardware"]

    def wl(self, key: str) -> Any:
        return self.workload.get(key) if isinstance(self.workload, Mapping) else None

    def steps(self) -> int | None:
        v = self.wl("steps")
        return int(v) if v is not None else self.s.get("profiler_max_iterations")


def _eq(field: str, want: Any, label: str) -> tuple[str, Check]:
    def check(f: _Facts) -> tuple[bool | None, str]:
        have = f.get(field)
        return (None if have is None else have == want), f"{label} {_show(have)}"
    return f"{label} {_show(want)}", check


def _show(v: Any) -> str:
    if v is None:
        return "unknown"
    if isinstance(v, bool):
        return "on" if v else "off"
    return str(v)


def _hardware(f: _Facts) -> tuple[bool | None, str]:
    hw = f.hardware()
    return (None if hw is None else hw == "amd"), (
        f"profile {f.get('profile')!r} (hardware {hw or 'unknown'})")


def _mtp(k: int) -> Check:
    def check(f: _Facts) -> tuple[bool | None, str]:
        have_k, method = f.get("mtp_k"), f.get("mtp_method")
        if have_k is None:
            return None, "MTP unknown"
        if have_k == 0:
            return k == 0, "no speculative decoding"
        ok = k > 0 and have_k == k and method == "mtp"
        return ok, f"speculative decoding {method} k={have_k}"
    return check


def _no_compilation_override(f: _Facts) -> tuple[bool | None, str]:
    extra, eager = f.get("extra_args"), f.get("enforce_eager")
    if extra is None or eager is None:
        return None, "vLLM argv unknown"
    try:
        words = shlex.split(extra)
    except ValueError:
        return False, f"K3_EXTRA_ARGS {extra!r} does not parse"
    flags = [w for w in words if w.startswith(("--compilation-config", "-O", "-cc"))]
    if flags:
        return False, f"compilation override {' '.join(flags)} in K3_EXTRA_ARGS"
    if eager:
        return False, "--enforce-eager (no graphs)"
    return True, "no compilation override"


def _fp8_kv(f: _Facts) -> tuple[bool | None, str]:
    kv = f.get("kv_cache_dtype")
    return (None if kv is None else str(kv).startswith("fp8")), f"KV cache {_show(kv)}"


def _aiter_mla(f: _Facts) -> tuple[bool | None, str]:
    if f.env is None:
        return None, "server environment unknown"
    on = f.env.get("VLLM_ROCM_USE_AITER") == "1" and f.env.get("VLLM_ROCM_USE_AITER_MLA") != "0"
    return on, ("AITER MLA on" if on else
                f"VLLM_ROCM_USE_AITER={f.env.get('VLLM_ROCM_USE_AITER', 'unset')} "
                f"VLLM_ROCM_USE_AITER_MLA={f.env.get('VLLM_ROCM_USE_AITER_MLA', 'unset')}")


def _steps(f: _Facts) -> tuple[bool | None, str]:
    n = f.steps()
    return (None if n is None else n == TRACE_STEPS), f"{_show(n)} profiled steps"


def _trace_load(f: _Facts) -> tuple[bool | None, str]:
    isl, osl, c = f.wl("isl"), f.wl("osl"), f.wl("concurrency")
    if f.workload == "trace-128k":
        return True, "workload trace-128k"
    if None in (isl, osl, c):
        return None, f"load ISL {_show(isl)} / OSL {_show(osl)} at concurrency {_show(c)}"
    ok = (int(isl), int(osl), int(c)) == (TRACE_ISL, TRACE_OSL, TRACE_CONCURRENCY)
    return ok, f"load ISL {isl} / OSL {osl} at concurrency {c}"


def _latency_workload(f: _Facts) -> tuple[bool | None, str]:
    name = f.workload if isinstance(f.workload, str) else f.wl("name")
    return (None if name is None else name == LATENCY_WORKLOAD), f"workload {_show(name)}"


def _gsm8k_task(f: _Facts) -> tuple[bool | None, str]:
    if not isinstance(f.workload, Mapping):
        return None, "GSM8K task settings unknown"
    shots, limit = f.wl("num_fewshot"), f.wl("limit")
    ref_task = f.wl("reference_task_config")
    if shots != GSM8K_FEWSHOT:
        return False, f"{_show(shots)}-shot"
    if limit:
        return False, (f"a subset of {limit} items (the reference's +-0.0051 is for the full "
                       "test set)")
    if ref_task is not True:
        return (None if ref_task is None else False), "not the reference task config"
    return True, "the reference task config, 5-shot, full test set"


_AMD = ("8x MI355X (an AMD profile)", _hardware)
_TP8 = _eq("tp", 8, "TP")
# The setup of vLLM PR #57640's Q-prep figures (launches and time).
_QPREP = (_AMD, _TP8, ("no speculative decoding", _mtp(0)),
          ("no compilation override", _no_compilation_override),
          ("fp8 KV cache", _fp8_kv), ("AITER MLA on", _aiter_mla),
          (f"{TRACE_STEPS} profiled steps", _steps))

FIGURES: tuple[Figure, ...] = (
    Figure(
        key="qprep-launches",
        measures=("census", "census-ab"),
        value="decode Q-prep launches per rank (vLLM PR #57640): 288 stock -> 144 fused over 6 "
              "decode steps (48 -> 24 per step: 2 -> 1 per MLA layer)",
        setup="8x MI355X TP=8, plain `vllm serve` on the stock nightly, no speculative "
              "decoding, no compilation-config override, fp8 KV cache, AITER MLA on, 6 decode "
              "steps (profile fusion-evidence)",
        source="[PR57640] the measurement, its gates and its setup",
        conditions=_QPREP,
        notes=("launches per decode step do not depend on the prompt length or the batch "
               "size; the PR's trace used ISL 128k / OSL 1k at concurrency 8 [PR57640]",)),
    Figure(
        key="qprep-time",
        measures=("census", "census-ab"),
        value="decode Q-prep GPU time per rank (vLLM PR #57640): 1351.8 -> 682.8 us over 6 "
              "decode steps (9.39 -> 4.74 us per MLA layer per step)",
        setup="as qprep-launches, under ISL 128k / OSL 1k at concurrency 8",
        source="[PR57640] the measurement, the profiler-trace load and the setup",
        conditions=(*_QPREP, ("load ISL 131072 / OSL 1024 at concurrency 8", _trace_load))),
    Figure(
        key="qknorm-launches",
        measures=("census", "census-ab"),
        value="aiter::fused_qk_rmsnorm_kernel launches on rank 0 (vLLM PR #52494): 144 over 6 "
              "engine steps (= 24 MLA layers x 6), the paired per-layer q/kv norm launches gone",
        setup="8x MI355X TP=8, MTP k=2, ISL 128k / OSL 1k at concurrency 8, 6 engine steps",
        source="[PR52494] the trace evidence",
        conditions=(_AMD, _TP8, ("speculative decoding mtp k=2", _mtp(2)),
                    ("AITER MLA on", _aiter_mla), (f"{TRACE_STEPS} profiled steps", _steps)),
        notes=("launches per step do not depend on the prompt length or the batch size; the "
               "PR's trace used ISL 128k / OSL 1k at concurrency 8 [PR52494]",)),
    Figure(
        key="gsm8k",
        measures=("gsm8k",),
        value="GSM8K 5-shot exact_match (vLLM PR #52494): 0.9644 +- 0.0051 (strict-match and "
              "flexible-extract)",
        setup="8x MI355X TP=8, MTP k=2, vLLM PR #52494's lm-eval gsm8k task config, greedy, "
              "full test set",
        source="[PR52494] the GSM8K result, its protocol and its task config",
        conditions=(_AMD, _TP8, ("speculative decoding mtp k=2", _mtp(2)),
                    ("the reference task config, 5-shot, full test set", _gsm8k_task)),
        notes=("the PR states no other server setting for this run",)),
    Figure(
        key="latency-ab",
        measures=("bench-ab",),
        value="fusion off vs on (vLLM PRs #52494, #57640): C=1 decode ITL p50/p90 moved "
              f"~{LATENCY_AB_EFFECT:.1%} (within serving noise); end-to-end throughput unchanged "
              "within noise",
        setup="8x MI355X TP=8, aiperf fixed 8k/1k, no prefix sharing, concurrency 1,4,8",
        source="[aiperf] the latency protocol and result; [PR57640] throughput unchanged",
        conditions=(_AMD, _TP8, (f"workload {LATENCY_WORKLOAD}", _latency_workload)),
        notes=("the PRs state no server setting for their latency A/B beyond TP=8; a delta is "
               "comparable, absolute latencies are not (the PRs publish none)",)),
)


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
    facts = _Facts(measure, *_resolve(settings, env), workload)
    matches: list[tuple[Figure, list[dict[str, Any]]]] = []
    why_not: dict[str, str] = {}
    for fig in FIGURES:
        if measure not in fig.measures:
            continue
        checked, reasons = [], []
        for want, check in fig.conditions:
            ok, have = check(facts)
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
        side = _side(facts, fig)
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


def _side(f: _Facts, fig: Figure) -> str:
    """For a single-arm census: which side of the stock -> fused pair this run is."""
    if f.measure != "census" or not fig.key.startswith("qprep"):
        return ""
    on, overlay = f.get("fuse_decode_qprep"), f.get("overlay")
    if on is None:
        return ""
    fused = bool(on) and overlay != "off"
    return "; this run is the " + ("fused side" if fused else "stock side")
