"""The fusion decision records (``k3rocm.overlay.decision/1``, docs/census.md): the reader of what
the overlay file and the upstream hook write (``k3rocm-decisions-pid<PID>.json`` beside the
traces, else ``K3ROCM-DECISION {json}`` log lines; per (pid, layer_kind) the last record wins,
``load`` over ``construct``), and :class:`Writer`, the upstream hook's writer of that format.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3rocm.errors import UsageError
from k3rocm.rundir import write_text_atomic
from k3rocm.serving.fusions import FUSIONS

# Copies of the overlay's DECISION_* constants, held equal by tests/test_decisions_unit.py.
SCHEMA = "k3rocm.overlay.decision/1"
MARKER = "K3ROCM-DECISION "
FILE = "k3rocm-decisions-pid{pid}.json"
FILE_GLOB = FILE.format(pid="*")
STATES = {f.name: f.states for f in FUSIONS}
_PHASE = {"construct": 0, "load": 1}
# Who wrote a record (absent = "overlay").
WRITERS = ("overlay", "upstream")
_FILE_RE = re.compile(r"^k3rocm-decisions-pid\d+\.json$")


@dataclass
class Record:
    pid: int
    process: str
    tp_rank: int | None
    layer_kind: str
    phase: str
    states: dict[str, str]
    reasons: dict[str, str]
    asked: dict[str, bool | None]
    where: str
    order: int
    raw: dict[str, Any]
    writer: str = "overlay"  # "overlay" (our amd/mla.py) or "upstream" (the hook on upstream's)

    def label(self) -> str:
        tp = "?" if self.tp_rank is None else self.tp_rank
        return f"pid {self.pid} ({self.process}, tp_rank {tp})"


def parse_record(obj: Any, where: str, order: int = 0) -> Record:
    """Validate one record; anything off-format is a one-line UsageError naming ``where``."""
    def bad(what: str) -> UsageError:
        return UsageError(f"decision record at {where} is malformed: {what} (format: "
                          f"{SCHEMA}, see docs/census.md)")

    if not isinstance(obj, dict):
        raise bad("not a JSON object")

    def integer(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    obj = {"writer": "overlay", **obj}  # records without a writer field are the overlay's
    for key, ok, want in (("schema", lambda v: v == SCHEMA, repr(SCHEMA)),
                          ("pid", integer, "an integer"),
                          ("tp_rank", lambda v: v is None or integer(v), "an integer or null"),
                          ("layer_kind", lambda v: v in ("target", "draft"), "target or draft"),
                          ("phase", lambda v: v in _PHASE, "construct or load"),
                          ("writer", lambda v: v in WRITERS, " or ".join(WRITERS))):
        if not ok(obj.get(key)):
            raise bad(f"{key} {obj.get(key)!r} is not {want}")
    fus, asked = obj.get("fusions"), obj.get("asked")
    if not isinstance(fus, dict):
        raise bad("no fusions object")
    if asked is not None and not isinstance(asked, dict):
        raise bad("asked is not an object")
    asked = {k: (asked or {}).get(k) for k in STATES}
    for k in STATES:
        if not isinstance(fus.get(k), dict) or fus[k].get("state") not in STATES[k]:
            raise bad(f"fusions.{k}.state is not one of {', '.join(STATES[k])}")
        if asked[k] is not None and not isinstance(asked[k], bool):
            raise bad(f"asked.{k} {asked[k]!r} is not true/false")
    states = {k: fus[k]["state"] for k in STATES}
    reasons = {k: " ".join(str(fus[k].get("reason", "")).split()) for k in STATES}
    return Record(obj["pid"], str(obj.get("process", "")), obj.get("tp_rank"), obj["layer_kind"],
                  obj["phase"], states, reasons, asked, where, order, obj, obj["writer"])


def parse_line(line: str) -> dict[str, Any] | None:
    """The record in one log line, or None (no marker, or not a record of this schema)."""
    at = line.find(MARKER)
    if at < 0:
        return None
    try:
        rec = json.loads(line[at + len(MARKER):])
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and rec.get("schema") == SCHEMA else None


def final_in_log(text: str, source: str = "log") -> dict[tuple[int, str], dict[str, Any]]:
    """Final raw record per (pid, layer kind) in a server log; lines that are not valid
    records are skipped (provenance and status are best effort)."""
    return {k: r.raw for k, r in final_decisions(records_from_log(text, source, False)).items()}


def records_from_log(text: str, source: str, strict: bool = True) -> list[Record]:
    """The records in a server log's marked lines; ``strict=False`` skips the invalid ones."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        i = line.find(MARKER)
        if i < 0:
            continue
        try:
            out.append(parse_record(json.loads(line[i + len(MARKER):]), f"{source} line {n}",
                                    len(out)))
        except ValueError as exc:  # not JSON (a malformed record is a UsageError)
            if strict:
                raise UsageError(f"decision record at {source} line {n} is not valid JSON "
                                 f"({exc.__class__.__name__}: {str(exc)[:80]})") from None
        except UsageError:
            if strict:
                raise
    return out


