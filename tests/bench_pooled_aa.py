"""Benchmark (~1 min, not a unit test): bench-ab's false verdicts on identical arms with a pooled
A/A from a quieter day, with and without ``stats.floor_check``.

    PYTHONPATH=src python tests/bench_pooled_aa.py [--trials 4000] [--seed 29]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from test_bench_unit import _arms  # noqa: E402 - the unit tests' server model

from k3rocm.checks.bench import stats  # noqa: E402


def false_rate(rng, servers: int, aa_servers: int, cv_run: float, cv_aa: float, trials: int,
               check: bool) -> tuple[float, float]:
    """(false verdicts on identical arms, fraction of A/As refused)."""
    called = refused = 0
    for _ in range(trials):
        aa = stats.variance_component(sum(_arms(rng, aa_servers, cv=cv_aa), []))
        res = stats.compare_servers(*_arms(rng, servers, cv=cv_run), floor=aa,
                                    check_floor=check)
        called += stats.verdict(res, True) in ("B faster", "B slower")
        refused += not res["floor_used"]
    return called / trials, refused / trials


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=29)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    t = args.trials
    print(f"{t} simulated identical-arm A/Bs per cell; run server-to-server CV 1%; "
          f"check: one-sided F test at {stats.FLOOR_CHECK_ALPHA:g} (binomial SE ~0.4 points)")
    print("| servers/arm | A/A servers/arm | A/A CV | false rate, no check | false rate, "
          "checked | A/A refused |")
    print("|---:|---:|---:|---:|---:|---:|")
    for servers, aa_servers in ((4, 4), (4, 8), (2, 4)):
        for cv_aa in (0.01, 0.0075, 0.005):
            old, _ = false_rate(rng, servers, aa_servers, 0.01, cv_aa, t, False)
            new, refused = false_rate(rng, servers, aa_servers, 0.01, cv_aa, t, True)
            print(f"| {servers} | {aa_servers} | {cv_aa * 100:g}% | {old:.1%} | {new:.1%} | "
                  f"{refused:.0%} |", flush=True)


if __name__ == "__main__":
    main()
