"""``k3rocm ab --measure bench|census|gsm8k``: fusions off (A) vs on (B) on freshly started servers.

One driver, one flag set, one arm order (``bench-ab`` and ``census-ab`` preset --measure). Every
slot of the order A B B A ... starts a fresh server (its own compose project, + compose.cpu.yaml
with --no-gpu) with the arm's K3_FUSE_* switches over the deployment's settings (shell > .env >
profile; --server-env adds more), measures, saves its log into the run directory and removes it.
It first prints the cold starts and an estimate; a server already on --port stops it (`make
down`, or --stop-running). Both arms are first rendered against the serving image's base facts:
an arm that base cannot serve is refused in one line (exit 2) naming the --on choices it can.

--measure bench: the aiperf workload per slot (default 4 servers per arm); per metric the effect
  (B - A) / A with a t test on per-server values, pooled with the newest A/A (--aa) of the same
  recorded protocol; the minimum detectable effect before and after the run.
--measure gsm8k: the GSM8K gate per arm on the same items (order A B); McNemar's exact test and
  non-inferiority of B within --margin, with its power at n = 1319.
--measure census: one profile per arm (order A B), each arm's decode kernel census and the A/B
  launch checks.
Arm A has every K3_FUSE_* switch 0, arm B the fusions --on names 1 (default all).
Calibration (CPU stand-in): --calibrate-delay-ms MS runs an A/A whose arm B sleeps MS per engine
  step (a test double that records every sleep it took); the detector is judged against the
  applied delay (95% CI); the report shows injected vs applied vs detected.

Examples (MI355X node, image built with `make build`):
  k3rocm ab --measure bench --aa --workload decode-8k1k --tokenizer models/Kimi-K3 --repeats 4
  k3rocm ab --measure bench      --workload decode-8k1k --tokenizer models/Kimi-K3 --repeats 4
  k3rocm ab --measure census --model-dir models/Kimi-K3
CPU stand-in (CI):
  k3rocm ab --measure bench --workload ci-tiny --image k3rocm/server:cpu-0.32.0 --no-gpu \\
      --server-env K3_PROFILE=cpu-smoke --models-dir /tmp/k3rocm-cache/models \\
      --tokenizer /tmp/k3rocm-cache/models/k3-smoke --pin-engine-core --repeats 2
Exit codes: 0 ok; 1 a run or check failed (kept and reported); 2 bad input (also an arm the
serving image's base cannot serve); 3 server or engine problem; 4 nothing judged (a census trace
lost events, a calibration without the record of its applied delay); 130 interrupted (finished
runs kept and compared).
"""

from __future__ import annotations

import argparse
import importlib
from functools import partial
from pathlib import Path
from types import ModuleType, SimpleNamespace

from k3rocm.checks.ab import arms as armlib
from k3rocm.errors import UsageError
from k3rocm.rundir import write_json_atomic, write_text_atomic
from k3rocm.serving.config import REDACTED

# The measure protocol. Each module k3rocm.checks.<measure>.ab (it imports nothing from here) has
# add_arguments(group), OWN (the flags only it reads), REPEATS (default servers per arm), SINGLE
# ((command, why) when it runs one server per arm, order A B; else None) and plan(args, arms,
# dep) -> a plan with label (of the run directory), log_name(slot, arm) (in the run directory),
# measure(slot, arm, server, info) -> False to stop, compare(slot records) -> the report's
# document, markdown(doc), verdict(doc, run_dir) -> exit code (prints the headline); optional:
# lines() and slot_lines(slot, arm) (the dry run's), begin() (its run is in .run), runs_per_slot
# (1), client_image, keep_going (False: a failed slot is raised; True: what finished is
# compared), report ("comparison": <run>/<report>.json and .md), checks_fusions (True).
MEASURES = ("bench", "census", "gsm8k")


def measure_module(name: str) -> ModuleType:
    return importlib.import_module(f"k3rocm.checks.{name}.ab")


def add_arguments(parser: argparse.ArgumentParser, measure: str | None = None) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n", 1)[1]
    parser.add_argument("--measure", choices=MEASURES, default=measure, required=measure is None,
                        help="what each arm measures" + (f" (default {measure})" if measure
                                                         else ""))
    parser.add_argument("--results", type=Path, default=None,
                        help="results root (default: K3_RESULTS_DIR or ./results)")
    parser.add_argument("--label", default=None, help="run directory label")
    armlib.add_server_arguments(parser)
    for m in MEASURES:
        measure_module(m).add_arguments(parser.add_argument_group(f"--measure {m}"))
    parser.set_defaults(_own_defaults={k: parser.get_default(k) for m in MEASURES
                                       for k in measure_module(m).OWN})


