"""One fusion table (k3rocm.serving.fusions): every k3rocm list of the fusions derives from it,
and it agrees with the names the overlay reads and writes by itself."""

from __future__ import annotations

import argparse
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


def test_k3rocm_lists_derive_from_the_table():
    from k3rocm.checks import selftest
    from k3rocm.checks.ab import arms
    from k3rocm.checks.census import fusions as claim
    from k3rocm.checks.census import spec
    from k3rocm.serving import decisions
    from k3rocm.serving.settings import FIELDS

    for f in FUSIONS:
        fi = FIELDS[f.field]
        assert fi.json_schema_extra == {"env": f.env, "group": "overlay"}
        assert fi.default is f.default and fi.description == f.doc and fi.annotation is bool
    assert claim.ENV == ENV and claim.FUSIONS == NAMES
    assert {f.name: f.states for f in FUSIONS} == decisions.STATES
    assert {f.name: f.roles for f in FUSIONS} == spec.GROUPS
    off = {f.env: "0" for f in FUSIONS}
    gpu = argparse.Namespace(cpu=False)
    assert arms.FUSIONS_OFF == arms.arm_envs()["A"] == selftest.arms("all", gpu)["A"] == off
    assert selftest.arms("all", gpu)["B"] == arms.arm_envs()["B"] == arms.FUSIONS_ON
    assert {f.env: "1" for f in FUSIONS} == arms.FUSIONS_ON
    assert {f.env: f.name for f in FUSIONS} == arms.FUSION_OF
    # the census's kernel table names exactly the table's roles, on every platform
    for plat in spec.kernel_table()["platforms"].values():
        assert set(plat["roles"]) == set(spec.ROLES)


def test_render_and_the_claim_follow_the_table():
    from k3rocm.checks.census.fusions import from_cli, from_env
    from k3rocm.serving.config import render

    env = {"K3_PROFILE": "cpu-smoke", **{f.env: "0" for f in FUSIONS[:1]}}
    r = render(env, dotenv=None, check_model=False)
    want = {f.env: "0" if i == 0 else ("1" if f.default else "0")
            for i, f in enumerate(FUSIONS)}
    assert {k: r.env[k] for k in want} == want
    assert from_env(r.env, "x").asked == {f.name: want[f.env] == "1" for f in FUSIONS}
    assert from_cli("all=off").asked == dict.fromkeys(NAMES, False)


THIRD = r"""
import argparse
import json
from k3rocm.serving import fusions
extra = fusions.Fusion(name="kv_thing", env="K3_FUSE_KV_THING", default=False,
                       doc="Overlay: a third fusion (1/0).", label="kv thing",
                       states=("on", "off"), fused=("fused_kv_thing",), stock=(),
                       op="fused_kv_thing")
fusions.FUSIONS = (*fusions.FUSIONS, extra)
fusions.NAMES = tuple(f.name for f in fusions.FUSIONS)
fusions.BY_NAME = {f.name: f for f in fusions.FUSIONS}
fusions.ENV = {f.name: f.env for f in fusions.FUSIONS}
fusions.NAME_OF_ENV = {f.env: f.name for f in fusions.FUSIONS}
from k3rocm.serving.config import render
from k3rocm.serving.settings import FIELDS
from k3rocm.serving import decisions
from k3rocm.checks.ab import arms
from k3rocm.checks.census import fusions as claim, spec
from k3rocm.checks import selftest
r = render({"K3_PROFILE": "cpu-smoke", "K3_FUSE_KV_THING": "1"}, dotenv=None,
           check_model=False)
print(json.dumps({
    "field": FIELDS["fuse_kv_thing"].json_schema_extra, "env": r.env["K3_FUSE_KV_THING"],
    "source": r.sources["K3_FUSE_KV_THING"], "states": decisions.STATES["kv_thing"],
    "arms_off": arms.arm_envs()["A"].get("K3_FUSE_KV_THING"), "selftest_off":
    selftest.arms("all", argparse.Namespace(cpu=False))["A"].get("K3_FUSE_KV_THING"),
    "arms_on": arms.arm_envs("all")["B"].get("K3_FUSE_KV_THING"),
    "claim": claim.from_env({}, "x").asked,
    "roles": list(spec.GROUPS["kv_thing"])}))
"""


def test_a_third_row_reaches_every_derived_list():
    """What adding a fusion to the table alone gives (compose.yaml's list aside, which a test
    checks against the settings): a setting, its rendering, the decision-record reader, the
    claim, the census roles and the A/B and selftest off switches."""
    p = subprocess.run([sys.executable, "-c", THIRD], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    assert got == {
        "field": {"env": "K3_FUSE_KV_THING", "group": "overlay"}, "env": "1",
        "source": "env", "states": ["on", "off"], "arms_off": "0", "selftest_off": "0",
        "arms_on": "1",
        "claim": {"qk_norm": True, "decode_qprep": True, "kv_thing": False},
        "roles": ["fused_kv_thing"]}
