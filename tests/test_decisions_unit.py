"""One rule for "the final decision" of an overlay process, whoever reads the records: the
status table, provenance and the census all go through ``serving.decisions`` (a ``load``
record supersedes a ``construct`` one whatever the line order)."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

from k3rocm.deploy.scale.status import parse_decisions
from k3rocm.serving import decisions
from k3rocm.serving.decisions import MARKER as DECISION_MARKER
from k3rocm.serving.decisions import SCHEMA as DECISION_SCHEMA
from k3rocm.serving.decisions import final_in_log


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


# ------------------------------------------------ the overlay file stands alone, k3rocm reads it

OVERLAY_FILE = Path(__file__).resolve().parents[1] / "overlay/vllm/models/kimi_k3/amd/mla.py"


def _overlay_tree() -> ast.Module:
    return ast.parse(OVERLAY_FILE.read_text(encoding="utf-8"))


def test_overlay_imports_only_vllm_torch_aiter_and_the_standard_library():
    """As its upstream twin (vLLM 0.33 amd/mla.py), the file can be mounted by itself: every
    import, also the lazy ones inside functions (AITER's, as upstream does), is vLLM, torch,
    AITER or the standard library; nothing of k3rocm."""
    allowed = {"vllm", "torch", "aiter"} | set(sys.stdlib_module_names)
    found = set()
    for node in ast.walk(_overlay_tree()):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "relative import"
            found.add(str(node.module).split(".")[0])
    assert found and found <= allowed, sorted(found - allowed)


def test_decision_format_constants_agree_with_the_overlay():
    """k3rocm's reader keeps copies of the format the overlay writes: held equal here."""
    consts = {}
    for node in _overlay_tree().body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(
                node.targets[0], ast.Name):
            try:
                consts[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    assert consts["DECISION_SCHEMA"] == decisions.SCHEMA
    assert consts["DECISION_MARKER"] == decisions.MARKER
    assert consts["DECISION_FILE"] == decisions.FILE
    assert decisions._FILE_RE.match(consts["DECISION_FILE"].format(pid=123))
    assert set(consts["FUSION_ENV"]) == set(decisions.STATES)
