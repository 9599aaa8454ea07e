"""Census parser, expectations and report on the crafted traces in tests/data/census/ (real ROCm
kernel names, multi-rank, gzip; written by make_traces.py)."""

from __future__ import annotations

import gzip
import json
import runpy
import shutil

import pytest
from census_helpers import DATA, KIMI, MT, TINY, census, run_cli
from conftest import REPO

from k3rocm.checks.census.fusions import from_cli
from k3rocm.checks.census.modelcfg import read_model_facts
from k3rocm.checks.census.spec import ROLES, eval_formula, kernel_table, load_spec
from k3rocm.checks.census.trace import load_trace_dir, parse_rank_trace
from k3rocm.errors import UsageError


def failed(c) -> set[tuple]:
    return {(k.rank, k.what) for k in c.checks if k.ok is False}


def test_kernel_table_sources_roles_and_package_data():
    assert '"k3rocm.checks.census" = ["*.json"]' in (REPO / "pyproject.toml").read_text()
    t = kernel_table()
    assert set(t["platforms"]) == {"rocm", "cpu"}
    for plat, table in t["platforms"].items():
        for role in table["roles"].values():
            assert role["names"] and all(n["source"] for n in role["names"])
            assert all(m["source"] for m in role.get("members", []))
        assert set(table["roles"]) == set(t["expect"]) - {"about"} == set(ROLES)  # no others
        spec = load_spec(plat, "deepseek_v3")
        for e in spec.expect.values():
            named = [*(e.beside.until + [e.beside.fused] if e.beside else []),
                     *(e.pair.until if e.pair else [])]
            assert set(named) <= set(ROLES), named
    spec = load_spec("rocm", "deepseek_v3")
    q = spec.roles["fused_qprep"]
    assert [m.name for m in q.members if m.forbidden] == ["general"]
    assert spec.roles["q_concat_quant"].hits(
        "triton_poi_fused__to_copy_cat_clamp_mul_reciprocal_view")
    # the host API name is not a device kernel
    assert not q.hits("aiter::fused_qk_rope_concat_and_cache_mla_kernel")


# -- model config ----------------------------------------------------------------------------

def test_mla_layers_from_kimi_k3_config():
    m = read_model_facts(KIMI)
    assert (m.model_type, m.layers, m.mla_layers) == ("kimi_linear", 93, 24)


def test_mla_layers_deepseek_all_layers():
    m = read_model_facts(TINY / "config.json")
    assert (m.model_type, m.layers, m.mla_layers) == ("deepseek_v3", 3, 3)


def test_model_config_errors(tmp_path):
    with pytest.raises(UsageError, match="not found"):
        read_model_facts(tmp_path / "nope")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama",
                                                      "num_hidden_layers": 4}))
    with pytest.raises(UsageError, match="no MLA"):
        read_model_facts(tmp_path)
    cfg = json.loads((KIMI / "config.json").read_text())
    cfg["text_config"]["linear_attn_config"]["full_attn_layers"] = [1, 2]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UsageError, match="disagrees"):
        read_model_facts(tmp_path)
    # A kimi_k3 checkpoint whose MLA layers are not the published ones (a different revision):
    # refused, since per-layer counts would be judged against the wrong layer count.
    cfg = json.loads((KIMI / "config.json").read_text())
    lac = cfg["text_config"]["linear_attn_config"]
    lac["kda_layers"] = [i for i in lac["kda_layers"] if i != 1]
    lac["full_attn_layers"] = sorted([1, *lac["full_attn_layers"]])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UsageError, match="25 MLA layers of 93.*published config has 24"):
        read_model_facts(tmp_path)
    cfg["k3rocm_slice"] = {"layers": []}  # a selftest slice has its own layer list
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert read_model_facts(tmp_path).mla_layers == 25


# -- traces ----------------------------------------------------------------------------------

def test_multi_rank_gzip_and_frontend_ignored():
    ts = load_trace_dir(DATA / "rocm-on")
    assert [r.rank for r in ts.ranks] == [0, 1] and ts.world_size == 2
    assert all(r.mode == "gpu" and len(r.steps) == 6 for r in ts.ranks)
    assert all(s.decode_only for s in ts.ranks[0].steps)
    assert [i["why"] for i in ts.ignored] == ["no engine-step annotations (front-end trace)"]
    # every kernel but the one after the last step is attributed through its correlation id,
    # although the last kernels of each step run after the step annotation closed
    r0 = ts.ranks[0]
    assert r0.unattributed == 1 and r0.rank_source == "distributedInfo"
    per_step = r0.per_step_counts()
    assert all(c["aiter::fused_qk_rmsnorm_kernel"] == 3 for c in per_step)
    assert all(c["aiter::fuse_qk_rope_concat_and_cache_mla_per_head_kernel"] == 3
               for c in per_step)
    assert all(c["vllm::concat_and_cache_mla_kernel"] == 0 for c in per_step)
    row = next(k for k in r0.kernel_table()
               if k["name"] == "aiter::fuse_qk_rope_concat_and_cache_mla_per_head_kernel")
    assert row["launches"] == 18 and row["mean_us"] == pytest.approx(4.7417, abs=1e-3)


