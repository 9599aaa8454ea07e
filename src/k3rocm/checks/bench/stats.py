"""A/B statistics: median of repeats per arm, relative difference, hierarchical bootstrap CI,
verdict, and the repeats needed to resolve a given difference.

Model: each run of an arm is one complete aiperf run of the workload on a freshly started
server (or, with runs-per-server K > 1, the k-th of K runs on it); its value for (metric, stat)
is computed from that run's successful profiling-phase requests exactly as in the summary (e.g.
ITL p50 over requests). The arm's value is the median over its runs; the effect is
d = (B - A) / A. The 95% CI comes from a hierarchical bootstrap that resamples servers
(server-to-server noise), runs within a server, and requests within a run (request noise);
run-level metrics (output tokens/s) stop at the run level.

Verdict: the CI contains 0 -> "within noise"; otherwise "B faster" / "B slower" (direction per
metric: lower latency, higher throughput is faster). When an A/A noise floor for the same
protocol is known, an effect no larger than the floor is also "within noise". With one server
per arm the CI holds no server-to-server noise: an effect then counts only when it exceeds the
A/A floor (without a floor the verdict is "within noise"); use --repeats >= 2 (A B B A).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from k3rocm.errors import UsageError

# (key, stat, label, lower_is_better)
AB_METRICS: list[tuple[str, str, str, bool]] = [
    ("itl", "p50", "ITL p50", True),
    ("itl", "p90", "ITL p90", True),
    ("ttft", "p50", "TTFT p50", True),
    ("e2el", "p50", "E2E p50", True),
    ("output_tps", "avg", "output tokens/s", False),
]
PCT = {"p50": 50.0, "p90": 90.0, "p99": 99.0}
CONFIDENCE = 0.95
Z = {0.95: 1.959964, 0.8: 0.841621}


def _np():
    try:
        import numpy as np
    except ModuleNotFoundError:
        raise UsageError("A/B statistics need numpy: pip install 'k3rocm[host]'", 2) from None
    return np


def _stat(np, x, stat: str) -> float:
    if stat == "avg":
        return float(np.mean(x))
    return float(np.percentile(x, PCT[stat]))  # linear interpolation, as aiperf


def _flatten(groups: Sequence[Any]) -> list[Any]:
    """Accept a flat list of runs or a list of servers each holding a list of runs."""
    out: list[Any] = []
    for g in groups:
        if isinstance(g, list) and g and not isinstance(g[0], (int, float)):
            out.extend(g)
        else:
            out.append(g)
    return out


def _groups(reps: Sequence[Any]) -> list[list[Any]]:
    out = []
    for g in reps:
        if isinstance(g, list) and g and not isinstance(g[0], (int, float)):
            out.append(list(g))
        else:
            out.append([g])
    return out


def arm_value(reps: Sequence[Any], stat: str) -> float:
    """Median over runs of the per-run statistic. ``reps`` holds per-request arrays (or floats
    for run-level metrics), optionally grouped per server: [[run, run], [run, run]]."""
    np = _np()
    vals = [r if isinstance(r, (int, float)) else _stat(np, np.asarray(r, float), stat)
            for r in _flatten(reps)]
    return float(np.median(vals))


def bootstrap_diff(a_reps: Sequence[Any], b_reps: Sequence[Any], stat: str, n_boot: int = 2000,
                   seed: int = 20260807, confidence: float = CONFIDENCE) -> dict[str, Any]:
    """Relative difference (B-A)/A of the arms' medians with a hierarchical bootstrap CI:
    resample servers, then runs within each server, then requests within each run."""
    np = _np()
    if not a_reps or not b_reps:
        return {"d": None, "lo": None, "hi": None, "n_a": len(_flatten(a_reps)),
                "n_b": len(_flatten(b_reps))}
    a_val, b_val = arm_value(a_reps, stat), arm_value(b_reps, stat)
    d = (b_val - a_val) / a_val if a_val else math.nan
    rng = np.random.default_rng(seed)
    ga = [[r if isinstance(r, (int, float)) else np.asarray(r, float) for r in g]
          for g in _groups(a_reps)]
    gb = [[r if isinstance(r, (int, float)) else np.asarray(r, float) for r in g]
          for g in _groups(b_reps)]

    def one(groups) -> float:
        vals = []
        for gi in rng.integers(0, len(groups), size=len(groups)):
            group = groups[gi]
            for ri in rng.integers(0, len(group), size=len(group)):
                r = group[ri]
                if isinstance(r, (int, float)):
                    vals.append(float(r))
                else:
                    vals.append(_stat(np, r[rng.integers(0, len(r), size=len(r))], stat))
        return float(np.median(vals))

    boots = []
    for _ in range(n_boot):
        a, b = one(ga), one(gb)
        if a:
            boots.append((b - a) / a)
    alpha = (1 - confidence) / 2
    lo, hi = (float(np.quantile(boots, alpha)), float(np.quantile(boots, 1 - alpha))) \
        if boots else (math.nan, math.nan)
    return {"a": a_val, "b": b_val, "d": d, "lo": lo, "hi": hi, "halfwidth": (hi - lo) / 2,
            "n_a": len(_flatten(a_reps)), "n_b": len(_flatten(b_reps)), "servers_a": len(ga),
            "servers_b": len(gb), "n_boot": n_boot, "confidence": confidence}


def verdict(res: dict, lower_is_better: bool, floor: float | None = None) -> str:
    d, lo, hi = res.get("d"), res.get("lo"), res.get("hi")
    if d is None or lo is None or hi is None or any(map(math.isnan, (d, lo, hi))):
        return "no data"
    if lo <= 0 <= hi:
        return "within noise"
    if floor is not None and abs(d) <= floor:
        return "within noise"
    if floor is None and min(res.get("servers_a", 2), res.get("servers_b", 2)) < 2:
        # One server per arm: resampling cannot see server-to-server noise, so a CI that
        # excludes 0 may only say "these two servers differ". Without an A/A floor to beat,
        # that is not evidence of an effect.
        return "within noise"
    better = hi < 0 if lower_is_better else lo > 0
    return "B faster" if better else "B slower"


def repeats_needed(halfwidth: float | None, n_per_arm: int, effect: float = 0.01,
                   power: float | None = None) -> int | None:
    """Repeats per arm for the CI half-width to shrink to ``effect`` (CI excludes 0 for a true
    effect of that size about half the time); with ``power`` (e.g. 0.8) the half-width is
    shrunk further to z/(z+z_power) of the effect. Assumes half-width ~ 1/sqrt(repeats), the
    per-repeat request count unchanged."""
    if not halfwidth or n_per_arm < 1 or math.isnan(halfwidth):
        return None
    target = effect
    if power is not None:
        target = effect * Z[CONFIDENCE] / (Z[CONFIDENCE] + Z[power])
    return max(1, math.ceil(n_per_arm * (halfwidth / target) ** 2))
