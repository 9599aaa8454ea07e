"""``k3rocm bench-ab``: ``k3rocm ab --measure bench`` (the same flags; see ``k3rocm ab --help``).

Fusions off (A) vs on (B), or A/A (--aa), or the stand-in calibration (--calibrate-delay-ms),
each slot of the order A B B A ... on a freshly started compose server.
"""

from __future__ import annotations

import argparse
import os
import sys

from k3rocm.bench import ab
from k3rocm.errors import UsageError
from k3rocm.lifecycle import ab_cli as common
from k3rocm.lifecycle import arms as armlib


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_arguments(parser, measure="bench")


deployment_view = common.deployment_view  # the one A/B driver's view (--print-deployment)


def build_plan(args: argparse.Namespace) -> ab.ABPlan:
    if args.runs_per_server < 1:
        raise UsageError(f"--runs-per-server {args.runs_per_server}: must be >= 1", 2)
    if args.n_boot < 100:
        raise UsageError(f"--n-boot {args.n_boot}: use at least 100", 2)
    if args.url:
        raise UsageError("--url is not used by bench-ab (it starts its own servers): use --port",
                         2)
    arms = armlib.arms_from_args(args)
    sets = list(args.sets)
    if not any(s.startswith("model=") for s in sets) and not args.model \
            and not os.environ.get("BENCH_MODEL"):
        model, _key = armlib.served_model(arms)
        sets.append(f"model={model}")
    args.sets = [*sets, f"url={arms.url}"]
    from k3rocm.bench.cli import resolve_from_args

    w = resolve_from_args(args)
    return ab.ABPlan(workload=w, arms=arms, results=args.results,
                     client_image=args.client_image, runs_per_server=args.runs_per_server,
                     noise_floor_dir=args.noise_floor, n_boot=args.n_boot,
                     progress=not args.quiet)


def run_bench_ab(args: argparse.Namespace) -> int:
    plan = build_plan(args)
    if args.dry_run:
        for line in ab.dry_run_lines(plan):
            print(line)
        return 0
    if plan.noise_floor_dir and plan.mode != "aa":
        ab.find_noise_floor(plan, "")  # validate early
    code = ab.run_ab(plan)
    sys.stdout.flush()
    return code


def run(args: argparse.Namespace) -> int:
    return common.run(args)

