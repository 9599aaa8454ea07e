"""The decision records (overlay's or upstream hook's) cross-checked against the claim (target
layers judged, draft reported): asked on but not on, asked off but on, or a record that read
another toggle: FAIL; state unknown: cannot judge; no record in a found source while asked on:
FAIL; no source at all: not cross-checked, never a FAIL.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from k3rocm.checks.census.expect import Check
from k3rocm.checks.census.fusions import FusionClaim
from k3rocm.serving.decisions import Record, final_decisions
from k3rocm.serving.fusions import NAMES


@dataclass
class Decisions:
    records: list[Record]
    source: str  # where read (found=False: where looked for)
    found: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "found": self.found, "count": len(self.records),
                "final": [{k: v for k, v in asdict(r).items() if k not in ("order", "raw")}
                          for r in final_decisions(self.records).values()]}


def _on(b: bool) -> str:
    return "ON" if b else "OFF"


def _writers(records: list[Record]) -> str:
    names = {"overlay": "the overlay", "upstream": "the upstream hook"}
    return " and ".join(names[w] for w in sorted({r.writer for r in records}))


def cross_check(claim: FusionClaim, dec: Decisions | None) -> list[Check]:
    """One row per fusion (target layers), draft rows reported only; ``dec`` None:
    --skip-records."""
    if dec is None or not dec.found:
        why = ("SKIPPED on request (--skip-records): the overlay's own decisions were not "
               "cross-checked" if dec is None else f"NOT CROSS-CHECKED: no records found "
               f"(looked in {dec.source}); pass --server-log FILE or --skip-records")
        return [Check("all", f"overlay decision records vs asked {k} {_on(claim.asked[k])}",
                      "records", "records", why, None, 0, None) for k in NAMES]
    rows: list[Check] = []
    final = final_decisions(dec.records)
    target = [r for (_, kind), r in final.items() if kind == "target"]
    draft = [r for (_, kind), r in final.items() if kind == "draft"]
    n = len(target)
    for k in NAMES:
        asked = claim.asked[k]
        what = f"{k} asked {_on(asked)} ({claim.detail.get(k, claim.source)})"

        def row(rule: str, expected: int | None, seen: int, ok: bool | None,
                what: str = what, k: str = k) -> None:
            rows.append(Check("all", what, "records", "records", rule, expected, seen, ok, k))

        unknown = [r for r in target if r.states[k] == "unknown"]
        wrong = [r for r in target if r.states[k] != "unknown" and (r.states[k] == "on") != asked]
        misread = [r for r in target if r.asked[k] is not None and r.asked[k] != asked]
        if not target:
            row(f"the overlay did not run (nor the upstream hook): no decision record for "
                f"target layers in {dec.source} while {k} was asked ON" if asked else
                f"no decision record in {dec.source}; the fusion was asked OFF, the stock "
                "path is what was asked for", int(asked), 0, not asked)
            continue
        if wrong:
            r = wrong[0]
            verb = "reported" if asked else "reported ON although asked OFF:"
            row(f"{len(wrong)} of {n} target process(es) {verb} {r.states[k].upper()} "
                f"({r.label()}, written by {_writers([r])}, {r.phase}: {r.reasons[k]!r}) "
                f"[{r.where}]", n, n - len(wrong), False)
        elif unknown:
            r = unknown[0]
            why = (f"{len(unknown)} of {n} target process(es) report {k} UNKNOWN "
                   f"({r.label()}, written by {_writers([r])}, {r.phase}: {r.reasons[k]!r}) "
                   f"[{r.where}]: whether the fusion ran is not known")
            rows.append(Check("all", what, "records", "records", why, n, n - len(unknown),
                              None, k, why))
        elif misread:
            r = misread[0]
            row(f"{r.label()} read the toggle as {_on(bool(r.asked[k]))}, not what the claim "
                f"says [{r.where}]", n, n - len(misread), False)
        else:
            row(f"every target process ({n}, written by {_writers(target)}) reports "
                f"{_on(asked)} ({target[0].reasons[k]})", n, n, True)
        rows.extend(Check("all", f"{k} in draft layers", "records", "records",
                          f"reported only: {r.label()} {r.states[k].upper()} ({r.reasons[k]})",
                          None, int(r.states[k] == "on"), None) for r in draft)
    return rows
