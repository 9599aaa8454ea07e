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
from k3rocm.options import Options, ServerFlags, like, option


class AnalysisFlags(Options):
    """The analysis flags ``census`` and ``ab --measure census`` share."""

    model_dir: str | None = option(
        None, "checkpoint directory (or its config.json) as seen from this host: the MLA layer "
        "count comes from it (default: K3_MODEL mapped through K3_MODELS_DIR when it lies under "
        "/models)")
    other_norms: str | None = option(
        None, "separate RMSNorm launches per step that are not MLA q/kv norms, e.g. "
        "'2*layers + 1' (overrides the model family's rule)", metavar="FORMULA")
    extra: list[str] = option(
        default_factory=list, metavar="ROLE=N", help=f"add N expected launches per step to "
        f"ROLE ({', '.join(ROLES)}), e.g. for draft-model layers")
    min_decode_steps: int = option(1, "fail unless at least this many decode-only steps were "
                                   "traced", ge=0)
    world_size: int | None = option(
        None, "ranks that must each have a worker trace, when the traces do not record it "
        "(distributedInfo.world_size); live runs fall back to the server's tensor-parallel "
        "size", ge=1)
    skip_records: bool = option(False, "do not cross-check the overlay's decision records (for "
                                "a server whose overlay predates them); the report says so")
    top: int = option(25, "kernels in the markdown's top table (across ranks)", ge=1)
    results: Path | None = like(ServerFlags, "results", "results root (default: K3_RESULTS_DIR "
                                "or ./results)")


def add_analysis_arguments(p: argparse.ArgumentParser) -> None:
    AnalysisFlags.add_arguments(p.add_argument_group("analysis"))


def _deployment(dep):
    if dep is not None:
        return dep
    from k3rocm.deploy.deployment import load_deployment

    return load_deployment()


def model_dir_from(args: argparse.Namespace, dep=None) -> str:
    """--model-dir, else the deployment's checkpoint on this host."""
    if args.model_dir:
        return args.model_dir
    dep = _deployment(dep)
    if dep.model_host_dir is not None and dep.model_host_dir.exists():
        return str(dep.model_host_dir)
    raise UsageError("no model config: pass --model-dir <checkpoint dir with config.json> "
                     f"(K3_MODEL={dep.model} is not a path on this host)")


def results_root(args: argparse.Namespace, dep=None) -> str:
    return args.results or str(_deployment(dep).results_root)


def analysis_from(args: argparse.Namespace, dep=None) -> Analysis:
    """The analysis flags, checked before any expensive work (exit 2)."""
    f = AnalysisFlags.from_args(args)  # out of range: exit 2
    model_dir = model_dir_from(args, dep)
    other_norms(f.other_norms, read_model_facts(model_dir))  # a bad formula: exit 2 now
    extra: dict[str, int] = {}
    for item in f.extra:
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
    return Analysis(model_dir, extra, f.other_norms, f.min_decode_steps, f.world_size,
                    f.skip_records, server_log, f.top)


def profiling_from(args: argparse.Namespace) -> Profiling:
    return Profiling.from_args(args, server_trace_dir=getattr(args, "server_trace_dir", None))
