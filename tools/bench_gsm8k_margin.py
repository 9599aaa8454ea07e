"""Benchmark (not a unit test; ~1 min): gsm8k-ab's non-inferiority verdict simulated with the
project's own function, ``stats.paired_accuracy``, >= 2000 A/Bs per cell, beside the exact rate
``stats.noninferiority_pass_rate`` gives for the same cell.

Cells: n = 1319 items; agreement 99/98/97/96% (the fraction of items scored the same in both
arms); B equally accurate (drop 0: a fail is a false fail) or one point less accurate (a pass is
a false pass); the default margin and a 1-point one.

    PYTHONPATH=src python tools/bench_gsm8k_margin.py [--trials 2000] [--seed 29]
"""

from __future__ import annotations

import argparse

import numpy as np

from k3rocm.checks.bench import stats
from k3rocm.checks.gsm8k.ab import DEFAULT_MARGIN, DROP
from k3rocm.checks.gsm8k.data import GSM8K_TEST_ITEMS


def simulate(rng, n: int, agreement: float, drop: float, margin: float, trials: int) -> float:
    """Fraction of simulated A/Bs read "non-inferior": per item, right only in A with
    probability (d + drop) / 2, only in B (d - drop) / 2 (d = 1 - agreement), else the same."""
    d = 1 - agreement
    pa, pb = (d + drop) / 2, (d - drop) / 2
    passed = 0
    for _ in range(trials):
        a_only, b_only, same = rng.multinomial(n, [pa, pb, 1 - pa - pb])
        right_same = rng.binomial(same, 0.9644)  # the reference accuracy (no effect on the bound)
        a = [True] * a_only + [False] * b_only + [True] * right_same + [False] * (same - right_same)
        b = [False] * a_only + [True] * b_only + [True] * right_same + [False] * (same - right_same)
        passed += stats.paired_accuracy(a, b, margin)["non_inferior"]
    return passed / trials


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=29)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    n, t = GSM8K_TEST_ITEMS, args.trials
    se = 100 * (0.25 / t) ** 0.5
    print(f"n = {n} items, {t} simulated A/Bs per cell (binomial SE <= {se:.1f} points)")
    print("| margin | agreement | B vs A | rate | simulated | exact |")
    print("|---:|---:|---|---|---:|---:|")
    for margin in (DEFAULT_MARGIN, 0.01):
        for agreement in (0.99, 0.98, 0.97, 0.96):
            for drop in (0.0, DROP):
                sim = simulate(rng, n, agreement, drop, margin, t)
                exact = stats.noninferiority_pass_rate(n, margin, 1 - agreement, drop)
                what, shown = (("false fail", 1 - sim), 1 - exact) if drop == 0 else \
                    (("false pass", sim), exact)
                label = "equal" if drop == 0 else f"-{drop * 100:g} point"
                print(f"| {margin * 100:g} pt | {agreement:.0%} | {label} | {what[0]} | "
                      f"{what[1]:.1%} | {shown:.1%} |", flush=True)


if __name__ == "__main__":
    main()
