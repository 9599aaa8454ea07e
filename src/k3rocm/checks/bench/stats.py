"""A/B statistics with the server as the unit of replication (scipy.stats distributions).

Each freshly started server gives one value per (metric, stat): the mean over its runs of the
run statistic. Effect d = exp(mean log B - mean log A) - 1, Student t on the pooled
between-server variance of log values (df = n_A + n_B - 2, plus an A/A's df when its variance
component is pooled). The primary row is judged at ALPHA, the others with Holm's step-down.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Sequence
from typing import Any

from k3rocm.checks.bench import summary

# (key, stat, label, lower_is_better)
AB_METRICS: list[tuple[str, str, str, bool]] = [
    ("itl", "p50", "ITL p50", True),
    ("itl", "p90", "ITL p90", True),
    ("ttft", "p50", "TTFT p50", True),
    ("e2el", "p50", "E2E p50", True),
    ("output_tps", "avg", "output tokens/s", False),
]
ALPHA = 0.05
POWER = 0.80
_z = statistics.NormalDist().inv_cdf
MULTIPLICITY = "Holm (step-down) over the secondary rows, family-wise 5%"
# A pooled A/A is refused when this run is noisier than it (one-sided F test at this level):
# a quieter A/A would make the test too eager (measured: tests/test_bench_unit.py,
# test_a_quieter_aa_is_not_pooled_and_lowers_the_false_rate).
FLOOR_CHECK_ALPHA = 0.05


def _dist():
    """scipy.stats, imported on first use (slow to import; the CLI imports this module)."""
    from scipy import stats

    return stats


@functools.lru_cache(maxsize=4096)
def _tq(p: float, df: int) -> float:
    return float(_dist().t.ppf(p, df))


def server_value(runs: Sequence[Sequence[float] | float], stat: str) -> float:
    """Mean over a server's runs of the run statistic (a float as is, else avg/pXX)."""
    vals = [float(r) if isinstance(r, (int, float)) else summary.stat_of(r, stat) for r in runs]
    return sum(vals) / len(vals)


def _logs(values: Sequence[float]) -> list[float]:
    return [math.log(v) for v in values if v and v > 0]


def variance_component(values: Sequence[float]) -> dict[str, Any] | None:
    """Between-server variance of log values of identical servers (an A/A's servers)."""
    logs = _logs(values)
    return {"var_log": statistics.variance(logs), "df": len(logs) - 1} if len(logs) > 1 else None


def mde(var_log: float, df: int, n_a: int, n_b: int, alpha: float = ALPHA,
        power: float = POWER) -> float:
    """Smallest relative effect found with ``power`` (two-sided ``alpha``)."""
    k = _tq(1 - alpha / 2, df) + _tq(power, df)
    return math.exp(k * math.sqrt(var_log * (1 / n_a + 1 / n_b))) - 1


def servers_needed(var_log: float, effect: float = 0.01, extra_df: int = 0,
                   alpha: float = ALPHA, power: float = POWER, cap: int = 10000) -> int | None:
    """Servers per arm so that ``effect`` is the MDE (df = 2n - 2 + extra_df)."""
    z = _z(1 - alpha / 2) + _z(power)  # the normal approximation is a lower bound
    for n in range(max(1, math.floor(2 * z ** 2 * var_log / math.log1p(effect) ** 2)), cap + 1):
        df = 2 * n - 2 + extra_df
        if df >= 1 and mde(var_log, df, n, n, alpha, power) <= effect:
            return n
    return None


