"""``k3rocm model``: download Kimi-K3 at a pinned revision into K3_MODELS_DIR, or verify a copy;
and :func:`identity`, the checkpoint's identity in every run record.

Download: huggingface_hub's ``snapshot_download`` (resumable: finished files are kept), after
listing the revision's files and checking free disk; the listing is recorded in
``<dir>/.k3rocm-checkpoint.json``. Verify reads headers only: every shard's safetensors header
against its file size and the index, total bytes against ``metadata.total_size``, extra and
missing files, the recorded revision.
Exit: 0 ok, 1 verification failed, 2 bad input, 3 the Hub could not be reached.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from k3rocm.deploy.selftest_model import CONFIG, INDEX, read_layout
from k3rocm.errors import UsageError, tagged_log
from k3rocm.hashing import sha256_file as _sha256
from k3rocm.options import DeploymentFlags

REPO_ID = "moonshotai/Kimi-K3"
# The pinned revision, from public records (several projects pin it: "lastModified 2026-09-02",
# 96 shards, index total_size modelfacts.KIMI_K3_CHECKPOINT_BYTES); `--revision` picks another.
REVISION = "f831ab66814297da540d832a5235f8e904f29d06"
DEFAULT_DIR_NAME = "Kimi-K3"
RECORD = ".k3rocm-checkpoint.json"
HF_META_DIR = Path(".cache") / "huggingface"  # huggingface_hub's local_dir bookkeeping
_SHA = re.compile(r"^[0-9a-f]{40}$")
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


_log = tagged_log("model")


def _read_record(d: Path) -> dict[str, Any] | None:
    try:
        rec = json.loads((d / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def _hf_revision(d: Path) -> str | None:
    """The commit huggingface_hub recorded for config.json in a ``local_dir`` download
    (first line of ``.cache/huggingface/download/config.json.metadata``).
    """
    try:
        first = (d / HF_META_DIR / "download" / f"{CONFIG}.metadata").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    return first.strip() if _SHA.match(first.strip()) else None


def _files(d: Path) -> list[Path]:
    return [p for p in d.rglob("*") if p.is_file()
            and p.relative_to(d).parts[0] not in (".cache", RECORD)]


def identity(host_model_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The checkpoint in ``host_model_dir`` for provenance (None without config.json):
    revision, sha256 of config.json and of the index, file count and bytes (shards not hashed).
    """
    d = Path(host_model_dir).expanduser()
    if not (d / CONFIG).is_file():
        return None
    rec = _read_record(d) or {}
    revision, source = rec.get("revision"), "k3rocm model" if rec.get("revision") else None
    if not revision:
        revision = _hf_revision(d)
        source = "huggingface_hub download metadata" if revision else None
    index = d / INDEX
    try:
        total_size = json.loads(index.read_text()).get("metadata", {}).get("total_size")
    except (OSError, ValueError, AttributeError):
        total_size = None
    files = _files(d)
    return {
        "path": str(d.resolve()),
        "repo_id": rec.get("repo_id"),
        "revision": revision,
        "revision_source": source,
        "config_sha256": _sha256(d / CONFIG),
        "index_sha256": _sha256(index) if index.is_file() else None,
        "index_total_size": total_size,
        "files": len(files),
        "total_bytes": sum(f.stat().st_size for f in files),
    }


