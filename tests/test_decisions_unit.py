"""One rule for "the final decision" of an overlay process, whoever reads the records: the
status table, provenance and the census all go through ``serving.decisions`` (a ``load``
record supersedes a ``construct`` one whatever the line order)."""

from __future__ import annotations

import ast
import json
import os
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


# ------------------------------------- two writers of one format: the overlay's and k3rocm's

_OVERLAY_WRITER = ("DECISION_MARKER", "DECISION_SCHEMA", "DECISION_FILE", "_RECORDS", "_SEEN",
                   "_tp_rank", "_vllm_version", "_process_name", "_record_decision",
                   "_write_beside_traces", "FUSION_ENV", "_SwitchError", "_asked", "_layer_kind",
                   "_LAYER_INDEX")


class _Logger:
    def __init__(self):
        self.lines = []

    def info(self, msg, *args):
        self.lines.append(msg % args if args else msg)

    warning = info


def _overlay_writer(probe: dict, vllm_config=None) -> dict:
    """The overlay file's own writer (its real top-level code, taken from the file: it cannot
    be imported here, it imports vLLM and torch), with a logger and the probe result given."""
    import re
    import tempfile

    keep = []
    for node in _overlay_tree().body:
        name = (node.name if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else
                node.targets[0].id if isinstance(node, ast.Assign) and isinstance(
                    node.targets[0], ast.Name) else
                node.target.id if isinstance(node, ast.AnnAssign) else None)
        if name in _OVERLAY_WRITER:
            keep.append(node)
    ns = {"json": json, "os": os, "re": re, "sys": sys, "tempfile": tempfile, "Any": object,
          "logger": _Logger(), "_probe": lambda: probe, "_vllm_config": lambda: vllm_config}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(OVERLAY_FILE), "exec"), ns)
    return ns


def test_k3rocm_writer_writes_what_the_overlay_writes(tmp_path, monkeypatch, caplog):
    """Same inputs, same log line and same file, byte for byte (the upstream hook writes with
    k3rocm's writer; its only addition is ``writer: upstream``)."""
    import logging

    probe = {"qprep_kernel": {"found": True, "source": "s"},
             "dual_norm_op": {"found": True, "source": "d"}}
    overlay = _overlay_writer(probe)
    ours = decisions.Writer()
    construct = ("target", "construct", {"qk_norm": {"state": "on", "reason": "a"},
                                         "decode_qprep": {"state": "needs-model", "reason": "b"}},
                 {"qk_norm": True, "decode_qprep": True})
    calls = [construct, construct,  # the same again: logged once
             ("draft", "load", {"qk_norm": {"state": "off", "reason": "K3_FUSE_QK_NORM=0"},
                                "decode_qprep": {"state": "unknown", "reason": "c"}},
              {"qk_norm": False, "decode_qprep": None})]
    for d in ("overlay", "k3rocm"):
        monkeypatch.setenv("K3_PROFILER_DIR", str(tmp_path / d))
        with caplog.at_level(logging.INFO, logger="vllm.k3rocm"):
            for c in calls:
                if d == "overlay":
                    overlay["_record_decision"](*c)
                else:
                    ours.record(*c, probe=probe)
    assert len(overlay["logger"].lines) == 2 and overlay["logger"].lines == caplog.messages
    name = decisions.FILE.format(pid=os.getpid())
    assert [p.name for p in (tmp_path / "overlay").iterdir()] == [name]
    assert [p.name for p in (tmp_path / "k3rocm").iterdir()] == [name]
    assert (tmp_path / "overlay" / name).read_bytes() == (tmp_path / "k3rocm" / name).read_bytes()
    for rec in json.loads((tmp_path / "k3rocm" / name).read_text()):
        decisions.parse_record(rec, "file")


def test_the_hook_reads_switches_and_layer_kinds_as_the_overlay_does(monkeypatch):
    from types import SimpleNamespace

    from k3rocm.serving import upstream_hook

    cfg = SimpleNamespace(model_config=SimpleNamespace(
        hf_text_config=SimpleNamespace(num_hidden_layers=4)))
    overlay = _overlay_writer({}, cfg)
    for raw in ("", "1", "0", " On ", "TRUE", "no", "off", "false", "yes", "maybe", "2", "o n"):
        monkeypatch.setenv("K3_FUSE_QK_NORM", raw)
        want, bad = upstream_hook.asked("K3_FUSE_QK_NORM")
        try:
            theirs = overlay["_asked"]("qk_norm")
        except ValueError as exc:
            assert want is None and bad == str(exc), raw
        else:
            assert want is theirs and bad == "", raw
    import types

    fake = types.ModuleType("vllm.config")
    fake.get_current_vllm_config = lambda: cfg
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.config", fake)
    for name in ("model.layers.3.self_attn.attn", "model.layers.4.self_attn.attn",
                 "model.mtp.0.attn", "attn", "language_model.model.layers.12.self_attn.mla_attn"):
        assert upstream_hook._layer_kind(name) == overlay["_layer_kind"](name), name