def floor_check(own_var: float, own_df: int, floor: dict[str, Any],
                level: float = FLOOR_CHECK_ALPHA) -> dict[str, Any]:
    """Does the A/A's variance component describe this run? {"pooled", "note", ...}."""
    out: dict[str, Any] = {"own_var_log": own_var, "own_df": own_df,
                           "aa_var_log": floor["var_log"], "aa_df": floor["df"]}
    if own_df < 1:
        return {**out, "pooled": True, "checked": False,
                "note": "A/A pooled unchecked: one server per arm has no variance of its own to "
                        "compare it with"}
    ratio = own_var / floor["var_log"] if floor["var_log"] > 0 else math.inf
    f = _dist().f
    p_noisier = float(f.sf(ratio, own_df, floor["df"])) if math.isfinite(ratio) else 0.0
    p_quieter = float(f.cdf(ratio, own_df, floor["df"])) if math.isfinite(ratio) else 1.0
    cv = (f"server CV {math.sqrt(own_var) * 100:.2f}% here vs "
          f"{math.sqrt(floor['var_log']) * 100:.2f}% in the A/A")
    out.update(checked=True, ratio=ratio, p_run_noisier=p_noisier)
    if p_noisier < level:
        return {**out, "pooled": False,
                "note": f"A/A not pooled: this run is noisier than the A/A ({cv}; F test "
                        f"p={p_noisier:.2g} < {level:g}): judged on its own servers"}
    if p_quieter < level:
        return {**out, "pooled": True,
                "note": f"A/A pooled, noisier than this run ({cv}; F test p={p_quieter:.2g}): "
                        "the test is conservative"}
    return {**out, "pooled": True, "note": f"A/A pooled ({cv}; F test p={p_noisier:.2g})"}


def compare_servers(a: Sequence[float], b: Sequence[float],
                    floor: dict[str, Any] | None = None, alpha: float = ALPHA,
                    check_floor: bool = True) -> dict[str, Any]:
    """Effect of B vs A on per-server values: t test, 95% CI (lo, hi), MDE at ``alpha``.
    ``floor``: an A/A variance component ({"var_log", "df"}), pooled unless
    :func:`floor_check` refuses it (``check_floor`` False: pooled unchecked)."""
    la, lb = _logs(a), _logs(b)
    out: dict[str, Any] = {"servers_a": len(la), "servers_b": len(lb),
                           "server_values_a": list(a), "server_values_b": list(b),
                           "d": None, "lo": None, "hi": None, "p": None, "df": 0,
                           "var_log": None, "mde": None, "servers_for_1pct": None,
                           "floor_used": bool(floor), "floor_check": None}
    if not la or not lb:
        return out
    ma, mb = statistics.fmean(la), statistics.fmean(lb)
    out.update(a=math.exp(ma), b=math.exp(mb), d=math.exp(mb - ma) - 1)
    ss = sum((x - ma) ** 2 for x in la) + sum((x - mb) ** 2 for x in lb)
    own_df = len(la) + len(lb) - 2
    if floor and check_floor:
        chk = out["floor_check"] = floor_check(ss / own_df if own_df else 0.0, own_df, floor)
        floor = floor if chk["pooled"] else None
        out["floor_used"] = bool(floor)
    extra_df = floor["df"] if floor else 0
    ss += floor["var_log"] * extra_df if floor else 0.0
    df = out["df"] = own_df + extra_df
    if df < 1:
        return out
    var = ss / df
    se = math.sqrt(var * (1 / len(la) + 1 / len(lb)))
    diff = mb - ma
    out.update(var_log=var, server_cv=math.sqrt(var), log_d=diff, se=se,
               p=float(2 * _dist().t.sf(abs(diff) / se, df)) if se > 0 else float(not diff),
               mde=mde(var, df, len(la), len(lb), alpha),
               servers_for_1pct=servers_needed(var, 0.01, extra_df, alpha))
    out["lo"], out["hi"] = interval(out)
    return out


def interval(res: dict, alpha: float = ALPHA) -> tuple[float | None, float | None]:
    """Two-sided (1 - alpha) CI of d; excludes 0 exactly when p < alpha."""
    if res.get("se") is None or not res.get("df"):
        return None, None
    q = _tq(1 - alpha / 2, res["df"])
    return (math.exp(res["log_d"] - q * res["se"]) - 1,
            math.exp(res["log_d"] + q * res["se"]) - 1)


def _by_p(ps: Sequence[float | None]) -> list[int]:
    return sorted((i for i, p in enumerate(ps) if p is not None), key=lambda i: ps[i])