def fill_repeats(args: argparse.Namespace) -> None:
    """--repeats when not given: the measure's default (bench 4, census and gsm8k 1: A B)."""
    if args.repeats is None:
        args.repeats = measure_module(args.measure).REPEATS


def results_root(args: argparse.Namespace) -> Path:
    """--results, else the deployment's results root (K3_RESULTS_DIR: shell > .env > default)."""
    if args.results:
        return Path(args.results)
    return args.deployment.results_root


def deployment_view(args: argparse.Namespace) -> dict:
    """What the arm servers and the measurement resolve to (``--print-deployment``)."""
    dep = args.deployment
    fill_repeats(args)
    arms = armlib.arms_from_args(args)
    arm_dep = armlib.arm_deployment(arms)
    return {**dep.to_json(), "url": arms.url, "served_model_name": arm_dep.served_model_name,
            "api_key": REDACTED if arm_dep.api_key else None, "image": arm_dep.image,
            "results_root": str(results_root(args).absolute()),
            "measure": args.measure, "arm_env": arms.arm_env}


def run(args: argparse.Namespace) -> int:
    args.results = results_root(args)
    fill_repeats(args)
    for k in (k for m in MEASURES if m != args.measure for k in measure_module(m).OWN):
        if getattr(args, k) != args._own_defaults[k]:
            raise UsageError(f"--{k.replace('_', '-')} is not used by --measure {args.measure}")
    mod = measure_module(args.measure)
    if getattr(args, "trace_dirs", None):  # census-ab offline: two existing trace sets
        m = mod.offline(args, armlib.arm_envs(args.on))
        return report(m, m.compare([]), m.run.dir)
    arms = armlib.arms_from_args(args, single=mod.SINGLE)
    dep = armlib.arm_deployment(arms)  # what the arm servers serve (--server-env over settings)
    m = mod.plan(args, arms, dep)
    per_slot = getattr(m, "runs_per_slot", 1)
    if args.dry_run:  # the plan, the cost, then what each slot starts and runs
        secs, how = armlib.estimate(arms, args.results, per_slot)
        slots, lines = arms.slots(), getattr(m, "slot_lines", lambda i, arm: [])
        print("\n".join([
            *getattr(m, "lines", list)(), f"# cost: {len(slots) * len(arms.replica_ports)} cold "
            f"server start(s) ({arms.repeats} server(s) per arm), {len(slots) * per_slot} "
            f"run(s); estimated {secs / 3600:.1f} h ({how})",
            *(x for i, arm in enumerate(slots)
              for x in (*armlib.slot_lines(arms, i, arm), *lines(i, arm)))]))
        return 0
    m.run = run = armlib.start(arms, Path(args.results), m.label, per_slot,
                               client_image=getattr(m, "client_image", None), dep=dep)
    getattr(m, "begin", lambda: None)()
    slots = run.each_slot(lambda i, arm: run.dir / m.log_name(i, arm), m.measure,
                          getattr(m, "keep_going", False))
    doc = m.compare(slots)
    if getattr(m, "checks_fusions", True):
        doc["fusion_problems"], refused = armlib.fusion_check(slots, arms.arm_env)
        if refused and arms.mode == "ab" and not doc.get("invalid"):
            # an arm ran without its fusion (or A with it): the pairing says nothing
            doc["invalid"] = ("an arm's fusions are not what it asked (the overlay's decision "
                              "records): " + " | ".join(refused))
    if doc.get("invalid"):
        doc.update(verdict="INVALID", headline="INVALID: " + doc["invalid"])
        for r in doc.get("rows") or []:
            r["verdict"] = "invalid"
    return report(m, doc, run.dir)


def report(m, doc: dict, run_dir: Path) -> int:
    """<run>/<report>.json and .md (atomic), then the measure's verdict: the exit code."""
    stem = run_dir / getattr(m, "report", "comparison")
    write_json_atomic(stem.with_suffix(".json"), doc)
    write_text_atomic(stem.with_suffix(".md"), m.markdown(doc))
    return m.verdict(doc, run_dir)


# `k3rocm bench-ab` and `k3rocm census-ab`: this command with --measure preset.
bench = SimpleNamespace(add_arguments=partial(add_arguments, measure="bench"), run=run,
                        deployment_view=deployment_view)
census = SimpleNamespace(add_arguments=partial(add_arguments, measure="census"), run=run,
                         deployment_view=deployment_view)
