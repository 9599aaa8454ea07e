"""The claim and its cross-check against the decision records (docs/census.md)."""

from __future__ import annotations

import json
import shutil

import pytest
from census_helpers import DATA, TINY, run_cli

from k3rocm.checks.census.decisions import Decisions, cross_check
from k3rocm.checks.census.fusions import from_cli, from_env
from k3rocm.errors import UsageError
from k3rocm.serving.decisions import (
    final_decisions,
    parse_record,
    records_from_files,
    records_from_log,
)

REC = DATA / "records"


def rows(claim, dec):
    return {c.what.split(" (")[0]: c for c in cross_check(claim, dec)}


def log(name: str) -> Decisions:
    return Decisions(records_from_log((REC / name).read_text(), name), name)


def test_claim_from_env_default_on_and_explicit_off():
    c = from_env({}, "env")
    assert c.asked == {"qk_norm": True, "decode_qprep": True}
    assert "unset" in c.detail["qk_norm"] and "default on" in c.detail["qk_norm"]
    c = from_env({"K3_FUSE_QK_NORM": "0", "K3_FUSE_DECODE_QPREP": " "}, "env")
    assert c.asked == {"qk_norm": False, "decode_qprep": True}
    assert c.detail["qk_norm"] == "K3_FUSE_QK_NORM=0 in env"
    with pytest.raises(UsageError, match="is not a switch"):
        from_env({"K3_FUSE_QK_NORM": "maybe"}, "env")
    c = from_cli("qk_norm=on,decode_qprep=off")
    assert (c.asked, c.source) == ({"qk_norm": True, "decode_qprep": False}, "--fusions")


def test_log_records_with_vllm_prefix_load_supersedes_construct():
    dec = log("server-on.log")
    assert len(dec.records) == 6
    final = final_decisions(dec.records)
    assert {k for k in final} == {(5000, "target"), (5001, "target"), (5000, "draft"),
                                  (5001, "draft")}
    assert final[(5000, "target")].phase == "load"
    assert final[(5000, "target")].states == {"qk_norm": "on", "decode_qprep": "on"}


def test_asked_on_reported_on_passes_draft_reported_only():
    r = rows(from_cli("all=on"), log("server-on.log"))
    assert r["qk_norm asked ON"].ok is True and r["decode_qprep asked ON"].ok is True
    # the draft layers kept the stock Q-prep: reported, not judged
    draft = [c for c in cross_check(from_cli("all=on"), log("server-on.log"))
             if "draft" in c.what]
    assert draft and all(c.ok is None for c in draft)
    assert any("OFF" in c.rule and "MTP block" in c.rule for c in draft)


def test_asked_on_reported_off_fails_with_the_overlays_reason():
    r = rows(from_cli("all=on"), log("server-qprep-off-after-load.log"))
    bad = r["decode_qprep asked ON"]
    assert bad.ok is False and (bad.expected, bad.seen) == (2, 0)
    assert "backend wants a bf16 query" in bad.rule and "load" in bad.rule
    assert r["qk_norm asked ON"].ok is True


def test_asked_off_reported_on_fails():
    r = rows(from_cli("qk_norm=off,decode_qprep=on"), log("server-on.log"))
    bad = r["qk_norm asked OFF"]
    assert bad.ok is False and "reported ON although asked OFF" in bad.rule


def test_missing_records_fail_only_when_asked_on():
    stock = log("server-stock.log")
    r = rows(from_cli("qk_norm=on,decode_qprep=off"), stock)
    assert r["qk_norm asked ON"].ok is False
    assert "the overlay did not run" in r["qk_norm asked ON"].rule
    assert r["decode_qprep asked OFF"].ok is True
    assert all(c.ok for c in cross_check(from_cli("all=off"), stock))


def test_process_that_read_another_toggle_fails(tmp_path):
    recs = json.loads((DATA / "rocm-off" / "k3rocm-decisions-pid5000.json").read_text())
    for rec in recs:
        rec["asked"]["qk_norm"] = True
    f = tmp_path / "k3rocm-decisions-pid5000.json"
    f.write_text(json.dumps(recs))
    r = rows(from_cli("all=off"), Decisions(records_from_files([f]), "x"))
    assert r["qk_norm asked OFF"].ok is False and "read the toggle as ON" in \
        r["qk_norm asked OFF"].rule
    assert r["decode_qprep asked OFF"].ok is True


def test_skip_records_is_visible_not_silent():
    out = cross_check(from_cli("all=on"), None)
    assert len(out) == 2 and all(c.ok is None and "SKIPPED" in c.rule for c in out)


