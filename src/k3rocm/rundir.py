"""Run directories and atomic writes: every run gets its own directory, nothing is overwritten."""

from __future__ import annotations

import json
import os
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

# The process umask, read once at import (reading it means setting it; doing that per write
# would race with other threads creating files).
_UMASK = os.umask(0)
os.umask(_UMASK)


def utc_stamp(now: datetime | None = None) -> str:
    now = now or datetime.now(timezone.utc)
    return now.strftime("%Y%m%dT%H%M%SZ")


def create_run_dir(root: str | os.PathLike, label: str) -> Path:
    """Create ``<root>/<UTC timestamp>-<label>/`` and return it; never reuse an existing one."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    base = f"{utc_stamp()}-{label}"
    for n in range(1000):
        path = root / (base if n == 0 else f"{base}.{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise RuntimeError(f"could not create a fresh run directory under {root}")


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write to a temporary file beside ``path`` and rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644 & ~_UMASK)  # mkstemp creates 0600; results are meant to be read
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    return write_bytes_atomic(path, text.encode())


def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