def test_plain_json_mixed_step_and_empty_step_ignored():
    ts = load_trace_dir(DATA / "rocm-mixed-plain")
    r = ts.ranks[0]
    assert r.path.suffix == ".json" and r.rank == 0
    assert r.empty_steps == 1
    assert [s.decode_only for s in r.steps] == [False, True, True, True, True]
    assert (r.steps[0].ctx_reqs, r.steps[0].gen_reqs) == (1, 7)
    c = census("rocm-mixed-plain", "all=on")
    assert c.ok, c.table()
    other = [k for k in c.checks if k.scope == "other steps"]
    assert {(k.role, k.expected, k.seen) for k in other} == {("fused_qprep", 0, 0),
                                                            ("cache_write", 3, 3)}
    fused = next(k for k in c.checks if k.role == "fused_qk_norm")
    assert (fused.expected, fused.seen) == (3 * 5, 3 * 5)  # 5 steps with a forward, not 6


def test_fusions_on_counts_pass():
    c = census("rocm-on", "all=on")
    assert c.ok, c.table()
    fused = [k for k in c.checks if k.role == "fused_qk_norm"]
    assert [(k.rank, k.expected, k.seen) for k in fused] == [(0, 18, 18), (1, 18, 18)]
    pl = c.per_layer_step()[0]
    assert pl["decode_qprep"]["fused_per_layer_step"] == 1.0
    assert pl["decode_qprep"]["fused_members"] == {"per_head": 18}
    assert pl["decode_qprep"]["stock_launches"] == 0
    assert pl["decode_qprep"]["us_per_layer_step"] == pytest.approx(4.7417)
    assert pl["qk_norm"]["stock_launches"] == 0 and pl["qk_norm"]["fused_launches"] == 18
    # the AITER MLA decode kernels match no role: listed as unclassified in the MLA region
    assert c.per_rank[0]["roles"]["unclassified"] == {
        "aiter::mla_a8w8_qh16_qseqlen1_gqaratio16_ps": 18, "kn_mla_reduce_v1_ps": 18}


def test_fusions_off_reverse_counts_pass():
    c = census("rocm-off", "all=off")
    assert c.ok, c.table()
    sep = next(k for k in c.checks if k.role == "qk_norm")
    assert (sep.expected, sep.seen) == (2 * 3 * 6, 2 * 3 * 6)
    cw = next(k for k in c.checks if k.role == "cache_write")
    assert (cw.expected, cw.seen) == (18, 18)
    pl = c.per_layer_step()[0]["decode_qprep"]
    assert (pl["cache_write_launches"], pl["q_concat_quant_launches"]) == (18, 18)


def test_asked_on_but_traces_stock_fails_every_count():
    c = census("rocm-off", "all=on", records=True)
    bad = {(k.rank, k.role) for k in c.checks if k.ok is False}
    assert {(r, role) for r in (0, 1) for role in
            ("fused_qk_norm", "qk_norm", "fused_qprep", "cache_write", "q_concat_quant")} <= bad
    assert ("all", "records") in bad


def test_general_qprep_member_fails_opt_passes():
    c = census("rocm-general", "all=on")
    bad = [k for k in c.checks if k.ok is False and k.role != "-"]
    assert [(k.rank, k.what, k.seen) for k in bad] == [
        (0, "fused Q-prep member 'general' launches", 18),
        (1, "fused Q-prep member 'general' launches", 18)]
    assert c.verdict == "FAIL"
    ok = census("rocm-opt", "all=on")
    assert ok.ok, ok.table()
    assert ok.per_layer_step()[0]["decode_qprep"]["fused_members"] == {"opt": 18}


def test_seven_of_eight_ranks_fails_naming_the_missing_rank():
    c = census("rocm-7of8", "all=on")
    assert c.world_size == 8
    row = next(k for k in c.checks if k.what == "worker traces, one per rank")
    assert row.ok is False and (row.expected, row.seen) == (8, 7)
    assert "MISSING rank(s) 7" in row.rule
    assert failed(c) == {("all", "worker traces, one per rank")}
    # a missing rank is lost evidence: the verdict is "incomplete trace", not "fusion failed"
    assert c.verdict == "INCOMPLETE TRACE" and c.exit_code == 4
    assert c.incomplete == [{"rank": 7, "what": "no worker trace for this rank"}]


