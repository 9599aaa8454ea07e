"""One fusion table (k3rocm.serving.fusions): every k3rocm list of the fusions derives from it,
and it agrees with the names the overlay reads and writes by itself."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys

from conftest import REPO

from k3rocm.serving import fusions
from k3rocm.serving.fusions import ENV, FUSIONS, NAMES

OVERLAY_SOURCES = sorted((REPO / "overlay").rglob("*.py"))  # the overlay stands alone


def _overlay_text() -> str:
    return "\n".join(p.read_text() for p in OVERLAY_SOURCES if p.is_file())


def _overlay_trees() -> list[ast.Module]:
    return [ast.parse(p.read_text()) for p in OVERLAY_SOURCES if p.is_file()]


def test_the_overlay_reads_and_writes_the_tables_names():
    """The overlay (mla.py, which carries its own toggles and records) reads exactly the table's
    switches and writes decision records under exactly the table's fusion names (read from
    its source, so the check holds wherever the overlay keeps them)."""
    text = _overlay_text()
    assert set(re.findall(r"\bK3_FUSE_[A-Z0-9_]+", text)) == set(ENV.values())
    tables, written = [], set()
    for tree in _overlay_trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "FUSION_ENV" for t in node.targets):
                tables.append(ast.literal_eval(node.value))
            # a decision record's fusions: {"<fusion>": {"state": ..., "reason": ...}, ...}
            if isinstance(node, ast.Dict):
                for k, v in zip(node.keys, node.values, strict=True):
                    if isinstance(k, ast.Constant) and isinstance(v, ast.Dict) and any(
                            isinstance(vk, ast.Constant) and vk.value == "state"
                            for vk in v.keys):
                        written.add(k.value)
    # the overlay's own name -> switch table (FUSION_ENV), wherever it lives
    assert tables, "no FUSION_ENV = {...} table in the overlay's sources"
    assert all(t == ENV for t in tables), tables
    assert written == set(NAMES), written


def test_the_overlay_states_are_the_tables():
    """Every state literal the overlay gives a fusion is one the reader accepts for it."""
    text = _overlay_text()
    states = set(re.findall(r'"(on|off|needs-model)"', text))
    assert states <= {s for f in FUSIONS for s in f.states}
    assert "needs-model" in fusions.BY_NAME["decode_qprep"].states
    assert "needs-model" not in fusions.BY_NAME["qk_norm"].states


THIRD = r"""
import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

from k3rocm.serving import fusions

tmp, data = Path(sys.argv[1]), Path(sys.argv[2])
# The third row: the q/kv RMSNorm fusion again under a new name and switch (default off).
extra = fusions.Fusion(name="kv_thing", env="K3_FUSE_KV_THING", default=False,
                       doc="Overlay: a third fusion (1/0).", label="kv thing",
                       states=("on", "off"), fused=("fused_kv_thing",), stock=("kv_thing",),
                       op="fused_kv_thing")
fusions.FUSIONS = (*fusions.FUSIONS, extra)
fusions.NAMES = tuple(f.name for f in fusions.FUSIONS)
fusions.BY_NAME = {f.name: f for f in fusions.FUSIONS}
fusions.ENV = {f.name: f.env for f in fusions.FUSIONS}
fusions.NAME_OF_ENV = {f.env: f.name for f in fusions.FUSIONS}

# Its kernels.json entries (the q/kv norm's kernel names and counts), in a copy of the table.
from k3rocm.checks.census import spec

table = spec.kernel_table()
for plat in table["platforms"].values():
    plat["roles"]["fused_kv_thing"] = plat["roles"]["fused_qk_norm"]
    plat["roles"]["kv_thing"] = plat["roles"]["qk_norm"]
exp = table["expect"]
exp["fused_kv_thing"] = {**exp["fused_qk_norm"], "label": "fused kv thing"}
exp["kv_thing"] = {**exp["qk_norm"], "label": "stock kv thing",
                   "beside": {**exp["qk_norm"]["beside"], "fused": "fused_kv_thing"}}
(tmp / "kernels.json").write_text(json.dumps(table))
spec.kernel_table = lambda: json.loads((tmp / "kernels.json").read_text())

# Nothing else changes: every answer below comes from the code as it is.
from k3rocm.checks import selftest, steps
from k3rocm.checks.ab import arms
from k3rocm.checks.census import fusions as claim
from k3rocm.cli import main
from k3rocm.deploy.config_cmd import settings_table
from k3rocm.errors import UsageError
from k3rocm.serving import decisions, upstream_hook
from k3rocm.serving.config import render
from k3rocm.serving.settings import FIELDS

kimi = str(data / "models" / "kimi-k3")


