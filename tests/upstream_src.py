"""The real vLLM source files the tests read, one tree per release (vLLM 0.27.1 ... 0.34.0).

``python tests/upstream_src.py [--out build/vllm-src] [--wheels DIR]`` (``make upstream-src``,
run by ``.ci/setup.sh ci``) downloads each release's wheel from PyPI (``pip download --no-deps
vllm==X``; a wheel already under ``--wheels`` is used as it is), unpacks only the files below
and the wheel's RECORD into ``${XDG_CACHE_HOME:-~/.cache}/k3rocm/vllm-src/<version>/`` (outside
the checkout: a fresh clone downloads nothing) and copies that into ``<out>/<version>/``. A tree
is used only if it holds exactly these files, each with its sha256 in RECORD (checked every run).

The tests never copy these files into the repository: they read them here (see
``tests/conftest.py:upstream_tree``). vLLM >= 0.33 needs torch 2.14 and no CPU build of it
exists, so for those releases the source is all that can be tested against.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from k3rocm.dev.standin import CACHE_ROOT

RELEASES = ("0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
# Whole directories (prefix ends with "/") and single files.
FILES = (
    "vllm/__init__.py",
    "vllm/_version.py",
    "vllm/envs.py",
    "vllm/_aiter_ops.py",
    "vllm/config/vllm.py",
    "vllm/config/compilation.py",
    "vllm/platforms/rocm.py",
    "vllm/v1/attention/backends/mla/rocm_aiter_mla.py",
    "vllm/v1/worker/gpu_model_runner.py",
    "vllm/model_executor/layers/mla.py",
    "vllm/model_executor/layers/attention/mla_attention.py",
    "vllm/model_executor/model_loader/__init__.py",
    "vllm/models/kimi_k3/",
)
REPO = Path(__file__).resolve().parent.parent
# Outside the checkout, so that a fresh clone reuses it (the same root as the stand-in wheels).
CACHE = CACHE_ROOT / "vllm-src"
MARKER, RECORD = ".complete", ".record"  # RECORD: the wheel's own list of file sha256s


def wanted(name: str) -> bool:
    return any(name.startswith(f) if f.endswith("/") else name == f for f in FILES)


def _digest(path: Path) -> str:
    """sha256 as a wheel's RECORD writes it: ``sha256=<urlsafe base64, no padding>``."""
    raw = hashlib.sha256(path.read_bytes()).digest()
    return "sha256=" + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def problem(tree: Path) -> str | None:
    """Why ``tree`` is not the wanted files of its wheel, each as its RECORD hashes it; or None."""
    marker = tree / MARKER
    if not marker.is_file() or marker.read_text().splitlines()[:1] != [repr(FILES)]:
        return "not unpacked with this file list"
    if not (tree / RECORD).is_file():
        return "no RECORD"
    want = {row[0]: row[1] for row in csv.reader((tree / RECORD).read_text().splitlines())
            if row and wanted(row[0])}
    have = {p.relative_to(tree).as_posix() for p in tree.rglob("*")
            if p.is_file() and p.name not in (MARKER, RECORD) and "__pycache__" not in p.parts}
    if have != set(want):
        return f"{len(have ^ set(want))} file(s) missing or not in the wheel"
    bad = [n for n in sorted(want) if _digest(tree / n) != want[n]]
    return f"{bad[0]} does not match its sha256 in RECORD" if bad else None


def _replace(tmp: Path, tree: Path) -> Path:
    shutil.rmtree(tree, ignore_errors=True)
    os.replace(tmp, tree)
    return tree


def extract(version: str, cache: Path, wheels: Path | None) -> Path:
    """The cached tree of ``version``, unpacked from its wheel unless it is already correct."""
    tree = cache / version
    why = problem(tree)
    if why is None:
        return tree
    if tree.exists():
        print(f"upstream_src: cached vllm {version}: {why}; unpacking again", flush=True)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=f".{version}-") as tmp:
        found = sorted(wheels.glob(f"vllm-{version}-*.whl")) if wheels else []
        if not found:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            f"vllm=={version}", "-d", tmp], check=True)
            found = sorted(Path(tmp).glob(f"vllm-{version}-*.whl"))
        if not found:
            raise SystemExit(f"upstream_src: no wheel for vllm=={version}")
        new = Path(tmp) / "tree"
        with zipfile.ZipFile(found[0]) as z:
            for n in z.namelist():
                if wanted(n):
                    z.extract(n, new)
            (new / RECORD).write_bytes(z.read(f"vllm-{version}.dist-info/RECORD"))
        (new / MARKER).write_text(repr(FILES) + "\n" + found[0].name + "\n")
        why = problem(new)
        if why:
            raise SystemExit(f"upstream_src: {found[0].name}: {why}")
        return _replace(new, tree)


def unpack(version: str, out: Path, wheels: Path | None, cache: Path = CACHE) -> Path:
    """``<out>/<version>``: kept if correct, else copied from the (checked) cache."""
    tree = out / version
    if problem(tree) is None:
        return tree
    src = extract(version, cache, wheels)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=f".{version}-") as tmp:
        return _replace(shutil.copytree(src, Path(tmp) / "tree"), tree)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "build" / "vllm-src")
    ap.add_argument("--wheels", type=Path, default=None,
                    help="a directory of already downloaded vllm wheels to use first")
    ap.add_argument("--version", action="append", choices=RELEASES,
                    help="only these releases (default: all)")
    args = ap.parse_args(argv)
    for v in args.version or RELEASES:
        tree = unpack(v, args.out, args.wheels)
        print(f"upstream_src: vllm {v} -> {tree}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
