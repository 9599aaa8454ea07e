"""``k3rocm ab --measure bench|census``: fusions off (A) vs on (B) on freshly started servers.

One driver, one flag set, one arm order for both measures (``k3rocm bench-ab`` is
``ab --measure bench``, ``k3rocm census-ab`` is ``ab --measure census``; ``make bench-ab`` and
``make census-ab`` call them). Every slot of the order A B B A ... starts a fresh server (its
own compose project from compose.yaml, + compose.cpu.yaml with --no-gpu) with the arm's
K3_FUSE_* switches on top of the deployment's settings (shell > .env >
profile; --server-env adds more), waits until it is ready, measures, saves the server's log
into the run directory and removes it.

Before the first server starts it prints the number of cold starts and an estimated
duration. If a server already answers on --port it stops there and asks for `make down` (or
pass --stop-running, which stops the compose server and keeps its log).

--measure bench: the aiperf workload per slot (--workload, --set, --tokenizer, --repeats,
  --runs-per-server, --primary; default 4 servers per arm); the server is the unit: per metric
  the effect (B - A) / A with a t test on per-server values, pooled with the newest A/A (--aa)
  of the same recorded protocol; the minimum detectable effect before and after the run.
--measure gsm8k: the GSM8K gate per arm on the same items (default --repeats 1: order A B);
  per item right/wrong in each arm, McNemar's exact test on the discordant items, and the gate
  as non-inferiority (B at most --margin below A) with its power at n = 1319.
--measure census: one profile per arm (--repeats 1: order A B), the decode kernel census of
  each arm and the A/B launch checks (--concurrency, --max-tokens, --steps).
Every measure: arm A has every K3_FUSE_* switch 0, arm B the fusions --on names 1 (default
  all). Before anything starts (the port check, the first cold start), both arms are
  rendered against the base facts recorded in the serving image (as `make config` and the
  server's own start do): an arm that base cannot serve is refused in one line (exit 2) naming
  the arm, the setting, the base's reason and the --on choices it can serve.
Calibration (CPU stand-in): --calibrate-delay-ms MS runs an A/A whose arm B sleeps MS per
  engine step (a test double mounted only into the stand-in, which measures every sleep it
  really took); the detector is judged against the applied delay (95% CI: a correct detector
  fails 5% of the time); the report shows injected (nominal) vs applied vs detected.

Examples (MI355X node, image built with `make build`):
  k3rocm ab --measure bench --aa --workload decode-8k1k --tokenizer models/Kimi-K3 --repeats 4
  k3rocm ab --measure bench      --workload decode-8k1k --tokenizer models/Kimi-K3 --repeats 4
  k3rocm ab --measure census --model-dir models/Kimi-K3
CPU stand-in (CI):
  k3rocm ab --measure bench --workload ci-tiny --image k3rocm/server:cpu-0.32.0 --no-gpu \\
      --server-env K3_PROFILE=cpu-smoke --models-dir /tmp/k3rocm-cache/models \\
      --tokenizer /tmp/k3rocm-cache/models/k3-smoke --pin-engine-core --repeats 2
Exit codes: 0 ok; 1 a run or check failed (kept and reported); 2 bad input (also an arm
the serving image's base cannot serve); 3 server or engine problem; 4 nothing judged (a census
trace lost events, a calibration without the record of its applied delay); 130 interrupted
(finished runs kept and compared).
"""

from __future__ import annotations

import argparse
import importlib
from functools import partial
from pathlib import Path
from types import SimpleNamespace

from k3rocm.checks.ab import arms as armlib
from k3rocm.deploy.lifecycle import resolve_settings
from k3rocm.errors import UsageError
from k3rocm.serving.config import REDACTED

MEASURES = ("bench", "census", "gsm8k")
BENCH_REPEATS = 4
# The flags only one measure reads (given with another measure: exit 2).
ONLY = {"bench": ("runs_per_server", "noise_floor", "primary"),
        "census": ("trace_dirs", "concurrency", "max_tokens", "prompt_words", "steps",
                   "trace_timeout"),
        "gsm8k": ("margin", "limit", "max_gen_tokens", "gsm8k_mode", "data_dir", "hf_home")}


