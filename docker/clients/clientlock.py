"""The client image's locked, hashed wheel set: write the lock, fetch the files it names.

Two steps, neither depends on the host's Python version:

``lock``      (rare: when aiperf or lm-eval is bumped; ``make clients-lock``) turns the JSON
              report of ``pip install --dry-run --report`` -- run *inside the client base
              image* (Python 3.11, the image's own interpreter, so environment markers and
              sdist metadata are evaluated for the target, not the host) -- into
              ``docker/clients/requirements.lock``: every package ``name==version`` with the
              sha256 of the exact file pip chose.
``download``  (every ``make clients-image``) runs the host's pip, any version of Python, as
              ``pip download --no-deps --require-hashes`` for CPython 3.11 / manylinux x86_64 on
              that lock: no resolution happens (``--no-deps``, every line pinned), and a file is
              accepted only if its sha256 is the locked one. The image then installs the same
              lock with ``pip install --no-index --require-hashes``.

Standard library only, runs on Python >= 3.8 (Ubuntu 22.04's 3.10, 24.04's 3.12, Debian 12's
3.11): ``python3 docker/clients/clientlock.py --help``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# The client image's interpreter and platform (python:3.11-slim-bookworm / Debian 12: glibc 2.36).
TARGET_PYTHON = "3.11"
TARGET_ABI = "cp311"
TARGET_ARCH = "x86_64"
GLIBC_MINOR_MAX = 36
LOCK_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)\s+--hash=sha256:([0-9a-f]{64})$")


class LockError(Exception):
    """Bad input: one line for the user, exit 2."""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def target_platforms() -> list[str]:
    """manylinux tags the image's glibc (2.36) accepts, newest first, plus the legacy aliases."""
    tags = [f"manylinux_2_{m}_{TARGET_ARCH}" for m in range(GLIBC_MINOR_MAX, 4, -1)]
    return tags + [f"manylinux2014_{TARGET_ARCH}", f"manylinux2010_{TARGET_ARCH}",
                   f"manylinux1_{TARGET_ARCH}", f"linux_{TARGET_ARCH}"]


def download_argv(python: str, lock: Path, dest: Path) -> list[str]:
    """The pip command that fetches the locked files. It names the target interpreter and
    platform explicitly and never consults the running interpreter's version."""
    argv = [python, "-m", "pip", "download", "--quiet", "--no-deps", "--require-hashes",
            "--python-version", TARGET_PYTHON,
            "--implementation", "cp", "--abi", TARGET_ABI, "--abi", "abi3", "--abi", "none"]
    for plat in target_platforms():
        argv += ["--platform", plat]
    return argv + ["--dest", str(dest), "-r", str(lock)]


