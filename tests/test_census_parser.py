"""Census parser, expectations and report on crafted traces (ROCm kernel names, multi-rank, gzip).

The traces in tests/data/census/ are written by tests/data/census/make_traces.py.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
from conftest import REPO, run_cli

from k3rocm.census.analyze import run_census
from k3rocm.census.fusions import from_cli, from_log
from k3rocm.census.modelcfg import read_model_facts
from k3rocm.census.names import Normalizer
from k3rocm.census.spec import eval_formula, load_spec
from k3rocm.census.trace import load_trace_dir, parse_rank_trace
from k3rocm.errors import UsageError

DATA = REPO / "tests" / "data" / "census"
TINY = DATA / "models" / "tiny-deepseek-v3"  # 3 layers, all MLA
KIMI = DATA / "models" / "kimi-k3"  # 93 layers: 69 KDA + 24 MLA


def census(d: str, fusions: str, model: Path = TINY, platform: str = "rocm", **kw):
    m = read_model_facts(model)
    return run_census(load_trace_dir(DATA / d), m, from_cli(fusions),
                      load_spec(platform, m.model_type, kw.pop("spec", None),
                                kw.pop("other", None)), **kw)


# -- names ---------------------------------------------------------------------------------

@pytest.mark.parametrize("raw,norm", [
    ("void vllm::rms_norm_kernel<c10::BFloat16, 8, 4>(c10::BFloat16*, float, int)",
     "vllm::rms_norm_kernel"),
    ("aiter::fused_qk_rmsnorm_kernel<__hip_bfloat16, 256, 8>(__hip_bfloat16*, ...)",
     "aiter::fused_qk_rmsnorm_kernel"),
    ("void vllm::concat_and_cache_mla_kernel<__hip_bfloat16, unsigned char, "
     "(vllm::Fp8KVCacheDataType)1>(__hip_bfloat16 const*, long const*, int)",
     "vllm::concat_and_cache_mla_kernel"),
    ("void aiter::mla_decode<(anonymous namespace)::Cfg, 512>(void*)", "aiter::mla_decode"),
    ("void ck_tile::kentry<256, 1, ck_tile::Rmsnorm2dFwd<ck_tile::Problem<float>>>(int)",
     "ck_tile::kentry<ck_tile::Rmsnorm2dFwd>"),
    ("Cijk_Alik_Bljk_BBS_BH_MT128x128x64_SN", "Cijk_Alik_Bljk_BBS_BH_MT128x128x64_SN"),
    ("aten::rsqrt", "aten::rsqrt"),
    ("_C_cache_ops::concat_and_cache_mla", "_C_cache_ops::concat_and_cache_mla"),
])
def test_normalize_strips_templates_and_arguments(raw, norm):
    assert Normalizer()(raw) == norm


def test_normalize_aliases_and_verbatim():
    n = Normalizer.from_specs(["rms_norm_kernel$=rmsnorm", "^Cijk_=hipblaslt_gemm"])
    assert n("void vllm::rms_norm_kernel<float>(float*)") == "rmsnorm"
    assert n("Cijk_Alik_Bljk_X") == "hipblaslt_gemm"
    raw = "void vllm::rms_norm_kernel<float>(float*)"
    assert Normalizer(strip_templates=False)(raw) == raw
    with pytest.raises(UsageError, match="not REGEX=NAME"):
        Normalizer.from_specs(["no-equals"])
    with pytest.raises(UsageError, match="not a valid regular expression"):
        Normalizer.from_specs(["(=x"])


# -- model config ----------------------------------------------------------------------------

def test_mla_layers_from_kimi_k3_config():
    m = read_model_facts(KIMI)
    assert (m.model_type, m.layers, m.mla_layers) == ("kimi_linear", 93, 24)
    assert m.mla_layer_indices[:2] == [3, 7] and m.mla_layer_indices[-1] == 92


def test_mla_layers_deepseek_all_layers(tmp_path):
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


# -- traces ----------------------------------------------------------------------------------

def test_multi_rank_gzip_and_frontend_ignored():
    ts = load_trace_dir(DATA / "rocm-on")
    assert [r.rank for r in ts.ranks] == [0, 1]
    assert all(r.mode == "gpu" and len(r.steps) == 6 for r in ts.ranks)
    assert all(s.decode_only for s in ts.ranks[0].steps)
    assert [i["why"] for i in ts.ignored] == ["no engine-step annotations (front-end trace)"]
    # every kernel but the one after the last step is attributed through its correlation id,
    # although the last kernels of each step run after the step annotation closed
    r0 = ts.ranks[0]
    assert r0.unattributed == 1
    per_step = r0.per_step_counts()
    assert all(c["aiter::fused_qk_rmsnorm_kernel"] == 3 for c in per_step)
    assert all(c["aiter::fused_qk_rope_concat_and_cache_mla_kernel"] == 3 for c in per_step)
    assert all(c["vllm::concat_and_cache_mla_kernel"] == 0 for c in per_step)
    row = next(k for k in r0.kernel_table()
               if k["name"] == "aiter::fused_qk_rope_concat_and_cache_mla_kernel")
    assert row["launches"] == 18 and row["mean_us"] == pytest.approx(4.7417, abs=1e-3)


def test_plain_json_and_mixed_step():
    ts = load_trace_dir(DATA / "rocm-mixed-plain")
    r = ts.ranks[0]
    assert r.path.suffix == ".json" and r.rank == 0
    assert [s.decode_only for s in r.steps] == [False, True, True, True, True]
    assert (r.steps[0].ctx_reqs, r.steps[0].gen_reqs) == (1, 7)


def test_fusions_on_anchor_counts_pass():
    c = census("rocm-on", "all=on")
    assert c.ok, c.table()
    fused = [k for k in c.checks if k.role == "fused_qk_norm"]
    assert [(k.rank, k.expected, k.seen) for k in fused] == [(0, 18, 18), (1, 18, 18)]
    pl = c.per_layer_step()[0]
    assert pl["fused_qprep"]["launches_per_layer_step"] == 1.0
    assert pl["cache_write"]["launches"] == 0
    assert pl["qprep_group"]["us_per_layer_step"] == pytest.approx(4.7417)


def test_fusions_off_reverse_counts_pass():
    c = census("rocm-off", "all=off")
    assert c.ok, c.table()
    sep = next(k for k in c.checks if k.role == "qk_norm")
    assert (sep.expected, sep.seen) == (2 * 3 * 6, 2 * 3 * 6)
    cw = next(k for k in c.checks if k.role == "cache_write")
    assert (cw.expected, cw.seen) == (18, 18)


def test_wrong_fusion_state_is_a_mismatch():
    c = census("rocm-off", "all=on")
    assert not c.ok
    bad = {(k.rank, k.role) for k in c.checks if k.ok is False}
    assert bad == {(r, role) for r in (0, 1)
                   for role in ("fused_qk_norm", "qk_norm", "fused_qprep", "cache_write")}


def test_mixed_step_expectations():
    c = census("rocm-mixed-plain", "all=on")
    assert c.ok, c.table()
    other = [k for k in c.checks if k.scope == "other steps"]
    assert {(k.role, k.expected, k.seen) for k in other} == {("fused_qprep", 0, 0),
                                                            ("cache_write", 3, 3)}


def test_kimi_k3_anchor_24_mla_layers():
    """Rank 0 over 6 steps of a 24-MLA-layer model: 144 fused RMSNorm launches expected."""
    c = census("rocm-on", "all=on", model=KIMI)
    fused = next(k for k in c.checks if k.role == "fused_qk_norm" and k.rank == 0)
    assert fused.expected == 144 and fused.seen == 18 and fused.ok is False
    sep = next(k for k in c.checks if k.role == "qk_norm" and k.rank == 0)
    assert sep.ok is None and sep.expected is None  # other norms of K3 not derivable


def test_anchor_shape_24_layers_and_ab_comparison():
    """Crafted in the shape of the upstream evidence (rank 0, 24 MLA layers, 6 decode steps):
    144 fused RMSNorm launches; Q-prep group 288 -> 144 launches, 9.39 -> 4.74 us per MLA
    layer per decode step. (The numbers are put into the crafted trace; this checks the
    arithmetic and the attribution, not AITER.)"""
    from k3rocm.census.ab_cli import compare

    on = census("k3-anchor-on", "all=on", model=KIMI, other="1")
    off = census("k3-anchor-off", "all=off", model=KIMI, other="1")
    assert on.ok and off.ok, on.table() + "\n" + off.table()
    fused = next(k for k in on.checks if k.role == "fused_qk_norm")
    assert (fused.expected, fused.seen) == (144, 144)
    sep = next(k for k in off.checks if k.role == "qk_norm")
    assert (sep.expected, sep.seen) == (288, 288)
    rows = {r["role"]: r for r in compare({"off": off, "on": on})["rows"]}
    g = rows["qprep_group"]
    assert (g["off_launches"], g["on_launches"]) == (288, 144)
    assert g["off_us_per_layer_step"] == pytest.approx(9.3875)
    assert g["on_us_per_layer_step"] == pytest.approx(4.7417)
    assert rows["q_concat_quant"]["off_launches"] == 144
    assert rows["q_concat_quant"]["on_launches"] == 0
    # the generic quant kernel counts only inside the MLA attention operator
    assert rows["fused_qk_norm"]["on_launches_per_layer_step"] == 1.0


def test_too_few_decode_steps_fails():
    c = census("rocm-mixed-plain", "all=on", min_decode_steps=5)
    assert not c.ok
    assert next(k for k in c.checks if k.role == "-").seen == 4


def test_extra_and_formula_overrides():
    c = census("rocm-on", "all=on", other="0", extra_per_step={"fused_qk_norm": 1})
    sep = next(k for k in c.checks if k.role == "qk_norm" and k.rank == 0)
    assert sep.seen == 6 and sep.ok is False  # the first layer's input norm is now unexplained
    fused = next(k for k in c.checks if k.role == "fused_qk_norm" and k.rank == 0)
    assert fused.expected == 18 + 6
    assert eval_formula("2*layers + 1", {"layers": 3, "mla_layers": 3}) == 7
    with pytest.raises(UsageError, match="unknown name"):
        eval_formula("2*heads", {"layers": 3, "mla_layers": 3})
    with pytest.raises(UsageError, match="may only use"):
        eval_formula("__import__('os')", {"layers": 3})


def test_spec_file_overrides_role(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"platforms": {"rocm": {"fused_qk_norm": {
        "match": ["no_such_kernel"]}}}}))
    c = census("rocm-on", "all=on", spec=str(spec))
    assert next(k for k in c.checks if k.role == "fused_qk_norm").seen == 0


def test_cpu_op_trace_is_counted_by_operator(tmp_path):
    """A trace with no kernel events: CPU operators; nested rsqrt inside the fused op or inside
    _C::rms_norm is not a separate norm."""
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
    assert rt.mode == "cpu" and len(rt.steps) == 2
    m = read_model_facts(TINY)
    spec = load_spec("cpu", m.model_type, other_norms="0")
    from k3rocm.census.expect import role_counts

    rc = role_counts(rt, spec)
    assert rc.launches["fused_qk_norm"]["decode"] == 2
    assert rc.launches["qk_norm"]["decode"] == 4  # _C::rms_norm + bare rsqrt, per step
    assert rc.launches["cache_write"]["decode"] == 2
    assert rc.launches["fused_qk_norm"]["outside"] == 1
    from k3rocm.census.expect import build_checks

    checks, _ = build_checks(rt, spec, m, from_cli("qk_norm=on,decode_qprep=off"))
    out = [c for c in checks if c.scope == "no step"]
    assert [(c.role, c.seen, c.ok) for c in out] == [("fused_qk_norm", 1, None)]
    fused = next(c for c in checks if c.role == "fused_qk_norm" and c.scope == "all steps")
    assert (fused.expected, fused.seen, fused.ok) == (3 * 2, 2, False)  # 3 MLA layers x 2


def test_bad_inputs_are_one_line_errors(tmp_path):
    (tmp_path / "x.pt.trace.json").write_text("{not json")
    with pytest.raises(UsageError, match="cannot be read"):
        load_trace_dir(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UsageError, match="no trace files"):
        load_trace_dir(empty)
    with pytest.raises(UsageError, match="not NAME=on"):
        from_cli("qk=on")
    with pytest.raises(UsageError, match="leaves decode_qprep unset"):
        from_cli("qk_norm=on")


def test_fusion_states_from_overlay_log_lines():
    log = "\n".join([
        "(EngineCore_DP0 pid=77) INFO 12-02 17:00:00 [mla.py:383] k3rocm overlay: q/kv RMSNorm "
        "fusion ON (fused_mla_dual_rms_norm; op source: aiter)",
        "(EngineCore_DP0 pid=77) INFO 12-02 17:00:00 [mla.py:385] k3rocm overlay: decode Q-prep "
        "fusion ON (all gates hold; kernel: aiter, clamps positions: True, kv dtype fp8, "
        "heads/rank 12)",
        "(EngineCore_DP0 pid=77) INFO 12-02 17:00:09 [mla.py:413] k3rocm overlay: decode Q-prep "
        "fusion OFF after load (backend wants a bf16 query)",
    ])
    st = from_log(log)
    assert (st.qk_norm, st.decode_qprep) == (True, False)
    assert st.reasons["decode_qprep"] == "backend wants a bf16 query"
    with pytest.raises(UsageError, match="no 'k3rocm overlay"):
        from_log("INFO nothing here")
    mixed = log + ("\n(Worker_TP1 pid=78) INFO k3rocm overlay: q/kv RMSNorm fusion OFF "
                   "(K3_FUSE_QK_NORM=0; op source: aiter)")
    with pytest.raises(UsageError, match="ON in some processes"):
        from_log(mixed)


# -- the command line ------------------------------------------------------------------------

def test_cli_mismatch_prints_expected_vs_seen_table(tmp_path):
    p = run_cli("census", "--trace-dir", str(DATA / "rocm-bad"), "--model-dir", str(TINY),
                "--fusions", "all=on", "--results", str(tmp_path))
    assert p.returncode == 1, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].split() == ["rank", "check", "scope", "expected", "seen", "status", "rule"]
    bad = [ln for ln in lines if "MISMATCH" in ln]
    assert len(bad) == 1
    assert bad[0].split()[0] == "1" and "fused q/kv RMSNorm launches" in bad[0]
    assert " 18 " in bad[0] and " 19 " in bad[0]
    assert "census: FAIL" in p.stdout
    run_dir = next(tmp_path.iterdir())
    assert run_dir.name.endswith("-census")
    data = json.loads((run_dir / "census.json").read_text())
    assert data["ok"] is False
    assert data["provenance"]["trace_files"][0]["sha256"]
    assert "**MISMATCH**" in (run_dir / "census.md").read_text()


def test_cli_pass_and_server_log(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("k3rocm overlay: q/kv RMSNorm fusion OFF (K3_FUSE_QK_NORM=0; op source: x)\n"
                   "k3rocm overlay: decode Q-prep fusion OFF (K3_FUSE_DECODE_QPREP=0; ...)\n")
    p = run_cli("census", "--trace-dir", str(DATA / "rocm-off"), "--model-dir", str(TINY),
                "--server-log", str(log), "--results", str(tmp_path / "r"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "census: PASS" in p.stdout


@pytest.mark.parametrize("args,msg", [
    (["--fusions", "all=maybe"], "is not a switch"),
    (["--fusions", "all=on", "--model-dir", "/nonexistent"], "not found"),
    (["--fusions", "all=on", "--extra", "foo=1"], "--extra"),
    (["--fusions", "all=on", "--alias", "(=x"], "not a valid regular expression"),
])
def test_cli_usage_errors_exit_2_one_line(args, msg, tmp_path):
    a = ["census", "--trace-dir", str(DATA / "rocm-on")]
    if "--model-dir" not in args:
        a += ["--model-dir", str(TINY)]
    p = run_cli(*a, *args, "--results", str(tmp_path))
    assert p.returncode == 2, p.stdout + p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("k3rocm: error:") and msg in err[0]


def test_cli_no_traces_exit_2(tmp_path):
    p = run_cli("census", "--trace-dir", str(tmp_path), "--model-dir", str(TINY),
                "--fusions", "all=on", "--results", str(tmp_path / "r"))
    assert p.returncode == 2 and "no trace files" in p.stderr


def test_crafted_traces_are_reproducible(tmp_path):
    """The committed traces are what make_traces.py writes (gzip mtime 0: byte-identical)."""
    shutil.copy(DATA / "make_traces.py", tmp_path / "make_traces.py")
    import runpy

    runpy.run_path(str(tmp_path / "make_traces.py"), run_name="__main__")
    for f in DATA.rglob("*.pt.trace.json*"):
        rel = f.relative_to(DATA)
        assert (tmp_path / rel).read_bytes() == f.read_bytes(), rel