def _one_kernel(mutate) -> bytes:
    obj = MT["make_trace"](0, 1, [0, 1, 2], 3, [(0, 8)] * 6, "on", "on")
    mutate(next(e for e in obj["traceEvents"] if e.get("cat") == "kernel"))
    return json.dumps(obj).encode()


@pytest.mark.parametrize("content,msg", [
    (b"{not json", "cannot be read"),
    (gzip.compress(b'{"traceEvents": [', mtime=0), "cannot be read"),
    (b'{"traceEvents": 3}', "no traceEvents list"),
    (json.dumps({"traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "execute_context_0(0)_generation_1(1)",
         "ts": 1, "dur": [1]}]}).encode(), "non-numeric dur"),
    (json.dumps({"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": 1, "args": [1]}]}).encode(),
     "args that are not an object"),
    (lambda: _one_kernel(lambda e: e["args"].update(correlation="1001")), "args.correlation"),
    (lambda: _one_kernel(lambda e: e.update(pid=[0])), "pid"),
    (lambda: _one_kernel(lambda e: e.update(tid={"q": 7})), "tid"),
    (lambda: _one_kernel(lambda e: e.update(name=17)), "name"),
])
def test_bad_inputs_are_usage_errors_naming_file_and_field(tmp_path, content, msg):
    (tmp_path / "x-rank-0.pt.trace.json").write_bytes(content() if callable(content) else content)
    with pytest.raises(UsageError, match=r"x-rank-0\.pt\.trace\.json.*" + msg):
        load_trace_dir(tmp_path)


def test_bad_fusions(tmp_path):
    with pytest.raises(UsageError, match="not NAME=on"):
        from_cli("qk=on")
    with pytest.raises(UsageError, match="leaves decode_qprep unset"):
        from_cli("qk_norm=on")


def test_kimi_k3_anchor_single_arm():
    on = census("k3-anchor-on", "all=on", model=KIMI)
    assert on.ok, on.table()
    fused = next(k for k in on.checks if k.role == "fused_qk_norm" and k.rank == 0)
    assert (fused.expected, fused.seen) == (144, 144)
    sep = [(k.expected, k.seen, k.ok) for k in on.checks if k.role == "qk_norm" and k.rank == 0]
    assert sep == [(None, 1122, None), (0, 0, True)]  # all norms not judged; none beside fused
    off = census("k3-anchor-off", "all=off", model=KIMI, other="2*layers + 1")
    assert off.ok, off.table()
    sep = next(k for k in off.checks if k.role == "qk_norm" and k.rank == 0)
    assert (sep.expected, sep.seen) == (288, 288)
    q = off.per_layer_step()[0]["decode_qprep"]
    assert (q["stock_launches"], q["stock_us"]) == (288, pytest.approx(1351.8))
    assert q["stock_us_per_layer_step"] == pytest.approx(9.3875)
    q = on.per_layer_step()[0]["decode_qprep"]
    assert (q["fused_launches"], q["fused_us"]) == (144, pytest.approx(682.8))
    assert q["fused_us_per_layer_step"] == pytest.approx(4.7417)


def test_too_few_decode_steps_fails():
    c = census("rocm-mixed-plain", "all=on", min_decode_steps=5)
    assert not c.ok
    assert next(k for k in c.checks if k.what == "decode-only engine steps captured").seen == 4


def test_extra_and_formula_overrides():
    c = census("rocm-on", "all=on", other="2*layers", extra_per_step={"fused_qk_norm": 1})
    sep = next(k for k in c.checks if k.role == "qk_norm" and k.rank == 0)
    assert sep.seen == 6 and sep.ok is False  # the final norm is now unexplained
    fused = next(k for k in c.checks if k.role == "fused_qk_norm" and k.rank == 0)
    assert fused.expected == 18 + 6
    names = {"layers": 3, "mla_layers": 2}
    assert eval_formula("2*layers + 1", names) == 7
    assert eval_formula(" (layers - mla_layers) * 4 ", names) == 4
    with pytest.raises(UsageError, match="unknown name 'heads'"):
        eval_formula("2*heads", names)
    # read, never run as Python: no power, call, attribute, comparison or float
    for bad in ("2**layers", "9**9**9**9", "__import__('os')", "layers.real", "(1).bit_length()",
                "layers < 2", "1.5*layers", "True", "", "1 +", "+".join("1" * 5000)):
        with pytest.raises(UsageError, match="may only use"):
            eval_formula(bad, names)


