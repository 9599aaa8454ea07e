"""``k3rocm``: one command line for the bundle. ``k3rocm <command> --help`` for each command."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from k3rocm import __version__
from k3rocm.errors import UsageError

# command -> (module, one-line help). Each module has add_arguments(parser) and run(args) -> int.
# Modules are imported only when their command runs, so `serve` stays fast and light.
COMMANDS: dict[str, tuple[str, str]] = {
    "config": ("k3rocm.commands.config_cmd", "resolved settings and their sources"),
    "render": ("k3rocm.commands.render_cmd", "print the vLLM env and argv as JSON (no server)"),
    "serve": ("k3rocm.commands.serve_cmd", "validate, render and exec `vllm serve` (entrypoint)"),
    "manifest": ("k3rocm.manifest", "write or show the image's provenance manifest"),
    "overlay": ("k3rocm.overlay", "apply or inspect the Kimi-K3 AMD MLA overlay"),
    "standin": ("k3rocm.standin", "build the CPU stand-in base images (no AMD GPU needed)"),
    "tinymodel": ("k3rocm.tinymodel", "generate the tiny random-weight MLA smoke model"),
    "server": ("k3rocm.lifecycle", "the compose server: up, wait, logs, provenance, down"),
    "smoke": ("k3rocm.smoke", "build, serve on the stand-in, send one request, tear down"),
    "bench": ("k3rocm.bench.cli", "latency/throughput with aiperf in the client container"),
    "bench-ab": ("k3rocm.bench.ab_cli", "fusion off vs on (or A/A) on fresh servers"),
    "gsm8k": ("k3rocm.gsm8k.cli", "GSM8K 5-shot accuracy gate with lm-evaluation-harness"),
    "census": ("k3rocm.census.cli", "decode kernel census from the server's profiler trace"),
    "census-ab": ("k3rocm.census.ab_cli", "kernel census with the fusions off vs on"),
    "ab": ("k3rocm.lifecycle.ab_cli", "A/B on fresh servers: --measure bench|census"),
    "scale": ("k3rocm.scale.cli", "scale out: replicas behind vllm-router, renderings, status"),
    "preflight": ("k3rocm.preflight", "what this node has and needs, one table (exit 1: a fail)"),
}


def _load(module: str) -> tuple[Callable, Callable] | None:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and (exc.name == module or module.startswith(exc.name + ".")):
            return None  # that feature is not part of this install
        raise
    return mod.add_arguments, mod.run


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="k3rocm", description="Serve Kimi-K3 with vLLM on 8x AMD MI355X: serving "
        "configuration, overlay, bench, gsm8k and kernel census.")
    parser.add_argument("--version", action="version", version=f"k3rocm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_text, add_help=False)
            continue
        loaded = _load(module)
        if loaded is None:
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        loaded[0](p)
        p.set_defaults(_run=loaded[1])
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Import only the command being run (the serving entrypoint must start fast).
    only = next((a for a in argv if not a.startswith("-")), None)
    only = only if only in COMMANDS else None
    try:
        parser = build_parser(only)
        args = parser.parse_args(argv)
        if not getattr(args, "_run", None):
            parser.print_help()
            return 0 if not argv else 2
        return int(args._run(args) or 0)
    except UsageError as exc:
        print(f"k3rocm: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("k3rocm: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `k3rocm render | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
