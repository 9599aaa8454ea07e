"""Read a chrome trace as a stream (``ijson``): the events one at a time, and the top-level keys
torch writes before ``traceEvents`` (torch/profiler/_chrome_trace_export.py) and kineto after it
(``baseTimeNanoseconds``: libkineto/src/output_json.cpp).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ijson

from k3rocm.errors import UsageError

HEAD_MAX = 1 << 20  # bytes kept from the start (the header before "traceEvents")
TAIL_MAX = 1 << 16  # bytes kept from the end (kineto's closing keys)


class _Tee:
    """A binary reader that keeps the first HEAD_MAX and the last TAIL_MAX bytes it passed."""

    def __init__(self, fh: Any):
        self.fh = fh
        self.head = bytearray()
        self.tail = b""
        self.read_bytes = 0

    def read(self, n: int = -1) -> bytes:
        data = self.fh.read(n)
        self.read_bytes += len(data)
        if len(self.head) < HEAD_MAX:
            self.head += data[:HEAD_MAX - len(self.head)]
        self.tail = (self.tail + data)[-TAIL_MAX:]
        return data


def _unreadable(path: Path, exc: BaseException) -> UsageError:
    why = " ".join(str(exc).split())[:160]
    return UsageError(f"trace {path} cannot be read as chrome-trace JSON "
                      f"({exc.__class__.__name__}: {why}); expected a .pt.trace.json or "
                      ".pt.trace.json.gz file; re-collect it")


def _header(head: bytes, tail: bytes) -> dict[str, Any]:
    """The top-level keys other than traceEvents, from the bytes around the event list."""
    out: dict[str, Any] = {}
    text = head.decode("utf-8", "replace")
    i = text.find('"traceEvents"')
    if i > 0:
        with contextlib.suppress(ValueError):
            out.update(json.loads(text[:i].rstrip().rstrip(",") + "}"))
    t = tail.decode("utf-8", "replace").rstrip().removesuffix("}")
    j = len(t)
    for _ in range(32):  # the event list ends at one of the last "]": the one that parses
        j = t.rfind("]", 0, j)
        if j < 0:
            break
        rest = t[j + 1:].strip().lstrip(",")
        if not rest:
            break
        try:
            out.update(json.loads("{" + rest + "}"))
            break
        except ValueError:
            continue
    return out


def events(path: Path, header: dict[str, Any]) -> Iterator[Any]:
    """The trace's events one at a time; afterwards ``header`` holds the other keys."""
    try:
        raw = open(path, "rb")  # noqa: SIM115 - closed when the generator ends
    except OSError as exc:
        raise _unreadable(path, exc) from None
    with raw:
        src = gzip.GzipFile(fileobj=raw) if raw.read(2) == b"\x1f\x8b" else raw
        try:
            raw.seek(0)
            lead = src.read(64).lstrip()[:1]
            src.seek(0)
        except (OSError, EOFError, zlib.error) as exc:
            raise _unreadable(path, exc) from None
        if lead not in (b"{", b"["):
            raise _unreadable(path, ValueError(f"starts with {lead!r}, not JSON"))
        prefix = "item" if lead == b"[" else "traceEvents.item"
        tee = _Tee(src)
        count = 0
        try:
            for e in ijson.items(tee, prefix, use_float=True):
                count += 1
                yield e
            while tee.read(1 << 16):  # what follows the list: kineto's closing keys
                pass
        except (OSError, EOFError, zlib.error, ValueError, ijson.JSONError) as exc:
            raise _unreadable(path, exc) from None
    if tee.read_bytes > HEAD_MAX:
        header.update(_header(bytes(tee.head), tee.tail))
        return
    obj = json.loads(bytes(tee.head))  # a small file, read whole: ijson found it valid
    if isinstance(obj, dict):
        header.update((k, v) for k, v in obj.items() if k != "traceEvents")
    if not count and prefix != "item" and not (
            isinstance(obj, dict) and isinstance(obj.get("traceEvents"), list)):
        raise UsageError(f"trace {path} has no traceEvents list; not a chrome trace")