def test_cpu_op_trace_is_counted_by_operator(tmp_path):
    ev = []
    t = 100.0
    for _step in range(2):
        start = t
        for op, kids in (("vllm::fused_mla_dual_rms_norm", ["aten::rsqrt", "aten::rsqrt"]),
                         ("_C::rms_norm", ["aten::rsqrt"]), ("aten::rsqrt", []),
                         ("vllm::unified_mla_kv_cache_update", ["aten::index_put_"])):
            ev.append({"ph": "X", "cat": "cpu_op", "name": op, "pid": 1, "tid": 1, "ts": t,
                       "dur": 10.0})
            for i, k in enumerate(kids):
                ev.append({"ph": "X", "cat": "cpu_op", "name": k, "pid": 1, "tid": 1,
                           "ts": t + 1 + 3 * i, "dur": 2.0})
            t += 11
        ev.append({"ph": "X", "cat": "user_annotation", "pid": 1, "tid": 1, "ts": start,
                   "dur": t - start, "name": "execute_context_0(0)_generation_2(2)"})
        t += 5
    ev.append({"ph": "X", "cat": "cpu_op", "name": "vllm::fused_mla_dual_rms_norm", "pid": 1,
               "tid": 1, "ts": t + 100, "dur": 3.0})  # e.g. a draft pass outside the steps
    p = tmp_path / "dp0_pp0_tp0_dcp0_ep0_rank0.123.pt.trace.json.gz"
    p.write_bytes(gzip.compress(json.dumps({"traceEvents": ev}).encode()))
    rt = parse_rank_trace(p)
    assert rt.mode == "cpu" and len(rt.steps) == 2 and rt.rank_source == "file name"
    m = read_model_facts(TINY)
    spec = load_spec("cpu", m.model_type, other_norms="0")
    from k3rocm.checks.census.expect import build_checks, role_counts

    rc = role_counts(rt, spec)
    assert rc.launches["fused_qk_norm"]["decode"] == 2
    assert rc.launches["qk_norm"]["decode"] == 4  # _C::rms_norm + bare rsqrt, per step
    assert rc.launches["cache_write"]["decode"] == 2
    assert rc.launches["fused_qk_norm"]["outside"] == 1
    checks, _ = build_checks(rt, spec, m, from_cli("qk_norm=on,decode_qprep=off"))
    out = [c for c in checks if c.scope == "no step"]
    assert [(c.role, c.seen, c.ok) for c in out] == [("fused_qk_norm", 1, None)]
    fused = next(c for c in checks if c.role == "fused_qk_norm" and c.scope == "all steps")
    assert (fused.expected, fused.seen, fused.ok) == (3 * 2, 2, False)  # 3 MLA layers x 2


# -- the command line ------------------------------------------------------------------------

def test_cli_fail_prints_expected_vs_seen_and_per_rank_table(tmp_path):
    p = run_cli("census", "--trace-dir", str(DATA / "rocm-fused-and-pair"), "--model-dir",
                str(TINY), "--fusions", "all=on", "--results", str(tmp_path))
    assert p.returncode == 1, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].split() == ["check", "scope", "ranks", "expected", "seen", "status",
                                "deviations", "/", "rule"]
    bad = [ln for ln in lines if " FAIL " in ln and not ln.startswith("census:")]
    # one row per check across ranks: both ranks show the same failing count; the per-step
    # row names the steps; the pair beside the fused norm; the fusion's verdict row
    assert len(bad) == 4 and all(" 2/2 " in ln for ln in bad)
    assert bad[0].startswith("stock q/kv RMSNorm launches (qk_norm asked on)")
    assert bad[1].startswith("stock q/kv RMSNorm launches beside the fused q/kv RMSNorm ones")
    assert "step 0: stock q/kv RMSNorm 6/0" in bad[2]
    assert bad[3].startswith("q/kv RMSNorm fusion (qk_norm asked on): both halves")
    assert any(ln.split()[:3] == ["fusion", "asked", "ranks"] for ln in lines)
    assert "census: FAIL" in p.stdout
    run_dir = next(tmp_path.iterdir())
    assert run_dir.name.endswith("-census")
    data = json.loads((run_dir / "census.json").read_text())
    assert data["ok"] is False and data["world_size"] == 2
    assert data["provenance"]["trace_files"][0]["sha256"]
    assert "**FAIL**" in (run_dir / "census.md").read_text()


