"""``k3rocm render``: print ``{"env": ..., "argv": ..., "sources": ...}`` and exit (no server)."""

from __future__ import annotations

import argparse
import json
import sys

from k3rocm.serving.config import render


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--env-file", default=".env",
                        help="optional KEY=VALUE file read under the process environment "
                        "(default: .env; missing is fine)")
    parser.add_argument("--no-redact", action="store_true",
                        help="show secrets (K3_API_KEY, HF_TOKEN) instead of ***")
    parser.add_argument("passthrough", nargs=argparse.REMAINDER,
                        help="extra `vllm serve` arguments (after --)")


def passthrough_args(args: argparse.Namespace) -> list[str]:
    rest = list(args.passthrough or [])
    return rest[1:] if rest[:1] == ["--"] else rest


def run(args: argparse.Namespace) -> int:
    rendered = render(dotenv=args.env_file, passthrough=passthrough_args(args), base=True)
    json.dump(rendered.to_json(redact=not args.no_redact), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0