@pytest.mark.parametrize("mutate,msg", [
    (lambda r: r.update(schema="k3rocm.overlay.decision/0"), "schema"),
    (lambda r: r.update(pid="5000"), "pid"),
    (lambda r: r.update(layer_kind="mtp"), "layer_kind"),
    (lambda r: r.update(phase="start"), "phase"),
    (lambda r: r["fusions"]["qk_norm"].update(state="ON"), "fusions.qk_norm.state"),
    (lambda r: r["fusions"].pop("decode_qprep"), "fusions.decode_qprep.state"),
    (lambda r: r["asked"].update(qk_norm="yes"), "asked.qk_norm"),
])
def test_malformed_records_are_usage_errors(mutate, msg):
    rec = json.loads((DATA / "rocm-on" / "k3rocm-decisions-pid5000.json").read_text())[-1]
    mutate(rec)
    with pytest.raises(UsageError, match=msg):
        parse_record(rec, "test")


def test_malformed_record_sources(tmp_path):
    with pytest.raises(UsageError, match="line 1 is not valid JSON"):
        log("server-bad-json.log")
    f = tmp_path / "k3rocm-decisions-pid1.json"
    f.write_text("{")
    with pytest.raises(UsageError, match="not valid JSON"):
        records_from_files([f])
    f.write_text("{}")
    with pytest.raises(UsageError, match="must hold a JSON list"):
        records_from_files([f])


# -- through the command line ---------------------------------------------------------------

def census(*args: str, tmp_path):
    return run_cli("census", "--model-dir", str(TINY), "--results", str(tmp_path), *args)


