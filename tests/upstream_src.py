"""The real vLLM source files the tests read, one tree per release (vLLM 0.27.1 ... 0.34.0).

``python tests/upstream_src.py [--out build/vllm-src] [--wheels DIR]`` (``make upstream-src``,
run by ``.ci/setup.sh ci``) downloads each release's wheel from PyPI (``pip download --no-deps
vllm==X``; a wheel already under ``--wheels`` is used as it is), unpacks only the files below
into ``<out>/<version>/`` and drops the wheel. A tree that is complete (its ``.complete`` file
lists the same files) is kept: a re-run downloads nothing.

The tests never copy these files into the repository: they read them here (see
``tests/conftest.py:upstream_tree``). vLLM >= 0.33 needs torch 2.14 and no CPU build of it
exists, so for those releases the source is all that can be tested against.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

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


def wanted(name: str) -> bool:
    return any(name.startswith(f) if f.endswith("/") else name == f for f in FILES)


def unpack(version: str, out: Path, wheels: Path | None) -> Path:
    tree = out / version
    marker = tree / ".complete"
    if marker.is_file() and marker.read_text().splitlines()[:1] == [repr(FILES)]:
        return tree
    with tempfile.TemporaryDirectory() as tmp:
        found = sorted(wheels.glob(f"vllm-{version}-*.whl")) if wheels else []
        if not found:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            f"vllm=={version}", "-d", tmp], check=True)
            found = sorted(Path(tmp).glob(f"vllm-{version}-*.whl"))
        if not found:
            raise SystemExit(f"upstream_src: no wheel for vllm=={version}")
        shutil.rmtree(tree, ignore_errors=True)
        with zipfile.ZipFile(found[0]) as z:
            names = [n for n in z.namelist() if wanted(n)]
            for n in names:
                z.extract(n, tree)
        marker.write_text(repr(FILES) + "\n" + found[0].name + "\n")
    return tree


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