def holm_levels(ps: Sequence[float | None], alpha: float = ALPHA) -> list[float | None]:
    """The level Holm's step-down judged each p at (alpha / (m - step), frozen at the first
    step not rejected): a CI at it excludes 0 exactly when the Holm-adjusted p < alpha."""
    idx = _by_p(ps)
    m, out, stop = len(idx), [None] * len(ps), None
    for rank, i in enumerate(idx):
        if stop is None and ps[i] * (m - rank) >= alpha:
            stop = rank
        out[i] = alpha / (m - (rank if stop is None else stop))
    return out


def holm(ps: Sequence[float | None]) -> list[float | None]:
    """Holm step-down adjusted p-values (None stays None)."""
    idx = _by_p(ps)
    m, out, run = len(idx), [None] * len(ps), 0.0
    for rank, i in enumerate(idx):
        run = max(run, min(1.0, (m - rank) * ps[i]))
        out[i] = run
    return out


def verdict(res: dict, lower_is_better: bool, p: float | None = None,
            alpha: float = ALPHA) -> str:
    """"B faster" / "B slower" / "inconclusive: ..." at ``p`` (default the row's own); the CI
    named is the row's ``ci_lo``/``ci_hi`` when set, else its 95% CI."""
    p = res.get("p") if p is None else p
    n = min(res.get("servers_a") or 0, res.get("servers_b") or 0)
    if res.get("d") is None:
        return "no data"
    if p is None:
        return (f"inconclusive: no estimate of server-to-server noise with {n} server(s) per "
                "arm and no A/A of this protocol")
    if p < alpha:
        return "B faster" if (res["d"] < 0) == lower_is_better else "B slower"
    lo, hi = (res["ci_lo"], res["ci_hi"]) if res.get("ci_lo") is not None else \
        (res.get("lo"), res.get("hi"))
    ci = f"the CI [{lo * 100:+.2f}%, {hi * 100:+.2f}%] includes 0; " if lo is not None else ""
    return (f"inconclusive: {ci}effects smaller than {pct_text(res['mde'])} cannot be seen "
            f"with {n} server(s) per arm")


def pct_text(x: float) -> str:
    """0.0127 -> '1.3%', 2.117 -> '212%'."""
    v = x * 100
    return f"{v:.0f}%" if v >= 10 else f"{v:.2g}%"


def covers(res: dict, effect: float | None) -> bool | None:
    """Does the row's 95% CI cover a known injected effect? (None: no CI)"""
    if effect is None or res.get("lo") is None or res.get("hi") is None:
        return None
    return res["lo"] <= effect <= res["hi"]


def design_line(var_log: float | None, var_df: int, n: int, metric: str = "ITL p50") -> str:
    """What ``n`` servers per arm can see given a measured A/A variance."""
    if var_log is None:
        return (f"MDE ({metric}): unknown - no A/A of this protocol to measure server-to-server "
                "noise (run the A/A first: --aa)")
    df = 2 * n - 2 + var_df
    m = mde(var_log, df, n, n) if df >= 1 else math.nan
    need = servers_needed(var_log, 0.01, var_df)
    return (f"MDE ({metric}, 80% power, two-sided 5%): {m * 100:.2f}% for an A/B with {n} "
            f"server(s) per arm pooled with this variance; server-to-server CV "
            f"{math.sqrt(var_log) * 100:.2f}% (df {var_df}); servers per arm needed for 1%: "
            f"{need if need else '> 10000'}")


def effect_line(effect: float, n: int, var_log: float | None = None, var_df: int = 0,
                metric: str = "ITL p50") -> str:
    """Can ``n`` servers per arm see ``effect``? Without a measured variance: the MDE as a
    multiple of the unknown server-to-server CV."""
    df = 2 * n - 2 + var_df
    if df < 1:
        return (f"{effect:.1%} {metric}: one server per arm and no A/A: no estimate of "
                "server-to-server noise, no test")
    if var_log is not None:
        m = mde(var_log, df, n, n)
        need = servers_needed(var_log, effect, var_df)
        return (f"{effect:.1%} {metric}: the MDE {m:.2%} " + ("can" if m <= effect else "CANNOT")
                + f" see it with {n} server(s) per arm; servers per arm needed: "
                f"{need if need else '> 10000'}")
    k = (_tq(1 - ALPHA / 2, df) + _tq(POWER, df)) * math.sqrt(2 / n)
    return (f"{effect:.1%} {metric}: with {n} server(s) per arm and no A/A the MDE is {k:.2f} x "
            f"the server-to-server CV: it sees {effect:.1%} only if that CV is <= "
            f"{math.log1p(effect) / k:.2%} (run the A/A first: --aa)")