def decision_files(directory: str | Path) -> list[Path]:
    return sorted(p for p in Path(directory).rglob(FILE_GLOB)
                  if p.is_file() and _FILE_RE.match(p.name))


def records_from_files(files: list[Path]) -> list[Record]:
    out: list[Record] = []
    for f in files:
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"decision file {f} is not valid JSON ({exc.__class__.__name__}: "
                             f"{str(exc)[:80]})") from None
        if not isinstance(data, list):
            raise UsageError(f"decision file {f} must hold a JSON list of records")
        for i, obj in enumerate(data):
            out.append(parse_record(obj, f"{f.name}[{i}]", len(out)))
    return out


def final_decisions(records: list[Record]) -> dict[tuple[int, str], Record]:
    """Per (pid, layer_kind): the last record, ``load`` superseding ``construct``."""
    final: dict[tuple[int, str], Record] = {}
    for r in sorted(records, key=lambda r: (_PHASE[r.phase], r.order)):
        final[(r.pid, r.layer_kind)] = r
    return final


# The writer (the upstream hook's; the overlay has its own, byte-equal by a test). Runs in vLLM
# processes: vLLM imported lazily.

_log = logging.getLogger("vllm.k3rocm")  # a child of vLLM's logger: its handler and format


def _tp_rank() -> int | None:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - not initialized (unit construction), or no vLLM
        return None


def _vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:  # noqa: BLE001
        return "unknown"


def _process_name() -> str:
    try:
        import multiprocessing

        return multiprocessing.current_process().name
    except Exception:  # noqa: BLE001
        return "main"


class Writer:
    """One process's decision records: each distinct decision of a layer kind is written once,
    as a ``K3ROCM-DECISION {json}`` line (logger ``vllm.k3rocm``) and, when K3_PROFILER_DIR
    is set, into ``<K3_PROFILER_DIR>/k3rocm-decisions-pid<PID>.json`` (every record so far,
    replaced atomically)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self._seen: set[str] = set()

    def record(self, layer_kind: str, phase: str, fusions: dict[str, dict[str, str]],
               asked: dict[str, bool | None], **extra: Any) -> dict[str, Any] | None:
        """Write one record (None when this process already wrote the same decision);
        ``extra`` adds fields (``writer="upstream"``)."""
        key = json.dumps([layer_kind, phase, fusions], sort_keys=True)
        if key in self._seen:
            return None
        self._seen.add(key)
        rec = {"schema": SCHEMA, "pid": os.getpid(), "process": _process_name(),
               "tp_rank": _tp_rank(), "layer_kind": layer_kind, "phase": phase,
               "vllm_version": _vllm_version(), "fusions": fusions, "asked": asked, **extra}
        self.records.append(rec)
        _log.info(MARKER + json.dumps(rec, sort_keys=True))
        self._write_beside_traces()
        return rec

    def _write_beside_traces(self) -> None:
        out = os.environ.get("K3_PROFILER_DIR", "").strip()
        if not out:
            return
        try:
            write_text_atomic(Path(out) / FILE.format(pid=os.getpid()),
                              json.dumps(self.records, indent=1, sort_keys=True))
        except OSError as exc:  # the log line still carries the record
            _log.warning("k3rocm: cannot write decisions into %s (%s)", out, exc)
