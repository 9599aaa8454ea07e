"""``k3rocm bench``: run a named aiperf workload in the client container against a running server.

Examples:
  k3rocm bench --list
  k3rocm bench --workload decode-8k1k --tokenizer models/Kimi-K3 --dry-run
  k3rocm bench --workload decode-8k1k --tokenizer models/Kimi-K3
  BENCH_CONCURRENCY=1,2 k3rocm bench --workload ci-tiny --url http://127.0.0.1:18000 \\
      --set osl=64 --set extra_inputs=ignore_eos:true,min_tokens:64,max_tokens:64
The server URL, served model name, API key, tokenizer (the checkpoint directory) and results
root come from the deployment settings (K3_PORT, K3_SERVED_MODEL_NAME, K3_API_KEY, K3_MODEL
under K3_MODELS_DIR, K3_RESULTS_DIR; shell > .env > profile); flags override them.
Exit codes: 0 all points ok; 1 a point or aiperf failed (recorded as failed in summary.json);
2 bad input; 3 server unreachable/unhealthy or no Docker engine; 130 interrupted (finished
points kept).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from k3rocm.checks.bench import run as bench_run
from k3rocm.checks.bench.workloads import (
    ENV_PREFIX,
    FIELD_NAMES,
    WORKLOADS_FILE,
    load_table,
    parse_sets,
    resolve,
    shell_line,
)
from k3rocm.deploy.engine import CLIENT_IMAGE
from k3rocm.errors import UsageError
from k3rocm.options import Options, ServerFlags, like, option
from k3rocm.rundir import utc_stamp
from k3rocm.serving.config import REDACTED


class BenchFlags(Options):
    """The flags ``ab --measure bench`` shares."""

    workload: str | None = option(
        default_factory=lambda: os.environ.get("BENCH_WORKLOAD") or None, aliases=("-w",),
        help="workload name from workloads.toml (env BENCH_WORKLOAD; default decode-8k1k)")
    workloads_file: Path | None = option(None, f"workloads file (default {WORKLOADS_FILE})")
    sets: list[str] = option(
        default_factory=list, flag="--set", metavar="KEY=VALUE",
        help="override a workload field (repeatable; lists comma separated). Fields: "
        f"{', '.join(FIELD_NAMES)}. Env {ENV_PREFIX}<FIELD> also works.")
    url: str | None = like(ServerFlags, "url", "server base URL (same as --set url=...; default "
                           "from K3_BIND_ADDRESS and K3_PORT)")
    model: str | None = like(ServerFlags, "model", "served model name (same as --set model=...; "
                             "default K3_SERVED_MODEL_NAME)")
    tokenizer: str | None = option(None, "local tokenizer directory (same as --set "
                                   "tokenizer=...; default: the checkpoint, K3_MODEL under "
                                   "K3_MODELS_DIR)")
    results: Path | None = like(ServerFlags, "results")
    client_image: str = option(
        default_factory=lambda: os.environ.get("BENCH_CLIENT_IMAGE") or CLIENT_IMAGE,
        help="client image with aiperf (env BENCH_CLIENT_IMAGE)")
    dry_run: bool = like(ServerFlags, "dry_run", "print the exact aiperf command line(s) and "
                         "exit 0; contacts nothing")
    quiet: bool = option(False, "do not echo aiperf's output")


class BenchRun(Options):
    """``k3rocm bench``'s own flags."""

    list: bool = option(False, "list the workloads and exit")
    server_timeout: float = option(60.0, "seconds to wait for the server's /health before "
                                   "failing")
    server_container: str | None = like(ServerFlags, "server_container")
    tp: str | None = option(None, "tp column of perf.csv (default: the server's K3_TP)")
    label: str | None = option(None, "run directory label (default: workload)")


add_common = BenchFlags.add_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n", 1)[1]
    add_common(parser)
    BenchRun.add_arguments(parser)


def resolve_from_args(args: argparse.Namespace, dep):
    """(workload, ``dep``) from the flags and deployment ``dep`` (this command's or an A/B
    arm's); fills ``args.results`` (default: the deployment's results root)."""
    sets = parse_sets(args.sets)
    sets.update({k: getattr(args, k) for k in ("url", "model", "tokenizer")
                 if getattr(args, k, None)})
    if args.results is None:
        args.results = dep.results_root
    return resolve(args.workload or "decode-8k1k", sets, path=args.workloads_file,
                   deployment=dep), dep


def deployment_view(args: argparse.Namespace) -> dict:
    """What this command resolved (``--print-deployment``)."""
    w, _ = resolve_from_args(args, args.deployment)
    return {"url": w.url, "served_model_name": w.model,
            "api_key": None if w.api_key == "EMPTY" else REDACTED,
            "tokenizer": str(Path(w.tokenizer).expanduser().absolute()) if w.tokenizer else None,
            "results_root": str(Path(args.results).absolute())}


def run(args: argparse.Namespace) -> int:
    if args.list:
        defaults, workloads = load_table(args.workloads_file)
        for name, table in workloads.items():
            print(f"{name:14s} {({**defaults, **table}).get('description', '')}")
        return 0
    w, dep = resolve_from_args(args, args.deployment)
    if args.dry_run:  # the exact command a run would execute; nothing is created or contacted
        print(shell_line(bench_run.planned_command(
            w, args.results.resolve() / f"{utc_stamp()}-{w.name}")))
        if not Path(w.tokenizer).expanduser().is_dir():
            print(f"[bench] note: tokenizer directory {w.tokenizer!r} does not exist here",
                  file=sys.stderr)
        return 0
    bench_run.check_tokenizer(w.tokenizer)  # bad input first, before touching Docker
    container, client = None, bench_run.docker_client()
    if args.server_container:
        try:
            container = client.containers.get(args.server_container)
        except Exception as exc:  # noqa: BLE001 - docker.errors.NotFound
            raise UsageError(f"--server-container {args.server_container!r} not found "
                             f"({exc.__class__.__name__})") from None
    res = bench_run.run_bench(w, results=args.results, client_image=args.client_image,
                              server_timeout=args.server_timeout, label=args.label,
                              progress=not args.quiet, tp=args.tp, server_container=container,
                              docker=client, deployment=dep)
    ok = res.exit_code == 0
    print(("" if ok else "k3rocm: error: ") + res.message, file=sys.stdout if ok else sys.stderr)
    return res.exit_code