def verify(d: Path, revision: str | None = None) -> list[str]:
    """Problems with the copy in ``d`` (empty: complete); headers only, progress logged."""
    problems: list[str] = []
    try:
        json.loads((d / CONFIG).read_text())
    except FileNotFoundError:
        problems.append(f"{CONFIG} is missing")
    except (OSError, ValueError) as exc:
        problems.append(f"{CONFIG} is not valid JSON ({exc})")
    rec = _read_record(d)
    sizes: dict[str, int] = dict((rec or {}).get("files") or {})
    index = d / INDEX
    wmap: dict[str, str] = {}
    total_size = None
    if index.is_file():
        try:
            idx = json.loads(index.read_text())
            wmap = dict(idx["weight_map"])
            if not all(isinstance(v, str) for v in wmap.values()):
                raise TypeError("weight_map values are not file names")
            total_size = (idx.get("metadata") or {}).get("total_size")
        except (OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
            problems.append(f"{INDEX} is not a safetensors index ({exc})")
            wmap = {}
        shards = sorted(set(wmap.values()))
    elif (d / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        problems.append(f"neither {INDEX} nor model.safetensors is present")
        shards = []
    problems += _check_shards(d, shards, wmap, sizes, total_size if wmap else None)
    listed = set(shards) | set(sizes)
    for p in sorted(d.glob("*.safetensors")):
        if p.name not in listed:
            problems.append(f"extra shard {p.name} ({p.stat().st_size} bytes): neither the index "
                            "nor the revision listing names it")
    for name, size in sorted(sizes.items()):
        p = d / name
        if name in shards:
            continue  # checked above, with its header
        if not p.is_file():
            problems.append(f"{name} (revision listing) is missing")
        elif p.stat().st_size != size:
            problems.append(f"{name} has {p.stat().st_size} bytes, the Hub lists {size}")
    have = (rec or {}).get("revision") or _hf_revision(d)
    if revision and have and have != revision:
        problems.append(f"this copy is revision {have}, not {revision}")
    return problems


def _check_shards(d: Path, shards: list[str], wmap: dict[str, str], sizes: dict[str, int],
                  total_size: Any) -> list[str]:
    """Each shard's header against its file size and the index; the declared tensor bytes
    against the index's total_size.
    """
    problems: list[str] = []
    by_shard: dict[str, list[str]] = {}
    for name, shard in wmap.items():
        by_shard.setdefault(shard, []).append(name)
    t0 = last = time.monotonic()
    declared = read = 0
    for i, shard in enumerate(shards, 1):
        p = d / shard
        if time.monotonic() - last >= 2:
            last = time.monotonic()
            _log(f"verify: {i - 1}/{len(shards)} shard headers read, {_gb(declared)} of tensor "
                 f"data declared ({last - t0:.0f} s)")
        if not p.is_file():
            problems.append(f"shard {shard} (listed in {INDEX}) is missing")
            continue
        size = p.stat().st_size
        if shard in sizes and size != sizes[shard]:
            problems.append(f"shard {shard} has {size} bytes, the Hub lists {sizes[shard]}")
        try:
            tensors, start = read_layout(p)
        except UsageError as exc:
            problems.append(f"shard {shard}: {str(exc).removeprefix(f'{p}: ')}")
            continue
        read += 1
        end = max((t.start + t.nbytes for t in tensors.values()), default=start)
        data = sum(t.nbytes for t in tensors.values())
        declared += data
        if data != end - start:
            problems.append(f"shard {shard}: its header's data offsets leave gaps or overlap "
                            f"({data} tensor bytes in a span of {end - start})")
        if size < end:
            problems.append(f"shard {shard} is short: {size} bytes, its header's data offsets "
                            f"end at {end} ({_gb(end - size)} missing)")
        elif size > end:
            problems.append(f"shard {shard} has {size - end} bytes past its header's last tensor")
        absent = [n for n in by_shard.get(shard, []) if n not in tensors]
        if absent:
            problems.append(f"shard {shard} lacks {len(absent)} tensor(s) {INDEX} puts there "
                            f"(e.g. {sorted(absent)[0]})")
    if shards:
        _log(f"verify: {read}/{len(shards)} shard headers read, {_gb(declared)} of tensor data "
             f"declared ({time.monotonic() - t0:.1f} s)")
    if isinstance(total_size, int) and declared != total_size:
        problems.append(f"the {read} readable shard(s) of {len(shards)} declare {declared} bytes "
                        f"({_gb(declared)}) of tensors; {INDEX} total_size is {total_size} "
                        f"({_gb(total_size)})")
    return problems


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Download Kimi-K3 at a pinned revision into K3_MODELS_DIR (resumable: "
                     "finished files are kept), or verify an existing copy. The checkpoint's "
                     "identity (revision, sha256 of config.json and of the safetensors index) "
                     "goes into every result's provenance.")
    p.add_argument("--verify", action="store_true",
                   help="only verify the copy already there: every shard's header against its "
                   "bytes and the index (headers only; exit 1 when incomplete)")
    p.add_argument("--dry-run", action="store_true",
                   help="list the revision's files on the Hub and print what would be fetched "
                   "(and how much disk it needs); download nothing")
    p.add_argument("--dir", type=Path, default=None,
                   help="checkpoint directory on this host (default: the host path of "
                   f"K3_MODEL under K3_MODELS_DIR, else <K3_MODELS_DIR>/{DEFAULT_DIR_NAME})")
    p.add_argument("--repo", default=REPO_ID, help=f"Hub repository (default {REPO_ID})")
    p.add_argument("--revision", default=REVISION,
                   help=f"40-hex commit to fetch (default, pinned: {REVISION})")
    p.add_argument("--max-workers", type=int, default=8, help="parallel file downloads")
    DeploymentFlags.add_arguments(p)


def target_dir(env_file: str | None = ".env") -> Path:
    """Where the checkpoint lives on this host, from the K3_* settings."""
    from k3rocm.serving.config import _host_path, load_settings

    s, _ = load_settings(dotenv=env_file, check_model=False)
    if s.model == "/models" or s.model.startswith("/models/"):
        return _host_path(s, s.model)
    return Path(s.models_dir).expanduser() / DEFAULT_DIR_NAME


def run(args: argparse.Namespace) -> int:
    if not _SHA.match(args.revision or ""):
        raise UsageError(f"--revision {args.revision!r} is not a 40-hex commit: pin an immutable "
                         "revision (the Hub's commit list for the repository shows them; "
                         "branches and tags move)")
    if not _REPO.match(args.repo):
        raise UsageError(f"--repo {args.repo!r} is not a Hub repository id (owner/name)")
    if args.max_workers < 1:
        raise UsageError(f"--max-workers {args.max_workers} must be >= 1")
    d = (args.dir or target_dir(args.env_file)).expanduser()
    if d.exists() and not d.is_dir():
        raise UsageError(f"{d} exists and is not a directory")
    if args.verify:
        if not d.is_dir():
            raise UsageError(f"{d} does not exist: download it with `make model` (or set "
                             "K3_MODELS_DIR / --dir to where the checkpoint is)")
        return _report(d, args.revision)
    rec = _read_record(d) if d.is_dir() else None
    if rec and rec.get("revision") not in (None, args.revision):
        raise UsageError(f"{d} holds revision {rec.get('revision')} (recorded by `make model`), "
                         f"not {args.revision}: use another --dir or remove that copy")
    if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        raise UsageError("HF_HUB_OFFLINE is set in this shell: unset it to download (or use "
                         "--verify for a copy already there)")
    listing, shas = _list_files(args.repo, args.revision)
    missing = {n: s for n, s in listing.items()
               if not ((d / n).is_file() and (d / n).stat().st_size == s)}
    need = sum(missing.values())
    _log(f"{args.repo}@{args.revision}: {len(listing)} files, {_gb(sum(listing.values()))}; "
         f"{len(listing) - len(missing)} already in {d}, {len(missing)} to fetch ({_gb(need)})")
    probe = d if d.exists() else next((p for p in d.parents if p.exists()), Path("/"))
    free = shutil.disk_usage(probe).free
    if args.dry_run:
        for name in sorted(missing):
            print(f"fetch {name} {missing[name]}")
        print(f"would fetch {len(missing)} of {len(listing)} files, {need} bytes, into {d} "
              f"({_gb(free)} free there)")
        return 0
    if need > free:
        raise UsageError(f"{d}: {_gb(need)} to fetch but {_gb(free)} free there: free space "
                         "or point K3_MODELS_DIR / --dir at a larger disk")
    d.mkdir(parents=True, exist_ok=True)
    _download(args.repo, args.revision, d, args.max_workers)
    stale = partial_files(d)  # left by interrupted runs; this run finished every file
    for p in stale:
        p.unlink(missing_ok=True)
    if stale:
        _log(f"removed {len(stale)} partial file(s) of earlier interrupted downloads")
    from k3rocm.rundir import write_json_atomic

    write_json_atomic(d / RECORD, {
        "repo_id": args.repo, "revision": args.revision, "written_by": "k3rocm model",
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "files": listing, "lfs_sha256": shas})
    return _report(d, args.revision)


def partial_files(d: Path) -> list[Path]:
    """Files of interrupted downloads (huggingface_hub's ``*.incomplete`` under
    ``.cache/huggingface/download``): the next run starts afresh, so they only take space.
    """
    return sorted((d / HF_META_DIR).rglob("*.incomplete"))


def _report(d: Path, revision: str) -> int:
    problems = verify(d, revision)
    ident = identity(d)
    stale = partial_files(d)
    if stale:
        print(f"note: {len(stale)} partial file(s) of interrupted downloads under "
              f"{d / HF_META_DIR} ({_gb(sum(p.stat().st_size for p in stale))}): a finished "
              "`make model` removes them")
    if problems:
        for p in problems:
            print(f"FAIL {p}")
        print(f"{d}: {len(problems)} problem(s); `make model` fetches what is missing")
        return 1
    print(json.dumps(ident, indent=2))
    print(f"ok: {d} is complete (revision {ident['revision'] if ident else None})")
    return 0


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if abs(n) >= 1e8 else f"{n / 1e6:.1f} MB"


def _list_files(repo: str, revision: str) -> tuple[dict[str, int], dict[str, str]]:
    """Every file of ``repo`` at ``revision``: path -> size, path -> LFS sha256."""
    try:
        from huggingface_hub import HfApi, errors
        from huggingface_hub.hf_api import RepoFile
    except ImportError:
        raise UsageError("huggingface_hub is not installed: `make venv` (host extras) installs "
                         "it") from None
    try:
        entries = [e for e in HfApi().list_repo_tree(repo, revision=revision, recursive=True)
                   if isinstance(e, RepoFile)]
    except errors.GatedRepoError:
        raise UsageError(f"{repo} is gated: accept its license on the Hub and set HF_TOKEN "
                         "in the shell or .env") from None
    except errors.RepositoryNotFoundError:
        raise UsageError(f"{repo} is not on the Hub (or needs HF_TOKEN)") from None
    except errors.RevisionNotFoundError:
        raise UsageError(f"{repo} has no revision {revision}") from None
    except (errors.HfHubHTTPError, OSError) as exc:
        raise UsageError(f"cannot list {repo}@{revision} on the Hub: {_one_line(exc)}",
                         exit_code=3) from None
    except Exception as exc:  # httpx connection errors and the like
        if _transport(exc):
            raise UsageError(f"cannot reach the Hub to list {repo}@{revision}: "
                             f"{_one_line(exc)}", exit_code=3) from None
        raise
    return ({e.path: int(e.size) for e in entries},
            {e.path: e.lfs.sha256 for e in entries if e.lfs is not None})


def _download(repo: str, revision: str, d: Path, workers: int) -> None:
    from huggingface_hub import snapshot_download

    _log(f"downloading into {d} ({workers} parallel files; Ctrl-C keeps finished files)")
    try:
        snapshot_download(repo, revision=revision, local_dir=d, max_workers=workers)
    except Exception as exc:
        if _transport(exc):
            raise UsageError(f"download of {repo}@{revision} stopped: {_one_line(exc)}; run "
                             "`make model` again to continue", exit_code=3) from None
        raise


def _transport(exc: BaseException) -> bool:
    """A network or Hub error (huggingface_hub 2.x raises its vendored httpx's errors)."""
    top = type(exc).__module__.split(".")[0]
    return top.startswith(("httpx", "httpcore", "huggingface_hub")) or isinstance(
        exc, (ConnectionError, TimeoutError))


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__