def add_arguments(parser: argparse.ArgumentParser, measure: str | None = None) -> None:
    from k3rocm.checks.bench.cli import add_common
    from k3rocm.checks.census.ab import CensusAbFlags
    from k3rocm.checks.census.common import add_analysis_arguments
    from k3rocm.checks.census.pipeline import Profiling

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n", 1)[1]
    parser.add_argument("--measure", choices=MEASURES, default=measure,
                        required=measure is None,
                        help="what each arm measures: the aiperf workload (bench) or the "
                        "decode kernel census (census)" + (f"; default {measure}" if measure
                                                           else ""))
    armlib.add_server_arguments(parser)
    b = parser.add_argument_group("--measure bench")
    add_common(b, skip=("results",))
    b.add_argument("--runs-per-server", type=int, default=1,
                   help="complete workload runs on each fresh server (default 1; more saves "
                   "server starts, identical for both arms)")
    b.add_argument("--noise-floor", type=Path, default=None,
                   help="A/A run directory to report beside this A/B (default: the newest A/A "
                   "under --results with the same protocol)")
    b.add_argument("--primary", default=None, metavar="METRIC@C",
                   help="the one metric judged at 5%%, declared before the run: itl:p50, "
                   "itl:p90, ttft:p50, e2el:p50 or output_tps:avg at a concurrency of the "
                   "workload (default itl:p50 at its first concurrency); every other row is "
                   "judged with Holm's correction")
    b.add_argument("--label", default=None, help="run directory label")
    from k3rocm.checks.gsm8k.ab import add_arguments as add_gsm8k

    add_gsm8k(parser.add_argument_group("--measure gsm8k"))
    c = parser.add_argument_group("--measure census")
    CensusAbFlags.add_arguments(c)
    Profiling.add_arguments(c)
    add_analysis_arguments(parser)  # its --results is every measure's
    parser.set_defaults(_only_defaults={k: parser.get_default(k) for m in MEASURES
                                        for k in ONLY[m]})


def fill_repeats(args: argparse.Namespace) -> None:
    """--repeats when not given: 4 servers per arm for bench (the fewest with which a 5% test
    on server values has room: see docs/bench.md), one profile per arm for census."""
    if args.repeats is None:
        args.repeats = BENCH_REPEATS if args.measure == "bench" else 1  # census, gsm8k: A B


def results_root(args: argparse.Namespace) -> Path:
    """--results, else the deployment's results root (K3_RESULTS_DIR: shell > .env > default)."""
    if args.results:
        return Path(args.results)
    return resolve_settings(getattr(args, "env_file", ".env")).results_root


def deployment_view(args: argparse.Namespace) -> dict:
    """What the arm servers and the measurement resolve to (``--print-deployment``)."""
    dep = resolve_settings(getattr(args, "env_file", ".env"), gpu=args.gpu)
    fill_repeats(args)
    arms = armlib.arms_from_args(args)
    arm_dep = armlib.arm_deployment(arms)
    # The image: --image, else compose's interpolation of K3_IMAGE (shell, then .env).
    return {**dep.to_json(), "url": arms.url, "served_model_name": arm_dep.served_model_name,
            "api_key": REDACTED if arm_dep.api_key else None, "image": arm_dep.image,
            "results_root": str(results_root(args).absolute()),
            "measure": args.measure, "arm_env": arms.arm_env}


def run(args: argparse.Namespace) -> int:
    args.results = results_root(args)

    fill_repeats(args)
    for k in (k for m in MEASURES if m != args.measure for k in ONLY[m]):
        if getattr(args, k) != args._only_defaults[k]:
            raise UsageError(f"--{k.replace('_', '-')} is not used by --measure {args.measure}")
    # the measure: k3rocm.checks.<measure>.ab.run_<measure>_ab
    measure = importlib.import_module(f"k3rocm.checks.{args.measure}.ab")
    return getattr(measure, f"run_{args.measure}_ab")(args)


# `k3rocm bench-ab` and `k3rocm census-ab`: this command with --measure preset.
bench = SimpleNamespace(add_arguments=partial(add_arguments, measure="bench"), run=run,
                        deployment_view=deployment_view)
census = SimpleNamespace(add_arguments=partial(add_arguments, measure="census"), run=run,
                         deployment_view=deployment_view)
