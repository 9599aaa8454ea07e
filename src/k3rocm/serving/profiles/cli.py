"""``k3rocm profiles``: list the serving profiles, show what one sets, validate profile files."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from k3rocm.serving import profiles


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", help="show this profile: the settings and environment it "
                   "gives (after `extends`), as JSON")
    p.add_argument("--dir", type=Path, default=None,
                   help="read profiles from DIR instead of the installed ones (e.g. to validate "
                   "a new profile file before adding it to src/k3rocm/serving/profiles/)")
    p.add_argument("--check", action="store_true",
                   help="validate every profile file; exit 2 with the file and key on a problem")


def run(args: argparse.Namespace) -> int:
    d = args.dir
    if d is not None and not d.is_dir():
        from k3rocm.errors import UsageError

        raise UsageError(f"--dir {d}: not a directory")
    if args.name:
        json.dump(profiles.get(args.name, d), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    for name in profiles.names(d):
        prof = profiles.get(name, d)  # validates
        if not args.check:
            meta = prof["meta"]
            print(f"{name:<18} {meta['hardware']:<4} {meta['description']}")
    if args.check:
        print(f"{len(profiles.names(d))} profiles valid: {', '.join(profiles.names(d))}")
    return 0
