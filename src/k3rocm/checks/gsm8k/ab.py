"""The gsm8k measure of the A/B driver (``make gsm8k-ab``): the same GSM8K items, fusions off (A)
vs on (B), each arm the whole `k3rocm gsm8k` gate on a fresh server. Per item right/wrong in each
arm; McNemar's exact test on the discordant items; the gate is non-inferiority (B at most
``--margin`` below A, one-sided 95% bound) with its power here and at 1319 items.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any, Literal

from k3rocm.checks.bench import stats
from k3rocm.checks.gsm8k import cli, data, results
from k3rocm.checks.gsm8k.cli import Gsm8kRun, Gsm8kSettings
from k3rocm.checks.gsm8k.data import GSM8K_TEST_ITEMS
from k3rocm.errors import EXIT_CHECK_FAILED, EXIT_OK, UsageError
from k3rocm.options import Options, like, option
from k3rocm.rundir import create_run_dir

# The default margin: the smallest (0.05-point grid) with which equally accurate arms pass >=
# DESIGN_POWER of the time at DESIGN_AGREEMENT of 1319 items agreeing (tools/bench_gsm8k_margin.py).
DESIGN_POWER, DESIGN_AGREEMENT = 0.90, 0.98
DEFAULT_MARGIN = 0.012
DROP = 0.01  # the accuracy loss whose false-pass rate every report prints


class Gsm8kAbOptions(Options):

    margin: float = option(
        DEFAULT_MARGIN, "non-inferiority margin: B may be at most this much less accurate than "
        f"A (default %(default)s: identical arms pass >= {DESIGN_POWER * 100:.0f}%% at "
        f"{DESIGN_AGREEMENT * 100:.0f}%% agreement on 1319 items)", gt=0, lt=1)
    limit: int | None = like(Gsm8kSettings, "limit", "only the first N test items in both arms "
                             "(fewer items, less power)")
    max_gen_tokens: int = like(Gsm8kSettings, "max_gen_tokens")
    gsm8k_mode: Literal["chat", "completions"] = like(
        Gsm8kSettings, "mode", "endpoint of both arms (k3rocm gsm8k --mode)")
    data_dir: str | None = like(Gsm8kRun, "data_dir")
    hf_home: str | None = like(Gsm8kRun, "hf_home")


add_arguments = Gsm8kAbOptions.add_arguments
REPEATS = 1
SINGLE = ("gsm8k-ab", "greedy decoding repeats itself")
OWN = tuple(Gsm8kAbOptions.flags())


def compare(a_samples: list[dict], b_samples: list[dict], margin: float) -> dict[str, Any]:
    """Paired per-item comparison of two lm-eval sample sets (the same items)."""
    out: dict[str, Any] = {"margin": margin, "filters": {}}
    for filt in results.FILTERS:
        a, b = results.item_correct(a_samples, filt), results.item_correct(b_samples, filt)
        if set(a) != set(b):
            raise UsageError(f"gsm8k-ab: the arms scored different items ({len(a)} vs {len(b)} "
                             f"under {filt}): no pairing", 1)
        docs = sorted(a, key=str)
        res = stats.paired_accuracy([a[d] for d in docs], [b[d] for d in docs], margin)
        disc = (res["b_only"] + res["a_only"]) / res["n"]
        # no discordant item: nothing to estimate the paired variance from (n/a, not 100%)
        res["power_here"] = (stats.noninferiority_pass_rate(res["n"], margin, disc)
                             if disc else None)
        res["power_full"] = (stats.noninferiority_pass_rate(GSM8K_TEST_ITEMS, margin, disc)
                             if disc else None)
        # a B truly DROP less accurate (at least DROP of the items discordant): how often it
        # still reads non-inferior with these items
        res["false_pass_drop"] = DROP
        res["false_pass"] = stats.noninferiority_pass_rate(res["n"], margin, max(disc, DROP), DROP)
        out["filters"][filt] = res
    prim = out["filters"]["strict-match"]
    verdict = out["verdict"] = "NON-INFERIOR" if prim["non_inferior"] else "NOT SHOWN NON-INFERIOR"
    out["headline"] = (
        f"strict-match A {prim['acc_a']:.4f} B {prim['acc_b']:.4f} (n={prim['n']}): "
        f"B - A {prim['diff'] * 100:+.2f} points, one-sided 95% lower bound "
        f"{prim['lower_bound'] * 100:+.2f} vs margin -{margin * 100:.2f}: {verdict}; McNemar "
        f"exact p={prim['mcnemar_p']:.3g} ({prim['b_only']} right only in B, {prim['a_only']} "
        f"only in A): {prim['mcnemar']}; power of the margin {_pw(prim['power_here'])} at "
        f"n={prim['n']}, {_pw(prim['power_full'])} at n={GSM8K_TEST_ITEMS}; a B {DROP * 100:g} "
        f"point less accurate would pass {prim['false_pass']:.0%} of the time here")
    return out


def margin_note(margin: float) -> str:
    if margin == DEFAULT_MARGIN:
        return (f"The margin {margin * 100:g} points is the default, chosen so that identical "
                f"arms pass >= {DESIGN_POWER:.0%} of the time at {DESIGN_AGREEMENT:.0%} "
                f"agreement on {GSM8K_TEST_ITEMS} items (docs/gsm8k.md).")
    return (f"The margin {margin * 100:g} points was set with --margin (default "
            f"{DEFAULT_MARGIN * 100:g}: identical arms pass >= {DESIGN_POWER:.0%} at "
            f"{DESIGN_AGREEMENT:.0%} agreement on {GSM8K_TEST_ITEMS} items).")


def _pw(p: float | None) -> str:
    return "n/a (no discordant items)" if p is None else f"{p:.0%}"


def markdown(comp: dict) -> str:
    lines = ["# gsm8k-ab: fusions off (A) vs on (B), the same items", "",
             f"**{comp['verdict']}** - {comp.get('invalid') or comp['headline']}", "",
             "| filter | n | acc A | acc B | B - A | 95% lower bound | right only in B | "
             f"right only in A | McNemar exact p | power (here / 1319) | false pass at "
             f"-{DROP * 100:g} point |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for filt, r in comp["filters"].items():
        lines.append(f"| {filt} | {r['n']} | {r['acc_a']:.4f} | {r['acc_b']:.4f} | "
                     f"{r['diff'] * 100:+.2f} | {r['lower_bound'] * 100:+.2f} | {r['b_only']} | "
                     f"{r['a_only']} | {r['mcnemar_p']:.3g} | {_pw(r['power_here'])} / "
                     f"{_pw(r['power_full'])} | {r['false_pass']:.0%} |")
    lines += ["", f"Gate: B non-inferior to A within {comp['margin'] * 100:.2f} points "
              "(strict-match; one-sided 95% Wald bound on the paired difference, paired variance "
              "from the discordant items, never above the exact bound on the items only A got "
              "right). Power: chance to show it when both arms are equally accurate, at the "
              "discordance observed; false pass: chance that a B truly "
              f"{DROP * 100:g} point less accurate shows it (both exact for this bound). "
              + margin_note(comp["margin"]), ""]
    for arm, d in (comp.get("arms") or {}).items():
        lines.append(f"- arm {arm}: {d.get('message')} (run {d.get('run_dir')})")
    lines += [f"- fusion check: {p}" for p in comp.get("fusion_problems") or []]
    return "\n".join(lines) + "\n"


class Gsm8kAb:
    """gsm8k-ab's plan and run state (the A/B driver's measure protocol): each arm the whole
    `k3rocm gsm8k` gate in ``<run>/NN-<arm>/``, beside its server log."""

    def __init__(self, args: argparse.Namespace, arms, dep) -> None:
        self.opts = opts = Gsm8kAbOptions.from_args(args)
        self.arms, self.label = arms, args.label or "gsm8k-ab"
        self.s = Gsm8kSettings(url=arms.url, model=dep.served_model_name, mode=opts.gsm8k_mode,
                               max_gen_tokens=opts.max_gen_tokens, limit=opts.limit,
                               allow_limit=True, client_image=args.client_image)
        self.client_image = self.s.client_image
        self.src = None if args.dry_run else \
            data.resolve(opts.data_dir, opts.hf_home, Path(arms.cache_dir))
        self.arm_runs: dict[str, dict[str, Any]] = {}

    def slot_lines(self, _slot: int, _arm: str) -> list[str]:
        return [shlex.join(cli.lm_eval_argv(self.s))]

    def log_name(self, i: int, arm: str) -> str:
        return f"{i:02d}-{arm}/server.log"

    def measure(self, i: int, arm: str, srv, info: dict) -> None:
        run, slot_dir = self.run, self.run.dir / f"{i:02d}-{arm}"
        run_dir = create_run_dir(slot_dir, "gsm8k")
        code = cli.execute(run.client, self.s, self.src, info["deployment"], run_dir,
                           srv.container(run.client).name)
        summary = results.read_summary(run_dir)
        self.arm_runs.setdefault(arm, {"run_dir": str(run_dir), "exit_code": code,
                                       "message": summary.get("message")})
        if code not in (0, 1):  # 1 = below the absolute gate: still a complete run
            raise UsageError(f"gsm8k-ab: arm {arm} did not finish ({summary.get('message')})",
                             code)

    def compare(self, slots: list[dict]) -> dict[str, Any]:
        samples = {arm: results.load_run(Path(d["run_dir"]))[1]
                   for arm, d in self.arm_runs.items()}
        comp = compare(samples["A"], samples["B"], self.opts.margin)
        comp.update(arms=self.arm_runs, arm_env=self.arms.arm_env, slots=self.arms.slots(),
                    slot_records=slots)
        return comp

    markdown = staticmethod(markdown)

    def verdict(self, comp: dict, run_dir: Path) -> int:
        print(f"gsm8k-ab: {comp['headline']}; report {run_dir / 'comparison.md'}")
        ok = comp["filters"]["strict-match"]["non_inferior"] and not comp.get("invalid")
        return EXIT_OK if ok else EXIT_CHECK_FAILED


plan = Gsm8kAb