def read_lock(lock: Path) -> dict[str, tuple[str, str]]:
    """{normalized name: (version, sha256)}; raises LockError on a line that is not pinned and
    hashed."""
    if not lock.is_file():
        raise LockError(f"{lock} is missing; run `make clients-lock` on a machine with PyPI access")
    out: dict[str, tuple[str, str]] = {}
    for n, raw in enumerate(lock.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = LOCK_LINE.match(line)
        if not m:
            raise LockError(f"{lock}:{n} is not 'name==version --hash=sha256:<64 hex>': {line!r}")
        name = _norm(m.group(1))
        if name in out:
            raise LockError(f"{lock}:{n} pins {m.group(1)} a second time")
        out[name] = (m.group(2), m.group(3))
    if not out:
        raise LockError(f"{lock} pins nothing; run `make clients-lock`")
    return out


def lock_text(report: dict, inputs: list[str], base_image: str) -> str:
    """The lock file for a ``pip install --dry-run --report`` report (pure)."""
    env = report.get("environment") or {}
    if not str(env.get("python_full_version", "")).startswith(TARGET_PYTHON + "."):
        raise LockError(f"the report was resolved by Python {env.get('python_full_version')}, "
                        f"not {TARGET_PYTHON}: resolve inside the client base image")
    if env.get("platform_machine") != TARGET_ARCH:
        raise LockError(f"the report was resolved on {env.get('platform_machine')}, "
                        f"not {TARGET_ARCH}")
    rows = []
    for item in report.get("install") or []:
        meta, info = item.get("metadata") or {}, item.get("download_info") or {}
        sha = ((info.get("archive_info") or {}).get("hashes") or {}).get("sha256")
        if not sha:
            raise LockError(f"{meta.get('name')}: the report has no sha256 (not from an index?)")
        rows.append((_norm(meta["name"]), meta["version"], sha,
                     info.get("url", "").rsplit("/", 1)[-1]))
    if not rows:
        raise LockError("the report installs nothing")
    rows.sort()
    head = [
        "# Client image (docker/clients/Dockerfile): every package, pinned and hashed.",
        "# Generated by `make clients-lock` (docker/clients/clientlock.py); do not edit by hand.",
        f"# Inputs: {' '.join(inputs)}",
        f"# Resolved by pip {report.get('pip_version')} on Python "
        f"{env.get('python_full_version')} ({env.get('platform_machine')}, "
        f"{env.get('sys_platform')}) inside {base_image}",
        f"# Packages: {len(rows)}",
        "",
    ]
    body = []
    for name, version, sha, fname in rows:
        body.append(f"# {fname}")
        body.append(f"{name}=={version} --hash=sha256:{sha}")
    return "\n".join(head + body) + "\n"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_dir(lock: Path, dest: Path) -> int:
    """Every locked hash is present in ``dest`` exactly once, nothing else is; returns the count."""
    want = {sha: name for name, (_, sha) in read_lock(lock).items()}
    have: dict[str, str] = {}
    for p in sorted(dest.iterdir()):
        if p.name in ("requirements.lock", ".complete") or p.name.startswith("."):
            continue
        h = sha256(p)
        if h not in want:
            raise LockError(f"{p} is not in {lock} (sha256 {h[:12]}...)")
        have[h] = p.name
    missing = [want[h] for h in want if h not in have]
    if missing:
        raise LockError(f"{dest} lacks {len(missing)} locked file(s): {', '.join(missing[:5])}")
    return len(have)


def cmd_download(args: argparse.Namespace) -> int:
    lock, dest = Path(args.lock), Path(args.dest)
    n = len(read_lock(lock))
    print(f"clientlock: fetching {n} locked files for CPython {TARGET_PYTHON} "
          f"{TARGET_ARCH} with {args.python} (Python "
          f"{'.'.join(map(str, sys.version_info[:3]))} here)", file=sys.stderr, flush=True)
    if args.print_argv:
        print(json.dumps(download_argv(args.python, lock, dest)))
        return 0
    dest.parent.mkdir(parents=True, exist_ok=True)  # a fresh directory per run: no races
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".partial-", dir=dest.parent))
    try:
        p = subprocess.run(download_argv(args.python, lock, tmp))
        if p.returncode != 0:
            raise LockError(f"pip download failed (exit {p.returncode}); needs PyPI access, or "
                            f"copy a filled {dest} from a machine that has it")
        shutil.copyfile(lock, tmp / "requirements.lock")
        count = check_dir(lock, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    (dest / ".complete").write_text(sha256(lock) + "\n")
    print(f"clientlock: {count} files in {dest}, all sha256 as locked", file=sys.stderr)
    return 0


def cmd_lock(args: argparse.Namespace) -> int:
    try:
        report = json.loads(Path(args.report).read_text())
    except (OSError, ValueError) as exc:
        raise LockError(f"cannot read the pip report {args.report}: {exc}") from None
    inputs = [ln.strip() for ln in Path(args.inputs).read_text().splitlines()
              if ln.strip() and not ln.lstrip().startswith("#")]
    text = lock_text(report, inputs, args.base_image)
    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, out)
    print(f"clientlock: wrote {out} ({len(read_lock(out))} packages)", file=sys.stderr)
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    print(f"clientlock: {check_dir(Path(args.lock), Path(args.dest))} files match {args.lock}",
          file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="clientlock.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("download", help="fetch the locked files (pip download, hash-checked)")
    d.add_argument("--lock", default="docker/clients/requirements.lock")
    d.add_argument("--dest", default="build/wheels/clients")
    d.add_argument("--python", default=sys.executable,
                   help="interpreter whose pip runs (any version; default this one)")
    d.add_argument("--print-argv", action="store_true",
                   help="print the pip command as JSON and fetch nothing")
    d.set_defaults(func=cmd_download)
    lk = sub.add_parser("lock", help="write the lock from a pip --dry-run --report JSON")
    lk.add_argument("--report", required=True)
    lk.add_argument("--inputs", default="docker/clients/requirements.in")
    lk.add_argument("--base-image", required=True, help="image the report was resolved in")
    lk.add_argument("--out", default="docker/clients/requirements.lock")
    lk.set_defaults(func=cmd_lock)
    c = sub.add_parser("check", help="does a wheel directory hold exactly the locked files?")
    c.add_argument("--lock", default="docker/clients/requirements.lock")
    c.add_argument("--dest", default="build/wheels/clients")
    c.set_defaults(func=cmd_check)
    args = p.parse_args(argv)
    try:
        return args.func(args)
    except LockError as exc:
        print(f"clientlock: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