def cli(*argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(list(argv))
    return code, out.getvalue()


def census(fusions, name):
    code, _ = cli("census", "--trace-dir", str(data / "k3-anchor-on"), "--model-dir", kimi,
                  "--fusions", fusions, "--skip-records", "--results", str(tmp / name))
    run = next((tmp / name).glob("*-census"))
    c = json.loads((run / "census.json").read_text())
    return code, run, {k["fusion"]: k["status"] for k in c["checks"]
                       if k["scope"] == "fusion" and k["rank"] == 0}


r = render({"K3_PROFILE": "cpu-smoke", "K3_FUSE_KV_THING": "1"}, dotenv=None,
           check_model=False)
got = {"field": FIELDS["fuse_kv_thing"].json_schema_extra, "env": r.env["K3_FUSE_KV_THING"],
       "default": render({"K3_PROFILE": "cpu-smoke"}, dotenv=None,
                         check_model=False).env["K3_FUSE_KV_THING"],
       "readme": [ln for ln in settings_table().splitlines() if "K3_FUSE_KV_THING" in ln]}
try:
    render({"K3_PROFILE": "cpu-smoke", "K3_FUSE_KV_THING": "maybe"}, dotenv=None,
           check_model=False)
except UsageError as exc:
    got["bad"] = str(exc)
got["states"] = decisions.STATES["kv_thing"]
got["hook"] = upstream_hook.asked("K3_FUSE_KV_THING")
got["claim_env"] = claim.from_env({"K3_FUSE_KV_THING": "on"}, "x").asked
got["claim_unset"] = claim.from_env({}, "x").asked["kv_thing"]
code, run, got["on"] = census("qk_norm=on,decode_qprep=on,kv_thing=on", "on")
got["on_code"] = code
got["selftest_numbers"] = sorted(steps.census_numbers(steps.read_json(run / "census.json"))[1])
got["off_code"], _, got["off"] = census("qk_norm=on,decode_qprep=on,kv_thing=off", "off")
got["unset"] = cli("census", "--trace-dir", str(data / "k3-anchor-on"), "--model-dir", kimi,
                   "--fusions", "qk_norm=on,decode_qprep=on", "--skip-records")
got["ab_code"], _ = cli("census-ab", "--trace-dirs",
                        f"{data / 'k3-anchor-off'},{data / 'k3-anchor-on'}", "--model-dir",
                        kimi, "--skip-records", "--results", str(tmp / "ab"))
ab = json.loads(next((tmp / "ab").glob("*-census-ab/ab.json")).read_text())
got["ab_rows"] = [[r["fusion"], r["off_stock"], r["on_stock"], r["on_fused"]]
                  for r in ab["comparison"]["rows"] if r["rank"] == 0]
got["ab_checks"] = [[c["role"], c["expected"], c["seen"], c["status"]]
                    for c in ab["comparison"]["checks"] if c["rank"] == 0]
got["arm_on"] = arms.arm_envs("kv_thing")["B"]
got["selftest"] = selftest.arms("all", argparse.Namespace(cpu=False))
got["ab"] = arms.arm_envs()
print(json.dumps(got))
"""


def test_a_third_fusion_is_one_row(tmp_path):
    """A fusion is one row: a third row in the fusion table (here the q/kv RMSNorm fusion again
    under another name and switch) and its roles in a copy of kernels.json, and nothing else
    changed, give its setting (accepted, validated, rendered, in the README table), its
    decision-record states and the hook's reading of its switch, the census claim and
    ``--fusions`` parser, the census expectation of both halves (PASS asked on, FAIL asked
    off on the same traces), the census-ab row and off - on check, the A/B and selftest arm
    switches and the selftest's census numbers."""
    p = subprocess.run([sys.executable, "-c", THIRD, str(tmp_path), str(REPO / "tests" / "data"
                                                                         / "census")],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.splitlines()[-1])
    assert got["field"] == {"env": "K3_FUSE_KV_THING", "group": "overlay"}
    assert (got["env"], got["default"]) == ("1", "0")
    assert got["readme"] and "a third fusion" in got["readme"][0]
    assert "K3_FUSE_KV_THING='maybe' is not valid: use 1 or 0" in got["bad"]
    assert got["states"] == ["on", "off"] and got["hook"] == [False, ""]
    assert got["claim_env"] == {"qk_norm": True, "decode_qprep": True, "kv_thing": True}
    assert got["claim_unset"] is False  # the row's default
    assert got["on_code"] == 0
    assert got["on"] == {"qk_norm": "ok", "decode_qprep": "ok", "kv_thing": "ok"}
    assert {"fused_kv_thing", "kv_thing"} <= set(got["selftest_numbers"])
    assert got["off_code"] == 1  # the traces ran it: asked off, its fused half fails
    assert got["off"] == {"qk_norm": "ok", "decode_qprep": "ok", "kv_thing": "FAIL"}
    code, out = got["unset"]
    assert code == 2 and "leaves kv_thing unset" in out
    assert got["ab_code"] == 0
    assert got["ab_rows"] == [["qk_norm", 288, 0, 144], ["decode_qprep", 288, 0, 144],
                              ["kv_thing", 288, 0, 144]]
    assert got["ab_checks"] == [["qk_norm", 288, 288, "ok"], ["kv_thing", 288, 288, "ok"]]
    assert got["arm_on"] == {"K3_FUSE_QK_NORM": "0", "K3_FUSE_DECODE_QPREP": "0",
                             "K3_FUSE_KV_THING": "1"}
    off = {"K3_FUSE_QK_NORM": "0", "K3_FUSE_DECODE_QPREP": "0", "K3_FUSE_KV_THING": "0"}
    on = dict.fromkeys(off, "1")
    assert got["selftest"] == got["ab"] == {"A": off, "B": on}
