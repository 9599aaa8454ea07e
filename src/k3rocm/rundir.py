"""Run directories, atomic writes and report tables: every run gets its own directory, nothing
is overwritten."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Sequence
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


def table(head: Sequence[str], align: str, rows: Iterable[Sequence[Any]]) -> list[str]:
    """A markdown table's lines; ``align``: a letter per column, ``r`` right, else left."""
    lines = ["| " + " | ".join(map(str, r)) + " |" for r in [head, *rows]]
    lines.insert(1, "|" + "".join("---:|" if a == "r" else "---|" for a in align.ljust(len(head))))
    return lines


def columns(head: Sequence[str], rows: Iterable[Sequence[Any]], rule: bool = True,
            cap: int | None = None) -> str:
    """Plain-text columns, each but the last padded to its widest cell (at most ``cap``);
    ``rule``: a dashed line under the head."""
    cells = [[*map(str, r)] for r in rows]
    widths = [*(min(max(len(r[i]) for r in [head, *cells]), cap or 1 << 16)
                for i in range(len(head) - 1)), len(head[-1])]
    body = [head, ["-" * w for w in widths]] if rule else [head]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in [*body, *cells])
