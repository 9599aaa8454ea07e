"""Argument handling shared by ``census`` and ``census-ab``."""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

from k3rocm.checks.census.names import Normalizer
from k3rocm.checks.census.spec import ROLES
from k3rocm.errors import UsageError
from k3rocm.hashing import sha256_file as sha256


def add_analysis_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("analysis")
    g.add_argument("--model-dir", help="checkpoint directory (or its config.json) as seen from "
                   "this host: the MLA layer count comes from it (default: K3_MODEL mapped "
                   "through K3_MODELS_DIR when it lies under /models)")
    g.add_argument("--platform", choices=("auto", "rocm", "cpu"), default="auto",
                   help="name rules: rocm (GPU kernels) or cpu (CPU operators of the stand-in);"
                   " auto = rocm when the trace has GPU kernels")
    g.add_argument("--mode", choices=("auto", "gpu", "cpu"), default="auto",
                   help="count GPU kernels or CPU operators (auto: kernels when present)")
    g.add_argument("--alias", action="append", default=[], metavar="REGEX=NAME",
                   help="rename normalized kernel names matching REGEX (repeatable)")
    g.add_argument("--no-strip-templates", action="store_true",
                   help="keep kernel names verbatim (no template/argument stripping)")
    g.add_argument("--spec", metavar="FILE", help="JSON overriding the role name rules "
                   "(see docs/census.md)")
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


def normalizer_from(args: argparse.Namespace) -> Normalizer:
    return Normalizer.from_specs(args.alias, strip_templates=not args.no_strip_templates)


def extra_from(args: argparse.Namespace) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in args.extra:
        role, sep, n = item.partition("=")
        if not sep or role not in ROLES or not n.strip().lstrip("-").isdigit():
            raise UsageError(f"--extra {item!r} is not ROLE=N with ROLE one of "
                             f"{', '.join(ROLES)} and N an integer")
        out[role] = int(n)
    return out


def model_dir_from(args: argparse.Namespace) -> str:
    """--model-dir, else the deployment's checkpoint on this host (K3_MODEL under
    K3_MODELS_DIR, wherever they are set)."""
    if args.model_dir:
        return args.model_dir
    from k3rocm.deploy.deployment import load_deployment

    dep = load_deployment()
    if dep.model_host_dir is not None and dep.model_host_dir.exists():
        return str(dep.model_host_dir)
    raise UsageError("no model config: pass --model-dir <checkpoint dir with config.json> "
                     f"(K3_MODEL={dep.model} is not a path on this host)")


def tp_from_argv(argv: list[str]) -> int:
    """vLLM's tensor-parallel size from a ``vllm serve`` argv (default 1)."""
    for i, a in enumerate(argv):
        for flag in ("-tp", "--tensor-parallel-size"):
            if a == flag and i + 1 < len(argv) and argv[i + 1].isdigit():
                return int(argv[i + 1])
            if a.startswith(flag + "=") and a.split("=", 1)[1].isdigit():
                return int(a.split("=", 1)[1])
    return 1


def resolve_world_size(trace_ws: int | None, args: argparse.Namespace,
                       server_argv: list[str] | None = None) -> tuple[int, str]:
    """Which ranks must be present: the traces' metadata, else --world-size, else the live
    server's argv; unknown is bad input (exit 2)."""
    given = getattr(args, "world_size", None)
    if given is not None:
        positive("--world-size", given)
    if trace_ws is not None:
        if given is not None and given != trace_ws:
            raise UsageError(f"--world-size {given} disagrees with the traces' "
                             f"distributedInfo.world_size {trace_ws}")
        return trace_ws, "the traces' distributedInfo"
    if given is not None:
        return given, "--world-size"
    if server_argv:
        return tp_from_argv(server_argv), "the server's argv (tensor-parallel size)"
    raise UsageError("the traces do not record the world size (no distributedInfo."
                     "world_size): pass --world-size N (the server's tensor-parallel size)")


def results_root(args: argparse.Namespace) -> str:
    """--results, else the deployment's results root (K3_RESULTS_DIR, mounted at /results)."""
    if args.results:
        return args.results
    from k3rocm.deploy.deployment import load_deployment

    return str(load_deployment().results_root)


def positive(name: str, value: int, minimum: int = 1) -> None:
    if value < minimum:
        raise UsageError(f"{name} {value} must be >= {minimum}")



def base_provenance(files: list[Path]) -> dict[str, Any]:
    from k3rocm import __version__
    from k3rocm.serving.config import redact_env

    return {
        "command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "k3rocm_version": __version__,
        "host": platform.node(),
        "python": sys.version.split()[0],
        "env": redact_env({k: v for k, v in os.environ.items() if k.startswith("K3_")}),
        "trace_files": [{"path": str(f), "bytes": f.stat().st_size, "sha256": sha256(f)}
                        for f in files],
    }