def test_cli_asked_on_reported_off_exit_1_prints_reason(tmp_path):
    p = census("--trace-dir", str(DATA / "rocm-on-reported-off"), "--fusions", "all=on",
               tmp_path=tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr
    fail = [ln for ln in p.stdout.splitlines() if " FAIL " in ln]
    assert any("decode_qprep asked ON" in ln and "backend wants a bf16 query" in ln
               for ln in fail)
    assert any("stock KV-cache write" in ln for ln in fail)
    assert not any("qk_norm" in ln for ln in fail)


def test_cli_claim_from_provenance_and_records_from_server_log(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(DATA / "rocm-on", run / "traces",
                    ignore=shutil.ignore_patterns("k3rocm-decisions-*"))
    (run / "provenance.json").write_text(json.dumps(
        {"server": {"container": {"env": {"K3_FUSE_DECODE_QPREP": "1", "PATH": "/bin"}}}}))
    p = census("--trace-dir", str(run / "traces"), "--server-log",
               str(REC / "server-on.log"), tmp_path=tmp_path / "r1")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "K3_FUSE_QK_NORM unset" in p.stdout and "K3_FUSE_DECODE_QPREP=1" in p.stdout
    # no records found (no files, no log): not cross-checked, visible, not a FAIL
    q = census("--trace-dir", str(run / "traces"), tmp_path=tmp_path / "r2")
    assert q.returncode == 0 and "NOT CROSS-CHECKED: no records found" in q.stdout
    assert "census: PASS (the overlay's decision records were not cross-checked" in q.stdout
    md = (next((tmp_path / "r2").iterdir()) / "census.md").read_text()
    assert "**not cross-checked**: none found" in md
    # asked off in the provenance, records say on: fail both ways
    (run / "provenance.json").write_text(json.dumps(
        {"server": {"container": {"env": {"K3_FUSE_QK_NORM": "0",
                                          "K3_FUSE_DECODE_QPREP": "0"}}}}))
    r = census("--trace-dir", str(run / "traces"), "--server-log",
               str(REC / "server-on.log"), tmp_path=tmp_path / "r3")
    assert r.returncode == 1 and "reported ON although asked OFF" in r.stdout
    # --skip-records: counts only, and the report says the records were not cross-checked
    s = census("--trace-dir", str(DATA / "rocm-on"), "--fusions", "all=on", "--skip-records",
               tmp_path=tmp_path / "r4")
    assert s.returncode == 0 and "SKIPPED on request (--skip-records)" in s.stdout


def test_cli_bad_record_log_exit_2(tmp_path):
    p = census("--trace-dir", str(DATA / "rocm-on"), "--fusions", "all=on", "--server-log",
               str(REC / "server-bad-json.log"), tmp_path=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "not valid JSON" in p.stderr


def test_empty_log_read_at_collection_still_fails_offline(tmp_path):
    d = tmp_path / "traces"
    shutil.copytree(DATA / "rocm-on", d, ignore=shutil.ignore_patterns("k3rocm-decisions-*"))
    (d / "k3rocm-decisions-none.json").write_text(json.dumps(
        {"source": "the log of container k3-server", "records": 0}))
    p = run_cli("census", "--trace-dir", str(d), "--model-dir", str(TINY), "--fusions",
                "all=on", "--results", str(tmp_path / "r"))
    assert p.returncode == 1 and "the overlay did not run" in p.stdout, p.stdout + p.stderr
    assert "the log of container k3-server" in p.stdout


# -- records of the upstream hook (writer "upstream"), on a base whose amd/mla.py is upstream's

def test_upstream_hook_records_are_judged_like_the_overlays():
    """One judge for both writers (the live proof: test_census_standin.py's census-ab)."""
    on = rows(from_cli("all=on"), log("server-upstream-on.log"))
    assert all(c.ok is True and "written by the upstream hook" in c.rule for c in on.values())
    off = rows(from_cli("all=off"), log("server-upstream-off.log"))
    assert all(c.ok is True and "K3_FUSE_QK_NORM=0 (hook)" in off["qk_norm asked OFF"].rule
               for c in off.values())
    bad = rows(from_cli("all=off"), log("server-upstream-on.log"))["qk_norm asked OFF"]
    assert bad.ok is False and "reported ON although asked OFF" in bad.rule
    assert "written by the upstream hook" in bad.rule
    none = rows(from_cli("all=on"), log("server-stock.log"))["qk_norm asked ON"]
    assert "the overlay did not run (nor the upstream hook)" in none.rule
    # a state the hook could not read: that fusion cannot be judged, the other one can
    r = rows(from_cli("all=on"), log("server-upstream-qprep-unknown.log"))
    q = r["decode_qprep asked ON"]
    assert q.ok is None and q.status == "cannot judge" and q.fusion == "decode_qprep"
    assert "report decode_qprep UNKNOWN" in q.undecided and "has no _fused_qk_prep" in \
        q.undecided and "the upstream hook" in q.undecided
    assert r["qk_norm asked ON"].ok is True


def test_cli_upstream_decision_files_beside_the_traces(tmp_path):
    import runpy

    mt = runpy.run_path(str(DATA / "make_traces.py"))
    for name, qprep, code in (("on", "on", 0), ("unknown", "unknown", 4)):
        d = tmp_path / name
        shutil.copytree(DATA / "rocm-on", d, ignore=shutil.ignore_patterns("k3rocm-decisions-*"))
        for r in range(2):
            rec = mt["upstream_record"](5000 + r, r, "on", qprep, (True, True))
            (d / f"k3rocm-decisions-pid{5000 + r}.json").write_text(
                json.dumps([rec], indent=1, sort_keys=True))
        p = census("--trace-dir", str(d), "--fusions", "all=on", tmp_path=tmp_path / f"r-{name}")
        assert p.returncode == code, p.stdout[-2000:] + p.stderr
        assert "every target process (2, written by the upstream hook) reports ON" in p.stdout
    assert "census: CANNOT JUDGE" in p.stdout
    why = [ln for ln in p.stdout.splitlines() if ln.startswith("census: cannot judge:")]
    assert len(why) == 1 and "decode_qprep: 2 of 2 target process(es) report decode_qprep " \
        "UNKNOWN" in why[0] and "has no _fused_qk_prep" in why[0], why
    md = (next((tmp_path / "r-unknown").iterdir()) / "census.md").read_text()
    assert "Verdict: **CANNOT JUDGE**" in md and "## What cannot be judged" in md


def test_census_ab_with_an_arm_that_cannot_be_judged_exits_4(tmp_path):
    import runpy

    mt = runpy.run_path(str(DATA / "make_traces.py"))
    arms = {}
    for arm, traces, state, qprep in (("off", "rocm-off", "off", "off"),
                                      ("on", "rocm-on", "on", "unknown")):
        d = arms[arm] = tmp_path / arm
        shutil.copytree(DATA / traces, d, ignore=shutil.ignore_patterns("k3rocm-decisions-*"))
        for r in range(2):
            rec = mt["upstream_record"](5000 + r, r, state, qprep, (arm == "on",) * 2)
            (d / f"k3rocm-decisions-pid{5000 + r}.json").write_text(json.dumps([rec]))
    p = run_cli("census-ab", "--trace-dirs", f"{arms['off']},{arms['on']}", "--model-dir",
                str(TINY), "--results", str(tmp_path / "r"))
    assert p.returncode == 4, p.stdout[-2000:] + p.stderr
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("census-ab: CANNOT JUDGE") and "decode_qprep" in last, last
