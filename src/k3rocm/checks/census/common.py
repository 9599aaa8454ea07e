"""Argument handling shared by ``census`` and ``census-ab``: flags -> the pipeline's values."""

from __future__ import annotations

import argparse
from pathlib import Path

from k3rocm.checks.census.expect import other_norms
from k3rocm.checks.census.fusions import from_cli
from k3rocm.checks.census.modelcfg import read_model_facts
from k3rocm.checks.census.pipeline import Analysis, Profiling
from k3rocm.checks.census.spec import ROLES
from k3rocm.errors import UsageError


def add_analysis_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("analysis")
    g.add_argument("--model-dir", help="checkpoint directory (or its config.json) as seen from "
                   "this host: the MLA layer count comes from it (default: K3_MODEL mapped "
                   "through K3_MODELS_DIR when it lies under /models)")
    g.add_argument("--other-norms", metavar="FORMULA",
                   help="separate RMSNorm launches per step that are not MLA q/kv norms, "
                   "e.g. '2*layers + 1' (overrides the model family's rule)")
    g.add_argument("--extra", action="append", default=[], metavar="ROLE=N",
                   help=f"add N expected launches per step to ROLE ({', '.join(ROLES)}), e.g. "
                   "for draft-model layers")
    g.add_argument("--min-decode-steps", type=int, default=1,
                   help="fail unless at least this many decode-only steps were traced")
    g.add_argument("--world-size", type=int, default=None,
                   help="ranks that must each have a worker trace, when the traces do not "
                   "record it (distributedInfo.world_size); live runs fall back to the "
                   "server's tensor-parallel size")
    g.add_argument("--skip-records", action="store_true",
                   help="do not cross-check the overlay's decision records (for a server "
                   "whose overlay predates them); the report says so")
    g.add_argument("--top", type=int, default=25,
                   help="kernels in the markdown's top table (across ranks)")
    g.add_argument("--results", default=None,
                   help="results root (default: K3_RESULTS_DIR or ./results)")


def _deployment(dep):
    """The command's deployment, loaded here only by a command that has none (offline)."""
    if dep is not None:
        return dep
    from k3rocm.deploy.deployment import load_deployment

    return load_deployment()


def model_dir_from(args: argparse.Namespace, dep=None) -> str:
    """--model-dir, else the deployment's checkpoint on this host (K3_MODEL under
    K3_MODELS_DIR, wherever they are set; census-ab: the arm servers')."""
    if args.model_dir:
        return args.model_dir
    dep = _deployment(dep)
    if dep.model_host_dir is not None and dep.model_host_dir.exists():
        return str(dep.model_host_dir)
    raise UsageError("no model config: pass --model-dir <checkpoint dir with config.json> "
                     f"(K3_MODEL={dep.model} is not a path on this host)")


def results_root(args: argparse.Namespace, dep=None) -> str:
    """--results, else the deployment's results root (K3_RESULTS_DIR, mounted at /results)."""
    return args.results or str(_deployment(dep).results_root)


def positive(name: str, value: int, minimum: int = 1) -> None:
    if value < minimum:
        raise UsageError(f"{name} {value} must be >= {minimum}")


def analysis_from(args: argparse.Namespace, dep=None) -> Analysis:
    """The analysis flags, checked before any expensive work (bad input: exit 2); ``dep``:
    the command's deployment (where the checkpoint is without --model-dir)."""
    positive("--min-decode-steps", args.min_decode_steps, 0)
    model_dir = model_dir_from(args, dep)
    other_norms(args.other_norms, read_model_facts(model_dir))  # a bad formula: exit 2 now
    extra: dict[str, int] = {}
    for item in args.extra:
        role, sep, n = item.partition("=")
        if not sep or role not in ROLES or not n.strip().lstrip("-").isdigit():
            raise UsageError(f"--extra {item!r} is not ROLE=N with ROLE one of "
                             f"{', '.join(ROLES)} and N an integer")
        extra[role] = int(n)
    if getattr(args, "fusions", None):
        from_cli(args.fusions)
    server_log = getattr(args, "server_log", None)
    if server_log and not Path(server_log).is_file():
        raise UsageError(f"--server-log {server_log} does not exist")
    if args.world_size is not None:
        positive("--world-size", args.world_size)
    return Analysis(model_dir, extra, args.other_norms, args.min_decode_steps, args.world_size,
                    args.skip_records, server_log, args.top)


def profiling_from(args: argparse.Namespace) -> Profiling:
    """The live load flags, checked (bad input: exit 2)."""
    for name in ("--concurrency", "--steps"):
        positive(name, getattr(args, name[2:].replace("-", "_")))
    positive("--max-tokens", args.max_tokens, args.steps + 12)
    return Profiling(args.concurrency, args.max_tokens, args.prompt_words, args.steps,
                     args.trace_timeout, getattr(args, "server_trace_dir", None))