# --- paired accuracy (GSM8K A/B on the same items)

@functools.lru_cache(maxsize=4096)
def binom_upper(k: int, n: int, alpha: float = ALPHA) -> float:
    """One-sided exact (Clopper-Pearson) upper (1 - alpha) bound on a rate seen k times in n."""
    return float(_dist().binomtest(k, n, alternative="less").proportion_ci(1 - alpha).high)


def mcnemar_exact(b_only: int, a_only: int) -> float:
    """Two-sided exact McNemar p on the discordant counts (Binomial(n, 1/2))."""
    n = b_only + a_only
    return float(_dist().binomtest(b_only, n).pvalue) if n else 1.0


def noninferiority_lower(n: int, b_only: int, a_only: int, alpha: float = ALPHA) -> float:
    """One-sided (1 - alpha) lower bound of B - A: paired Wald, capped by the Clopper-Pearson
    upper bound on the A-only rate (Wald collapses when few items differ)."""
    diff = (b_only - a_only) / n
    var = ((b_only + a_only) / n - diff ** 2) / n
    wald = diff - _z(1 - alpha) * math.sqrt(max(var, 0.0))
    return min(wald, b_only / n - binom_upper(a_only, n, alpha))


def paired_accuracy(a: Sequence[bool], b: Sequence[bool], margin: float,
                    alpha: float = ALPHA) -> dict[str, Any]:
    """Arm A vs B on the same items: accuracies, McNemar, non-inferiority (B - A > -margin)."""
    if len(a) != len(b) or not a:
        raise ValueError("paired accuracy needs the same non-empty item list in both arms")
    n = len(a)
    b_only = sum(1 for x, y in zip(a, b, strict=True) if y and not x)
    a_only = sum(1 for x, y in zip(a, b, strict=True) if x and not y)
    acc_a, acc_b = sum(a) / n, sum(b) / n
    diff = acc_b - acc_a
    lower = noninferiority_lower(n, b_only, a_only, alpha)
    p = mcnemar_exact(b_only, a_only)
    diff_word = ("no difference detected" if p >= alpha
                 else "B more accurate" if diff > 0 else "B less accurate")
    return {"n": n, "acc_a": acc_a, "acc_b": acc_b, "diff": diff, "b_only": b_only,
            "a_only": a_only, "mcnemar_p": p, "mcnemar": diff_word,
            "margin": margin, "lower_bound": lower, "non_inferior": lower > -margin}


def noninferiority_pass_rate(n: int, margin: float, discordant: float, drop: float = 0.0,
                             alpha: float = ALPHA) -> float:
    """Exact rate at which :func:`paired_accuracy` reads "non-inferior" with ``n`` items, a
    ``discordant`` fraction differing and B truly ``drop`` less accurate (multinomial terms
    below 1e-15 left out). ``drop`` 0: power; ``drop`` >= margin: the false-pass rate."""
    if not 0 <= drop <= discordant <= 1:
        raise ValueError("need 0 <= drop <= discordant <= 1")
    if discordant == 0:
        return 1.0 if noninferiority_lower(n, 0, 0, alpha) > -margin else 0.0
    import numpy as np

    binom = _dist().binom
    q = (discordant + drop) / (2 * discordant)  # of a discordant item: right only in A
    p_d, total = binom.pmf(np.arange(n + 1), n, discordant), 0.0
    for d in np.flatnonzero(p_d >= 1e-15):
        p = p_d[d] * binom.pmf(np.arange(d + 1), d, q)
        total += sum(float(p[a]) for a in np.flatnonzero(p >= 1e-15)
                     if noninferiority_lower(n, int(d - a), int(a), alpha) > -margin)
    return min(1.0, total)
