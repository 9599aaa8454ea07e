"""``k3rocm demo`` (``make demo``): the whole bundle on the CPU stand-in, one summary at the end.

  check   Docker engine, Compose v2, the stand-in base and client images, the port
  model   make tinymodel                 the tiny random-weight MLA model (cached)
  up      make up CPU=1                  our image FROM the stand-in, profile cpu-smoke
  bench   make bench WORKLOAD=ci-tiny    aiperf in the client image
  gsm8k   make gsm8k GSM8K_DATA=...      lm-eval on 5 bundled GSM8K items ("below the gate"
                                         is expected of random weights)
  census  make census                    decode kernel census from the server's trace
  down    make down CPU=1                server log saved, server removed (also on failure)

Logs: <results>/<UTC>-demo/logs/. Exit codes: 0 ok; else the first failing step's exit code;
2 bad input or a missing prerequisite; 130 interrupted.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from k3rocm.checks import steps
from k3rocm.checks.steps import StepResult
from k3rocm.deploy.deployment import CPU_PROFILE
from k3rocm.deploy.preflight import port_free
from k3rocm.dev.standin import STANDIN_BASE
from k3rocm.dev.tinymodel import DEFAULT_NAME as SMOKE_MODEL
from k3rocm.dev.tinymodel import DEFINITION
from k3rocm.errors import ServerError, UsageError
from k3rocm.rundir import create_run_dir
from k3rocm.serving.fusions import switches

GSM8K_ITEMS = Path(__file__).resolve().parents[1] / "data" / "gsm8k-demo"
PRIVATE_SOCKET = "/run/k3d/docker.sock"  # .ci/dockerd.sh
# GSM8K's 5-shot prompt is ~3k tokens of the tiny tokenizer: more than cpu-smoke's 2048
MAX_MODEL_LEN = str(DEFINITION["config"]["max_position_embeddings"])
STEPS = ("check", "model", "up", "bench", "gsm8k", "census", "down")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n", 1)[1]
    parser.set_defaults(gpu=False)  # the deployment k3rocm.cli builds: the CPU stand-in
    parser.add_argument("--results", type=Path, default=None,
                        help="results root (default: the deployment's K3_RESULTS_DIR, shell > "
                        ".env, or ./results)")
    parser.add_argument("--models-dir", type=Path, default=None,
                        help="host models directory; the tiny model goes to <dir>/k3-smoke "
                        "(default: the deployment's K3_MODELS_DIR, shell > .env, or ./models)")
    parser.add_argument("--port", type=int, default=None,
                        help="host port of the server (default: the deployment's K3_PORT, "
                        "shell > .env, or 8000)")
    parser.add_argument("--project",
                        default=os.environ.get("COMPOSE_PROJECT_NAME") or "k3rocm-demo",
                        help="compose project name (default: $COMPOSE_PROJECT_NAME or "
                        "k3rocm-demo)")
    parser.add_argument("--gsm8k-data", type=Path, default=GSM8K_ITEMS,
                        help="directory with train.jsonl and test.jsonl (default: the 5 "
                        "bundled GSM8K test items)")
    parser.add_argument("--workload", default="ci-tiny",
                        help="bench workload (default ci-tiny: ISL 64 / OSL 32, concurrency 1,2)")
    parser.add_argument("--bench-args", default="", help="more `k3rocm bench` arguments")
    parser.add_argument("--gsm8k-args", default="--max-gen-tokens 32 --concurrency 4",
                        help="more `k3rocm gsm8k` arguments (default: %(default)s)")
    parser.add_argument("--census-args", default="--concurrency 4 --max-tokens 256 --steps 6",
                        help="more `k3rocm census` arguments (default: %(default)s)")
    parser.add_argument("--verbose", action="store_true",
                        help="also stream every step's output to the terminal")


def preflight(args: argparse.Namespace, env: dict[str, str], client_image: str) -> str:
    for tool, fix in (("make", "run `bash .ci/demo` (installs it) or `apt-get install make`"),
                      ("docker", "run `bash .ci/demo` (it installs and starts a private Docker "
                       "engine) or install Docker")):
        if shutil.which(tool) is None:
            raise UsageError(f"no `{tool}` command: {fix}")
    try:
        p = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], env=env,
                           capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        p = None
    if p is None or p.returncode != 0:
        where = env.get("DOCKER_HOST") or "the default socket"
        raise ServerError(f"no Docker engine answers at {where}: run `bash .ci/demo` (starts "
                          "a private one) or start Docker")
    engine = p.stdout.strip()
    p = subprocess.run(["docker", "compose", "version", "--short"], env=env,
                       capture_output=True, text=True, timeout=30)
    if p.returncode != 0 or not p.stdout.strip().lstrip("v").startswith("2"):
        raise UsageError("Docker Compose v2 is missing: run `.ci/install-compose.sh` (or "
                         "`bash .ci/demo`)")
    base = env.get("BASE_IMAGE") or STANDIN_BASE
    missing = [ref for ref in (base, client_image) if subprocess.run(
        ["docker", "image", "inspect", ref], env=env, capture_output=True, timeout=30
    ).returncode != 0]
    if missing:
        raise UsageError(f"image(s) {', '.join(missing)} missing: run `bash .ci/demo` (builds "
                         "them offline) or `make standin STANDIN_VERSIONS=0.32.0 "
                         "STANDIN_TAG_ROCM= clients-image CLIENT_BASE=k3rocm/debian:bookworm`")
    if not port_free("127.0.0.1", args.port):
        raise UsageError(f"port {args.port} on 127.0.0.1 is in use (a server already running? "
                         "`make down`), or choose another: --port N / K3_PORT=N")
    return (f"Docker {engine}, Compose {p.stdout.strip()}, {base} and {client_image} present, "
            f"port {args.port} free")


def _env(args: argparse.Namespace, trace_dir: str) -> dict[str, str]:
    env = dict(os.environ)
    if "DOCKER_HOST" not in env and Path(PRIVATE_SOCKET).exists():
        env["DOCKER_HOST"] = f"unix://{PRIVATE_SOCKET}"
    env.update({"COMPOSE_PROJECT_NAME": args.project, "K3_PROFILE": CPU_PROFILE,
                "K3_MODEL": f"/models/{SMOKE_MODEL}", "K3_SERVED_MODEL_NAME": SMOKE_MODEL,
                "K3_PORT": str(args.port), "K3_MAX_MODEL_LEN": MAX_MODEL_LEN,
                "K3_MODELS_DIR": str(args.models_dir), "K3_RESULTS_DIR": str(args.results),
                "K3_PROFILER_DIR": trace_dir, **switches(False)})
    return env


def _validate(args: argparse.Namespace) -> None:
    dep = args.deployment.with_env(K3_PROFILE=CPU_PROFILE)  # the CPU stand-in's (gpu False)
    args.port = dep.port if args.port is None else args.port
    args.results = (args.results or dep.results_root).resolve()
    args.models_dir = (args.models_dir or dep.models_dir).resolve()
    args.image = dep.image
    if not 1 <= args.port <= 65535:
        raise UsageError(f"--port {args.port} is not a port: use 1..65535")
    if not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", args.project):
        raise UsageError(f"--project {args.project!r} is not a compose project name: lowercase "
                         "letters, digits, '-' and '_'")
    for opt in ("bench_args", "gsm8k_args", "census_args"):
        try:
            shlex.split(getattr(args, opt))
        except ValueError as exc:
            raise UsageError(f"--{opt.replace('_', '-')}: {exc}") from None
    for name in ("train.jsonl", "test.jsonl"):
        if not (args.gsm8k_data / name).is_file():
            raise UsageError(f"--gsm8k-data {args.gsm8k_data} has no {name}: give a directory "
                             "with train.jsonl and test.jsonl")
    args.gsm8k_data = args.gsm8k_data.resolve()


def run(args: argparse.Namespace) -> int:
    _validate(args)
    from k3rocm.deploy.engine import CLIENT_IMAGE

    pipe = steps.Pipeline("demo", STEPS, args.verbose)
    pipe.say(f"1/{len(STEPS)} check: Docker, Compose, images, port {args.port}")
    checked = preflight(args, _env(args, "/results/traces"), CLIENT_IMAGE)
    run_dir = create_run_dir(args.results, "demo")
    env = _env(args, f"/results/{run_dir.name}/traces")
    pipe.say(f"run directory {run_dir}")
    py = sys.executable
    make = ["make", "--no-print-directory", "-o", py, f"PY={py}", "CPU=1"]
    q = shlex.quote
    model_dir = args.models_dir / SMOKE_MODEL
    commands: dict[str, list[str]] = {
        "model": [*make, "tinymodel"],
        "up": [*make, "up"],
        "bench": [*make, "bench", f"WORKLOAD={args.workload}",
                  "BENCH_ARGS=" + " ".join(["--url", f"http://127.0.0.1:{args.port}",
                                            "--tokenizer", q(str(model_dir)), "--results",
                                            q(str(args.results)), args.bench_args]).strip()],
        "gsm8k": [*make, "gsm8k", f"GSM8K_DATA={args.gsm8k_data}",
                  "GSM8K_ARGS=" + " ".join(["--results-dir", q(str(args.results)),
                                            args.gsm8k_args]).strip()],
        "census": [*make, "census",
                   "CENSUS_ARGS=" + " ".join(["--model-dir", q(str(model_dir)), "--results",
                                              q(str(args.results)), args.census_args]).strip()],
        "down": [*make, "down"],
    }
    pipe.results.append(StepResult("check", "(docker, compose, images, port)", ok=True,
                                   seconds=time.time() - pipe.t0, note=checked))
    started: list[str] = []

    def step(name: str) -> StepResult:
        started.append(name)
        fn = functools.partial(_make_step, pipe, commands[name], env, args)
        return pipe.step(name, fn, log=run_dir / "logs" / f"{STEPS.index(name) + 1}-{name}.log",
                         what=shlex.join(commands[name]))

    def body():
        for name in STEPS[1:-1]:
            if not step(name).ok:
                break

    code = pipe.run(body, lambda: "up" in started and step("down"))
    settings = {k: env[k] for k in ("K3_PROFILE", "K3_MODEL", "K3_MAX_MODEL_LEN",
                                    *switches(False), "K3_PROFILER_DIR")}
    pipe.finish(code, run_dir, f"the bundle on the CPU stand-in ({STANDIN_BASE}, tiny "
                f"random-weight MLA model {SMOKE_MODEL})",
                {"port": args.port, "project": args.project,
                 "results_root": str(args.results), "settings": settings},
                after=[f"  demo run directory: {_rel(str(run_dir))} (summary.json, summary.md, "
                       "logs/, traces/)"], show=_rel)
    return code


def _make_step(pipe: steps.Pipeline, argv: list[str], env: dict[str, str],
               args: argparse.Namespace, res: StepResult) -> None:
    """One make target; its row from the run directory it wrote (a new one in the results
    root, by its name's suffix) and its output."""
    root, name = args.results, res.name
    before = {p.name for p in root.iterdir()} if root.is_dir() else set()
    res.command = shlex.join(argv)
    res.code, text = pipe.command(argv, env)
    res.ok = res.code == 0
    if name == "model":
        res.run_dir = str(args.models_dir / SMOKE_MODEL)
        res.note = "tiny random-weight MLA model (generated once, then cached)" if res.ok \
            else "failed"
    elif name == "up":
        res.note = (f"{args.image} FROM "
                    f"{env.get('BASE_IMAGE') or STANDIN_BASE}, profile {CPU_PROFILE}, serving "
                    f"{SMOKE_MODEL} on 127.0.0.1:{args.port}")
        m = re.findall(r"ready after (\d+)s", text)
        if m:
            res.numbers["ready_s"] = int(m[-1])
            res.note += f", ready {m[-1]}s after start"
    elif name in ("bench", "gsm8k", "census"):
        suffix, numbers = {"bench": (f"-{args.workload}", steps.bench_numbers),
                           "gsm8k": ("-gsm8k", steps.gsm8k_numbers),
                           "census": ("-census", steps.census_numbers)}[name]
        new = steps.new_dirs(root, before, suffix)
        if new:
            res.run_dir = str(new[-1])
            res.note, res.numbers = numbers(steps.read_json(
                new[-1] / ("census.json" if name == "census" else "summary.json")))
        if new and name == "gsm8k" and res.code == 1 and \
                res.numbers.get("status") == "below_gate":
            res.ok = True  # random weights: below the gate is the expected verdict
            res.note += " (expected: random weights; 5 items are not comparable)"
    elif name == "down":
        new = steps.new_dirs(root, before, "-server-log")
        if new and (new[-1] / "server.log").is_file():
            res.run_dir = str(new[-1] / "server.log")
            res.note = "server log saved, server stopped and removed"
        elif res.ok:
            res.note = "server stopped (no server log found)"
    if not res.ok and not res.note.endswith(")"):
        res.note = (res.note + "; " if res.note else "") + f"exit {res.code}, see the log"


def _rel(path: str | None) -> str:
    if not path:
        return "-"
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel
