"""``k3rocm bench-ab``: fusions off (A) vs on (B) on freshly started servers, or A/A (--aa).

Each slot of the interleaved order A B B A ... starts its own server container from --image
with the arm's K3_FUSE_QK_NORM / K3_FUSE_DECODE_QPREP, runs the whole workload, and stops it.
The server gets the host's K3_* settings (like compose) plus --server-env; the model directory
is mounted at /models and the cache directory at /cache, the port published on 127.0.0.1.

Examples (MI355X node, image built with `make build`):
  k3rocm bench-ab --aa --workload decode-8k1k --tokenizer models/Kimi-K3 --repeats 4
  k3rocm bench-ab      --workload decode-8k1k --tokenizer models/Kimi-K3 --repeats 4
CPU stand-in (CI):
  k3rocm bench-ab --workload ci-tiny --image k3rocm/server:cpu-0.32.0 --no-gpu \\
      --server-env K3_PROFILE=cpu-smoke --models-dir /tmp/k3rocm-cache/models \\
      --tokenizer /tmp/k3rocm-cache/models/k3-smoke --pin-engine-core --repeats 2
Exit codes: 0 all runs ok; 1 a run failed (kept and reported); 2 bad input; 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from k3rocm.bench import ab, server
from k3rocm.bench.cli import add_common, resolve_from_args
from k3rocm.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n", 1)[1]
    add_common(parser)
    parser.add_argument("--aa", action="store_true",
                        help="A/A mode: both arms identical (measures the noise floor)")
    parser.add_argument("--aa-fusions", choices=("on", "off"), default="on",
                        help="fusion state of both arms in A/A mode (default on)")
    parser.add_argument("--repeats", type=int,
                        default=int(os.environ.get("BENCH_AB_REPEATS") or 2),
                        help="runs per arm, interleaved A B B A ... (env BENCH_AB_REPEATS; "
                        "default 2)")
    parser.add_argument("--runs-per-server", type=int, default=1,
                        help="complete workload runs on each fresh server (default 1; more "
                        "saves server starts, identical for both arms)")
    parser.add_argument("--image", default=os.environ.get("K3_IMAGE") or "k3rocm/server:latest",
                        help="server image (env K3_IMAGE; default k3rocm/server:latest)")
    parser.add_argument("--port", type=int, default=int(os.environ.get("K3_PORT") or 8000),
                        help="host port for the arm servers (env K3_PORT; default 8000)")
    parser.add_argument("--models-dir", default=os.environ.get("K3_MODELS_DIR") or "models",
                        help="host directory mounted at /models (env K3_MODELS_DIR)")
    parser.add_argument("--cache-dir", default=os.environ.get("K3_CACHE_DIR") or "cache",
                        help="host directory mounted at /cache (env K3_CACHE_DIR)")
    gpu = parser.add_mutually_exclusive_group()
    gpu.add_argument("--gpu", dest="gpu", action="store_true", default=None,
                     help="pass the AMD devices (default when /dev/kfd exists)")
    gpu.add_argument("--no-gpu", dest="gpu", action="store_false", help="CPU stand-in")
    parser.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra server environment (repeatable), e.g. K3_PROFILE=cpu-smoke")
    parser.add_argument("--server-timeout", type=float, default=3600.0,
                        help="seconds each fresh server may take to become healthy "
                        "(default 3600: loading Kimi-K3 takes many minutes)")
    parser.add_argument("--pin-engine-core", action="store_true",
                        help="CPU stand-in on few cores: pin vLLM's EngineCore to the worker's "
                        "cores so the API server can stream (see docs/bench.md)")
    parser.add_argument("--noise-floor", type=Path, default=None,
                        help="A/A run directory to report beside this A/B (default: the newest "
                        "A/A under --results with the same protocol)")
    parser.add_argument("--n-boot", type=int, default=2000, help="bootstrap resamples")


def _parse_env(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise UsageError(f"--server-env {item!r}: expected KEY=VALUE", 2)
        if k in ab.FUSIONS_ON:
            raise UsageError(f"--server-env {k}: the fusion toggles are set per arm by bench-ab", 2)
        out[k] = v
    return out


def build_plan(args: argparse.Namespace) -> ab.ABPlan:
    if args.repeats < 1:
        raise UsageError(f"--repeats {args.repeats}: must be >= 1", 2)
    if args.runs_per_server < 1:
        raise UsageError(f"--runs-per-server {args.runs_per_server}: must be >= 1", 2)
    if not 1 <= args.port <= 65535:
        raise UsageError(f"--port {args.port}: must be 1..65535", 2)
    if args.n_boot < 100:
        raise UsageError(f"--n-boot {args.n_boot}: use at least 100", 2)
    if args.url:
        raise UsageError("--url is not used by bench-ab (it starts its own servers): use --port",
                         2)
    env = {**server.server_env_from_host(), **_parse_env(args.server_env)}
    for k in ab.FUSIONS_ON:
        env.pop(k, None)
    env["K3_PORT"] = str(args.port)
    args.sets = [*args.sets, f"url=http://127.0.0.1:{args.port}"]
    w = resolve_from_args(args)
    gpu = os.path.exists("/dev/kfd") if args.gpu is None else args.gpu
    models = Path(args.models_dir)
    if not args.dry_run and not models.is_dir():
        raise UsageError(f"--models-dir {args.models_dir!r} does not exist (it is mounted at "
                         f"/models in the server)", 2)
    spec = server.ServerSpec(image=args.image, port=args.port, env=env,
                             models_dir=str(models), cache_dir=args.cache_dir, gpu=gpu)
    if args.aa:
        same = ab.FUSIONS_ON if args.aa_fusions == "on" else ab.FUSIONS_OFF
        arm_env = {"A": dict(same), "B": dict(same)}
    else:
        arm_env = {"A": dict(ab.FUSIONS_OFF), "B": dict(ab.FUSIONS_ON)}
    return ab.ABPlan(workload=w, mode="aa" if args.aa else "ab", repeats=args.repeats,
                     spec=spec, arm_env=arm_env, results=args.results,
                     client_image=args.client_image, server_timeout=args.server_timeout,
                     pin_engine_core=args.pin_engine_core,
                     runs_per_server=args.runs_per_server, noise_floor_dir=args.noise_floor,
                     n_boot=args.n_boot, progress=not args.quiet)


def run(args: argparse.Namespace) -> int:
    plan = build_plan(args)
    if args.dry_run:
        for line in ab.dry_run_lines(plan):
            print(line)
        return 0
    if plan.noise_floor_dir and plan.mode == "ab":
        ab.find_noise_floor(plan, "")  # validate early
    code = ab.run_ab(plan)
    sys.stdout.flush()
    return code
