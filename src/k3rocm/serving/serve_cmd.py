"""The entrypoint's commands: ``k3rocm serve`` (validate, render, log each value's source, exec
``vllm serve`` so vLLM is the container's main process) and ``k3rocm render`` (print it).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace

from k3rocm.errors import UsageError
from k3rocm.rundir import write_text_atomic
from k3rocm.serving.config import redact_argv, redact_env, render


def add_arguments(parser: argparse.ArgumentParser, render_only: bool = False) -> None:
    parser.add_argument("--env-file", default=".env",
                        help="optional KEY=VALUE file read under the process environment "
                        "(default: .env; missing is fine)")
    if render_only:
        parser.add_argument("--no-redact", action="store_true",
                            help="show secrets (K3_API_KEY, HF_TOKEN) instead of ***")
    parser.add_argument("passthrough", nargs=argparse.REMAINDER,
                        help="extra `vllm serve` arguments (after --)")


def _render(args: argparse.Namespace):
    rest = list(args.passthrough or [])
    return render(dotenv=args.env_file, passthrough=rest[1:] if rest[:1] == ["--"] else rest,
                  base=True)


def warn(rendered) -> None:
    """The rendering's warnings, one line each on stderr."""
    for line in rendered.warnings:
        print(f"k3rocm: warning: {line}", file=sys.stderr)


def run_render(args: argparse.Namespace) -> int:
    rendered = _render(args)
    warn(rendered)
    print(json.dumps(rendered.to_json(redact=not args.no_redact), indent=2))
    return 0


render_command = SimpleNamespace(add_arguments=partial(add_arguments, render_only=True),
                                 run=run_render)


RENDERED_FILE = "/tmp/k3rocm-rendered.json"  # noqa: S108 - the container's own /tmp


def run(args: argparse.Namespace) -> int:
    rendered = _render(args)
    exe = shutil.which(rendered.argv[0])
    if exe is None:
        raise UsageError(f"{rendered.argv[0]!r} is not on PATH: run this inside the serving image "
                         "(or install vLLM)")
    shown = redact_env({**os.environ, **rendered.env})  # K3_* from the shell: not in env
    print(f"k3rocm: profile {rendered.settings.profile}", file=sys.stderr)
    warn(rendered)
    b = rendered.base
    if b is None:
        print("k3rocm: base facts unknown (no manifest, no vLLM found): nothing checked",
              file=sys.stderr)
    else:
        from k3rocm.serving.basefacts import describe

        for i, line in enumerate(describe(b)):  # a header, then the notes
            print(f"k3rocm: {'base: ' if i else ''}{line}", file=sys.stderr)
    for key in sorted(rendered.sources):
        if key.startswith("K3_") or key in rendered.env:
            print(f"k3rocm:   {key}={shown.get(key, '')}  [{rendered.sources[key]}]",
                  file=sys.stderr)
    if rendered.settings.allow_hub_download and not rendered.settings.model.startswith("/"):
        size = " (Kimi-K3: ~1.56 TB)" if "kimi-k3" in rendered.settings.model.lower() else ""
        print(f"k3rocm: K3_ALLOW_HUB_DOWNLOAD=1: vLLM downloads {rendered.settings.model}"
              f"{size} into {rendered.env.get('HF_HOME', '~/.cache/huggingface')} unless it "
              "is cached there already", file=sys.stderr)
    # Render once, read the rendering: what this server was really started with (env and argv,
    # secrets redacted, and what the base facts changed) for the checks that read a running
    # server (the census's claim, provenance). Best effort: a read-only /tmp only warns.
    path = os.environ.get("K3_RENDERED_FILE") or RENDERED_FILE
    try:
        write_text_atomic(Path(path), json.dumps(rendered.to_json(), indent=1, sort_keys=True))
    except OSError as exc:
        print(f"k3rocm: warning: cannot write {path} ({exc})", file=sys.stderr)
    print("k3rocm: exec " + shlex.join(redact_argv(rendered.argv)), file=sys.stderr, flush=True)
    os.execvpe(exe, rendered.argv, {**os.environ, **rendered.env})
    return 0  # not reached
