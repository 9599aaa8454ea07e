"""``k3rocm``: one command line for the bundle. ``k3rocm <command> --help`` for each command."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

from k3rocm import __version__
from k3rocm.errors import EXIT_CODES, UsageError

# command -> (module or module:alias, help); each has add_arguments(parser) and run(args) -> int;
# imported only when its command runs (the serving entrypoint must start fast).
COMMANDS: dict[str, tuple[str, str]] = {
    # serving: what runs in the image
    "render": ("k3rocm.serving.serve_cmd:render_command",
               "print the vLLM env and argv as JSON (no server)"),
    "serve": ("k3rocm.serving.serve_cmd", "validate, render and exec `vllm serve` (entrypoint)"),
    "profiles": ("k3rocm.serving.profiles",
                 "list the serving profiles, show one, validate files"),
    "manifest": ("k3rocm.serving.manifest", "write or show the image's provenance manifest"),
    "overlay": ("k3rocm.serving.overlay", "apply or inspect the Kimi-K3 AMD MLA overlay"),
    "base": ("k3rocm.serving.basefacts", "what the image's vLLM and AITER can run (base facts)"),
    # deploy: the host's view of one deployment
    "config": ("k3rocm.deploy.config_cmd", "resolved settings and their sources"),
    "preflight": ("k3rocm.deploy.scale.preflight",
                  "what this node has and needs, one table (exit 1: a fail)"),
    "model": ("k3rocm.deploy.checkpoint",
              "download Kimi-K3 at a pinned revision, or verify a copy"),
    "server": ("k3rocm.deploy.lifecycle", "the compose server: up, wait, logs, provenance, down"),
    "scale": ("k3rocm.deploy.scale.cli",
              "scale out: replicas behind vllm-router, renderings, status"),
    # checks: measure a running deployment
    "selftest": ("k3rocm.checks.selftest",
                 "before the full load: a small Kimi-K3-shaped checkpoint served, censused, "
                 "compared fusions off/on, benched"),
    "bench": ("k3rocm.checks.bench.cli", "latency/throughput with aiperf in the client container"),
    "gsm8k": ("k3rocm.checks.gsm8k.cli", "GSM8K 5-shot accuracy gate with lm-evaluation-harness"),
    "census": ("k3rocm.checks.census.cli",
               "decode kernel census from the server's profiler trace"),
    "ab": ("k3rocm.checks.ab.cli", "A/B on fresh servers: --measure bench|census"),
    "bench-ab": ("k3rocm.checks.ab.cli:bench", "fusion off vs on (or A/A) on fresh servers"),
    "census-ab": ("k3rocm.checks.ab.cli:census", "kernel census with the fusions off vs on"),
    # dev: without AMD GPUs
    "standin": ("k3rocm.dev.standin", "build the CPU stand-in base images (no AMD GPU needed)"),
    "tinymodel": ("k3rocm.dev.tinymodel", "generate the tiny random-weight MLA smoke model"),
    "smoke": ("k3rocm.dev.smoke", "build, serve on the stand-in, send one request, tear down"),
    "demo": ("k3rocm.dev.demo",
             "the whole bundle on the CPU stand-in (make up/bench/gsm8k/census)"),
}


# Commands that run without the host's deployment: in the image (serve must start fast), on
# settings alone (config --list must work with a broken .env), or on nothing. Every other
# command gets ``args.deployment``, built once in :func:`main` from its --env-file (and --gpu)
# before any work: bad settings are exit 2 there.
NO_DEPLOYMENT = frozenset({"render", "serve", "profiles", "manifest", "overlay", "base",
                           "config", "preflight", "model", "scale", "standin", "tinymodel"})
PRINT_FLAG = "--print-deployment"
EPILOG = (f"Every command takes {PRINT_FLAG}: print what it resolved from the K3_* settings "
          "(server URL, model, API key, model dir, tokenizer, results root, image) and exit. "
          "Exit codes: " + "; ".join(f"{code} {what}" for code, what in EXIT_CODES.items())
          + ".")


def _load(spec: str) -> Any:
    """A command's object: ``module`` or ``module:attr`` (an alias that presets flags); None
    when its module is not part of this install."""
    module, _, attr = spec.partition(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and (exc.name == module or module.startswith(exc.name + ".")):
            return None  # that feature is not part of this install
        raise
    return getattr(mod, attr) if attr else mod


def deployment_view(args: argparse.Namespace) -> dict:
    """What ``args``' command resolved: ``args.deployment``'s view, with what its module's
    ``deployment_view(args)`` adds or overrides (its own flags, e.g. --url)."""
    hook = getattr(args._target, "deployment_view", None)
    sub = getattr(args, "what", None) or getattr(args, "scale_cmd", None)
    from k3rocm.serving.config import redact_env

    flags = redact_env({k: "" if v is None else str(v) for k, v in vars(args).items()
                        if not k.startswith("_") and k != "deployment"})
    return {"command": " ".join(filter(None, (args.command, sub))),
            "wired": args.command not in NO_DEPLOYMENT, **args.deployment.to_json(),
            **(hook(args) if hook else {}), "args": flags}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="k3rocm", description="Serve Kimi-K3 with vLLM on 8x AMD MI355X: serving "
        "configuration, overlay, bench, gsm8k and kernel census.", epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"k3rocm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_text, add_help=False)
            continue
        target = _load(module)
        if target is None:
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        target.add_arguments(p)
        p.set_defaults(_run=target.run, _target=target)
    return parser


def parse(argv: list[str], deployment: bool = False) -> argparse.Namespace:
    """``argv`` parsed, and ``args.deployment`` built once from its --env-file (and --gpu) for
    a command not in NO_DEPLOYMENT (or when ``deployment``): bad settings are exit 2 here."""
    only = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(only if only in COMMANDS else None)
    args = parser.parse_args(argv)
    args._help = parser.print_help
    if getattr(args, "_run", None) and (deployment or args.command not in NO_DEPLOYMENT):
        from k3rocm.deploy.deployment import load_deployment

        args.deployment = load_deployment(env_file=getattr(args, "env_file", ".env"),
                                          gpu=getattr(args, "gpu", None))
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    print_dep = PRINT_FLAG in argv
    argv = [a for a in argv if a != PRINT_FLAG]
    try:
        args = parse(argv, deployment=print_dep)
        if not getattr(args, "_run", None):
            args._help()
            return 0 if not argv else 2
        if print_dep:
            print(json.dumps(deployment_view(args), sort_keys=True))
            return 0
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
