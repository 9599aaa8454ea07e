"""The overlay's decision records (/work format ``k3rocm.overlay.decision/1``, docs/census.md)
and their cross-check against what the server was asked for.

Sources: ``k3rocm-decisions-pid<PID>.json`` files (a JSON list per process, written beside the
profiler traces when K3_PROFILER_DIR is set), else ``K3ROCM-DECISION {json}`` lines in the
server log. The final decision of a (pid, layer_kind) is its last record, a ``load`` record
superseding a ``construct`` one.

Rules (target layers judged, draft layers reported):
- asked ON, final state not "on"  -> FAIL, with the overlay's reason
- asked OFF, final state "on"      -> FAIL
- the process read a different toggle than the claim says (record ``asked``) -> FAIL
- no record at all while a fusion is asked ON -> FAIL ("the overlay did not run")
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3rocm.census.expect import Check
from k3rocm.census.fusions import FUSIONS, FusionClaim
from k3rocm.errors import UsageError
from k3rocm.overlay_runtime import DECISION_FILE, DECISION_MARKER, DECISION_SCHEMA

SCHEMA = DECISION_SCHEMA
MARKER = DECISION_MARKER
FILE_GLOB = DECISION_FILE.format(pid="*")
STATES = {"qk_norm": ("on", "off"), "decode_qprep": ("on", "off", "needs-model")}
_PHASE = {"construct": 0, "load": 1}
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
    if obj.get("schema") != SCHEMA:
        raise bad(f"schema {obj.get('schema')!r} is not {SCHEMA!r}")
    pid = obj.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool):
        raise bad(f"pid {pid!r} is not an integer")
    tp = obj.get("tp_rank")
    if tp is not None and (not isinstance(tp, int) or isinstance(tp, bool)):
        raise bad(f"tp_rank {tp!r} is not an integer or null")
    kind = obj.get("layer_kind")
    if kind not in ("target", "draft"):
        raise bad(f"layer_kind {kind!r} is not target or draft")
    phase = obj.get("phase")
    if phase not in _PHASE:
        raise bad(f"phase {phase!r} is not construct or load")
    fus = obj.get("fusions")
    if not isinstance(fus, dict):
        raise bad("no fusions object")
    states, reasons = {}, {}
    for k in FUSIONS:
        f = fus.get(k)
        if not isinstance(f, dict) or f.get("state") not in STATES[k]:
            raise bad(f"fusions.{k}.state is not one of {', '.join(STATES[k])}")
        states[k] = f["state"]
        reasons[k] = " ".join(str(f.get("reason", "")).split())
    asked_obj = obj.get("asked")
    if asked_obj is not None and not isinstance(asked_obj, dict):
        raise bad("asked is not an object")
    asked: dict[str, bool | None] = {}
    for k in FUSIONS:
        v = (asked_obj or {}).get(k)
        if v is not None and not isinstance(v, bool):
            raise bad(f"asked.{k} {v!r} is not true/false")
        asked[k] = v
    return Record(pid, str(obj.get("process", "")), tp, kind, phase, states, reasons, asked,
                  where, order, obj)


def records_from_log(text: str, source: str) -> list[Record]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        i = line.find(MARKER)
        if i < 0:
            continue
        payload = line[i + len(MARKER):].strip()
        try:
            obj = json.loads(payload)
        except ValueError as exc:
            raise UsageError(f"decision record at {source} line {n} is not valid JSON "
                             f"({exc.__class__.__name__}: {str(exc)[:80]})") from None
        out.append(parse_record(obj, f"{source} line {n}", len(out)))
    return out


def decision_files(directory: str | Path) -> list[Path]:
    d = Path(directory)
    return sorted(p for p in d.rglob(FILE_GLOB) if p.is_file() and _FILE_RE.match(p.name))


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


@dataclass
class Decisions:
    records: list[Record]
    source: str  # where they were read from ("none" when there were none)

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "count": len(self.records),
                "final": [{"pid": r.pid, "process": r.process, "tp_rank": r.tp_rank,
                           "layer_kind": r.layer_kind, "phase": r.phase, "states": r.states,
                           "reasons": r.reasons, "asked": r.asked, "where": r.where}
                          for r in final_decisions(self.records).values()]}


def _on(b: bool) -> str:
    return "ON" if b else "OFF"


def cross_check(claim: FusionClaim, dec: Decisions | None) -> list[Check]:
    """One row per fusion (target layers), plus draft rows reported only.
    ``dec`` None = the cross-check was skipped on request (--skip-records)."""
    rows: list[Check] = []
    if dec is None:
        for k in FUSIONS:
            rows.append(Check("all", f"overlay decision records vs asked {k} "
                              f"{_on(claim.get(k))}", "records", "records",
                              "SKIPPED on request (--skip-records): the overlay's own "
                              "decisions were not cross-checked", None, 0, None))
        return rows
    final = final_decisions(dec.records)
    target = [r for (_, kind), r in final.items() if kind == "target"]
    draft = [r for (_, kind), r in final.items() if kind == "draft"]
    for k in FUSIONS:
        asked = claim.get(k)
        what = f"{k} asked {_on(asked)} ({claim.detail.get(k, claim.source)})"
        if not target:
            if asked:
                rule = (f"the overlay did not run: no decision record for target layers in "
                        f"{dec.source} while {k} was asked ON")
                rows.append(Check("all", what, "records", "records", rule, 1, 0, False))
            else:
                rows.append(Check("all", what, "records", "records",
                                  f"no decision record in {dec.source}; the fusion was asked "
                                  "OFF, the stock path is what was asked for", 0, 0, True))
            continue
        wrong = [r for r in target if (r.states[k] == "on") != asked]
        misread = [r for r in target if r.asked[k] is not None and r.asked[k] != asked]
        if wrong:
            r = wrong[0]
            verb = "reported" if asked else "reported ON although asked OFF:"
            rule = (f"{len(wrong)} of {len(target)} target process(es) {verb} "
                    f"{r.states[k].upper()} ({r.label()}, {r.phase}: {r.reasons[k]!r}) "
                    f"[{r.where}]")
            rows.append(Check("all", what, "records", "records", rule, len(target),
                              len(target) - len(wrong), False))
        elif misread:
            r = misread[0]
            rows.append(Check("all", what, "records", "records",
                              f"{r.label()} read the toggle as {_on(bool(r.asked[k]))}, not "
                              f"what the claim says [{r.where}]", len(target),
                              len(target) - len(misread), False))
        else:
            rows.append(Check("all", what, "records", "records",
                              f"every target process ({len(target)}) reports {_on(asked)} "
                              f"({target[0].reasons[k]})", len(target), len(target), True))
        for r in draft:
            rows.append(Check("all", f"{k} in draft layers", "records", "records",
                              f"reported only: {r.label()} {r.states[k].upper()} "
                              f"({r.reasons[k]})", None, 1 if r.states[k] == "on" else 0,
                              None))
    return rows