def test_cli_census_ab_offline(tmp_path):
    p = run_cli("census-ab", "--trace-dirs",
                f"{DATA / 'k3-anchor-off'},{DATA / 'k3-anchor-on'}", "--model-dir", str(KIMI),
                "--results", str(tmp_path))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr
    assert "census-ab: PASS" in p.stdout
    # the upstream PR's anchors per rank: launches off -> on, decode steps, us per layer and
    # step off, on, saved (the counts: also test_fusions_table.py's third fusion)
    assert "launches off -> on  decode steps" in p.stdout
    for rank in (0, 1):
        row = next(ln.split() for ln in p.stdout.splitlines()
                   if ln.startswith(f"{rank}     decode Q-prep "))
        assert row[3:10] + row[-3:] == ["288", "->", "144", "6", "->", "6", "288",
                                        "9.3875", "4.7417", "4.6458"], row
    # the fused norm while the stock pair still runs: off - on removes none of the 36
    q = run_cli("census-ab", "--trace-dirs",
                f"{DATA / 'rocm-off'},{DATA / 'rocm-fused-and-pair'}", "--model-dir",
                str(TINY), "--other-norms", "0", "--results", str(tmp_path / "bad"))
    assert q.returncode == 1
    rows = [ln.split("(off - on)")[1].split()[2:5] for ln in q.stdout.splitlines()
            if "stock q/kv RMSNorm launches removed (off - on)  " in ln]
    assert rows == [["36", "0", "FAIL"]] * 2, q.stdout[-3000:]


@pytest.mark.parametrize("args,msg", [
    (["--fusions", "all=maybe"], "is not a switch"),
    (["--fusions", "all=on", "--model-dir", "/nonexistent"], "not found"),
    (["--fusions", "all=on", "--extra", "foo=1"], "--extra"),
    (["--fusions", "all=on", "--world-size", "4"], "disagrees with the traces"),
    (["--fusions", "all=on", "--other-norms", "2**layers"], "may only use"),
    (["--fusions", "all=on", "--world-size", "0"], "--world-size 0 is out of range; use x >= 1"),
    (["--fusions", "all=on", "--min-decode-steps", "-1"], "--min-decode-steps -1 is out of range"),
    ([], "what the server was asked for is unknown"),
])
def test_cli_usage_errors_exit_2_one_line(args, msg, tmp_path):
    a = ["census", "--trace-dir", str(DATA / "rocm-on")]
    if "--model-dir" not in args:
        a += ["--model-dir", str(TINY)]
    p = run_cli(*a, *args, "--results", str(tmp_path))
    assert p.returncode == 2, p.stdout + p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("k3rocm: error:") and msg in err[0]


@pytest.mark.parametrize("cmd", ["census", "census-ab"])
@pytest.mark.parametrize("args,msg", [
    (["--steps", "0"], "--steps 0 is out of range; use x >= 1"),
    (["--concurrency", "0"], "--concurrency 0 is out of range"),
    (["--max-tokens", "10"], "--max-tokens 10 is too few for --steps 6; use at least 18"),
])
def test_cli_load_out_of_range_exit_2_before_any_server(cmd, args, msg, tmp_path):
    where = ["--url", "http://127.0.0.1:9"] if cmd == "census" else ["--no-gpu"]
    p = run_cli(cmd, *where, "--model-dir", str(TINY), *args, "--results", str(tmp_path))
    assert p.returncode == 2, p.stdout + p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and msg in err[0], err


@pytest.mark.parametrize("d,msg", [
    ("rocm-corrupt-gzip", "cannot be read as chrome-trace JSON"),
    ("rocm-bad-ts", "non-numeric ts"),
    ("rocm-rankless", "cannot tell the rank of 2 worker trace"),
    ("", "no trace files"),
])
def test_cli_malformed_traces_exit_2_no_traceback(d, msg, tmp_path):
    p = run_cli("census", "--trace-dir", str(DATA / d if d else tmp_path), "--model-dir",
                str(TINY), "--fusions", "all=on", "--world-size", "1", "--results",
                str(tmp_path / "r"))
    assert p.returncode == 2, p.stdout + p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and msg in err[0] and "Traceback" not in p.stderr


def test_crafted_traces_are_reproducible(tmp_path):
    shutil.copy(DATA / "make_traces.py", tmp_path / "make_traces.py")
    shutil.copytree(DATA / "models", tmp_path / "models")
    runpy.run_path(str(tmp_path / "make_traces.py"), run_name="__main__")
    committed = [f for f in DATA.rglob("*") if f.is_file() and f.parent != DATA
                 and "models" not in f.relative_to(DATA).parts]
    assert len(committed) > 30
    for f in committed:
        rel = f.relative_to(DATA)
        assert (tmp_path / rel).read_bytes() == f.read_bytes(), rel
