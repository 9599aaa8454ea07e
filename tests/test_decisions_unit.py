"""One rule for "the final decision" of an overlay process, whoever reads the records: the
status table, provenance and the census all go through ``serving.decisions`` (a ``load``
record supersedes a ``construct`` one whatever the line order)."""

from __future__ import annotations

import json

from k3rocm.deploy.scale.status import parse_decisions
from k3rocm.serving.decisions import final_in_log
from k3rocm.serving.overlay_runtime import DECISION_MARKER, DECISION_SCHEMA


def rec(phase: str, state: str, pid: int = 7) -> str:
    r = {"schema": DECISION_SCHEMA, "pid": pid, "tp_rank": 0, "layer_kind": "target",
         "phase": phase, "asked": {"qk_norm": True, "decode_qprep": True},
         "fusions": {"qk_norm": {"state": "on", "reason": "x"},
                     "decode_qprep": {"state": state, "reason": "y"}}}
    return f"(EngineCore pid={pid}) INFO k3rocm {DECISION_MARKER}{json.dumps(r)}"


def test_load_supersedes_construct_whatever_the_line_order():
    log = "\n".join([rec("load", "on"), rec("construct", "needs-model"), "noise",
                     DECISION_MARKER + "{not json", rec("construct", "needs-model", pid=8)])
    for final in (final_in_log(log), parse_decisions(log)):
        assert final[(7, "target")]["phase"] == "load"
        assert final[(7, "target")]["fusions"]["decode_qprep"]["state"] == "on"
        assert final[(8, "target")]["phase"] == "construct"
