"""The census on the trace shapes a 2026 ROCm PyTorch writes (built with
tests/data/census/make_traces.py): rocprofiler-sdk names, lost events, several runs in one dir."""

from __future__ import annotations

from pathlib import Path

import pytest
from census_helpers import MT, SIX, TINY, census, run_cli, write

from k3rocm.checks.census.analyze import run_census
from k3rocm.checks.census.fusions import from_cli
from k3rocm.checks.census.modelcfg import read_model_facts
from k3rocm.checks.census.names import normalize
from k3rocm.checks.census.spec import load_spec
from k3rocm.checks.census.trace import load_trace_dir

# -- 1. kernel names in every form kineto writes ------------------------------------------------

@pytest.mark.parametrize("raw,norm", [
    # rocprofiler-sdk (kineto's ROCm backend in 2026): demangled code-object symbol + " [clone .kd]"
    # ("void aiter::fused_qk_rmsnorm_kernel<...>(...) [clone .kd]")
    ("void aiter::fused_qk_rmsnorm_kernel<__hip_bfloat16, 256, 8, true, 1>(__hip_bfloat16*, "
     "float, int) [clone .kd]", "aiter::fused_qk_rmsnorm_kernel"),
    ("void vllm::concat_and_cache_mla_kernel<__hip_bfloat16, unsigned char, "
     "(vllm::Fp8KVCacheDataType)1>(__hip_bfloat16 const*, long const*, int) [clone .kd]",
     "vllm::concat_and_cache_mla_kernel"),
    # the forbidden member (ROCm/aiter csrc/kernels/cache_kernels.cu) in the same form
    ("void aiter::fuse_qk_rope_concat_and_cache_mla_kernel_general<__hip_bfloat16, "
     "__hip_fp8_e4m3, (vllm::Fp8KVCacheDataType)1>(__hip_bfloat16 const*, ...) [clone .kd]",
     "aiter::fuse_qk_rope_concat_and_cache_mla_kernel_general"),
    # rocprofiler-sdk symbols that do not demangle (Triton, assembly kernels) end in ".kd"
    ("triton_poi_fused__to_copy_cat_clamp_mul_reciprocal_view_0.kd",
     "triton_poi_fused__to_copy_cat_clamp_mul_reciprocal_view_0"),
    ("_ZN5aiter23fused_qk_rmsnorm_kernelI14__hip_bfloat16Li256ELi8ELb1ELi1EEEvPT_.kd",
     "aiter::fused_qk_rmsnorm_kernel"),  # the symbol before demangling (Itanium ABI)
    # roctracer (kineto RoctracerActivity) and CUDA (CUPTI): demangled name with arguments
    ("void aiter::fuse_qk_rope_concat_and_cache_mla_per_head_kernel<__hip_bfloat16, "
     "(vllm::Fp8KVCacheDataType)1, false, true>(__hip_bfloat16 const*, ...)",
     "aiter::fuse_qk_rope_concat_and_cache_mla_per_head_kernel"),
    ("void vllm::rms_norm_kernel<c10::BFloat16, 8>(c10::BFloat16*, c10::BFloat16 const*, "
     "c10::BFloat16 const*, float, int, int)", "vllm::rms_norm_kernel"),
    ("void at::native::(anonymous namespace)::elementwise_kernel<128, 4>(int, "
     "at::native::Functor) [clone .kd]", "at::native::elementwise_kernel"),
    ("void ck_tile::kentry<256, 1, ck_tile::Rmsnorm2dFwd<ck_tile::Problem<float>>>(int) "
     "[clone .kd]", "ck_tile::kentry<ck_tile::Rmsnorm2dFwd>"),
    ("void aiter::add_rmsnorm_quant_kernel<__hip_bfloat16, __hip_bfloat16, 256, 8, false>"
     "(__hip_bfloat16*, double, int)", "aiter::add_rmsnorm_quant_kernel"),
    ("Cijk_Alik_Bljk_BBS_BH_MT128x128x64_SN", "Cijk_Alik_Bljk_BBS_BH_MT128x128x64_SN"),
    ("aten::rsqrt", "aten::rsqrt"),
])
def test_every_kineto_name_form_normalizes(raw, norm):
    assert normalize(raw) == norm


@pytest.mark.parametrize("form", ["demangled", "rocprof-sdk"])
def test_roles_match_each_name_form(form):
    spec = load_spec("rocm", "deepseek_v3")
    n = normalize
    want = {MT["K_FUSED_NORM"]: "fused_qk_norm", MT["K_NORM"]: "qk_norm",
            MT["K_CACHE"]: "cache_write", MT["K_CONCAT_QUANT"]: "q_concat_quant",
            **{v: "fused_qprep" for v in MT["K_QPREP"].values()}}
    for raw, role in want.items():
        name = n(MT["name_in_form"](raw, form))
        assert [r for r, x in spec.roles.items() if x.hits(name)] == [role], name
    q = spec.roles["fused_qprep"]
    assert {m: q.member_of(n(MT["name_in_form"](raw, form)))
            for m, raw in MT["K_QPREP"].items()} == {"per_head": "per_head", "opt": "opt",
                                                       "general": "general"}


def test_rocprof_sdk_fused_run_passes(tmp_path):
    c = census(write(tmp_path, "on", "on", name_form="rocprof-sdk"), "all=on")
    assert c.ok, c.table()
    assert {(k.rank, k.seen) for k in c.checks if k.role == "fused_qk_norm"
            and k.scope == "all steps"} == {(0, 18), (1, 18)}


def test_gpu_trace_without_any_role_is_bad_input(tmp_path):
    import gzip
    import json

    d = write(tmp_path / "t", "on", "on", world=1)
    f = d / MT["trace_name"](0)
    obj = json.loads(gzip.decompress(f.read_bytes()))
    for e in obj["traceEvents"]:
        if e.get("cat") == "kernel":
            e["name"] = f"scheme_x_{len(e['name'])}"
    MT["write"](f, obj, gz=True)
    p = run_cli("census", "--trace-dir", str(d), "--model-dir", str(TINY), "--fusions",
                "all=on", "--results", str(tmp_path / "r"))
    assert p.returncode == 2, p.stdout + p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "matches any kernel role" in err[0]


# -- 2. completeness before judgement -----------------------------------------------------------

def strip_kernels(d: Path, ranks: tuple[int, ...]) -> None:
    """Remove every kernel event of ``ranks`` (runtime events and deviceProperties stay): a
    trace with zero GPU records (pytorch/kineto#1338)."""
    import gzip
    import json

    for r in ranks:
        f = d / MT["trace_name"](r)
        obj = json.loads(gzip.decompress(f.read_bytes()))
        obj["traceEvents"] = [e for e in obj["traceEvents"] if e.get("cat") != "kernel"]
        MT["write"](f, obj, gz=True)


def incomplete(c) -> dict[int, str]:
    return {x["rank"]: x["what"] for x in c.incomplete}


def test_graph_replay_complete_passes(tmp_path):
    c = census(write(tmp_path, "on", "on", graph=True), "all=on")
    assert c.verdict == "PASS", c.incomplete or c.table()


def test_roctracer_dropped_graph_replays_are_incomplete(tmp_path):
    c = census(write(tmp_path, "on", "on", graph=True,
                      per_rank={0: {"drop": lambda s, i: s > 0 and i % 8 != 0}}), "all=on")
    assert c.verdict == "INCOMPLETE TRACE" and c.exit_code == 4
    assert list(incomplete(c)) == [0] and "same graph" in incomplete(c)[0]


def test_rank_short_in_every_step_is_incomplete(tmp_path):
    c = census(write(tmp_path, "on", "on", graph=True,
                      per_rank={1: {"drop": lambda s, i: i % 4 == 0}}), "all=on")
    assert c.verdict == "INCOMPLETE TRACE" and list(incomplete(c)) == [1]


def test_cut_off_tail_is_incomplete(tmp_path):
    c = census(write(tmp_path, "on", "on", drop=lambda s, i: s >= 4), "all=on")
    assert c.verdict == "INCOMPLETE TRACE" and set(incomplete(c)) == {0, 1}
    assert all("cut-off tail" in w or "without their kernel record" in w
               for w in incomplete(c).values())
    assert any("cut-off tail" in x["what"] for x in c.incomplete)


def test_zero_gpu_records_is_incomplete_not_cpu_rules(tmp_path):
    d = write(tmp_path, "on", "on")
    strip_kernels(d, (0, 1))
    m = read_model_facts(TINY)
    ts = load_trace_dir(d)
    c = run_census(ts, m, from_cli("all=on"), load_spec("cpu", m.model_type), None, 2, "test")
    assert c.verdict == "INCOMPLETE TRACE" and set(incomplete(c)) == {0, 1}
    assert "MI355X" in incomplete(c)[0] and "runtime event" in incomplete(c)[0]


def test_one_rank_without_gpu_records_is_incomplete(tmp_path):
    d = write(tmp_path, "on", "on")
    strip_kernels(d, (1,))
    c = census(d, "all=on")
    assert c.verdict == "INCOMPLETE TRACE" and list(incomplete(c)) == [1]


def test_cli_incomplete_exit_4_and_report(tmp_path):
    d = write(tmp_path / "t", "on", "on", drop=lambda s, i: s >= 4)
    p = run_cli("census", "--trace-dir", str(d), "--model-dir", str(TINY), "--fusions",
                "all=on", "--skip-records", "--results", str(tmp_path / "r"))
    assert p.returncode == 4, p.stdout + p.stderr
    assert "census: INCOMPLETE TRACE" in p.stdout and "ROCm/ROCm#6102" in p.stdout
    assert "census: FAIL" not in p.stdout
    md = next((tmp_path / "r").iterdir()) / "census.md"
    text = md.read_text()
    assert "Verdict: **INCOMPLETE TRACE**" in text and "## What the trace lost" in text


# -- 3. several runs in one directory ------------------------------------------------------------

# kineto's base time moves in jumps of 7,889,238 s (the figure; next 2026-12-31 19:44:24
# UTC): a trace's clock is baseTimeNanoseconds + ts (us)
JUMP_NS = 7_889_238 * 10**9
BASE = 1_759_236_864 * 10**9  # a kineto base time before the jump


def write_named_run(d: Path, instance: int, world: int, fusions: str, ranks=None,
                    **kw) -> None:
    """vLLM's CPU-worker name ``<instance_id>-rank-<r>`` + torch's ``.<time_ns>.pt.trace...``
    (vllm 0.27.1 v1/worker/cpu_worker.py; torch profiler.tensorboard_trace_handler)."""
    d.mkdir(parents=True, exist_ok=True)
    for r in (range(world) if ranks is None else ranks):
        name = f"{instance}-rank-{r}.{instance + 10**9 * 60}.pt.trace.json.gz"
        MT["write"](d / name, MT["make_trace"](r, world, [0, 1, 2], 3, SIX, fusions, fusions,
                                               **kw), gz=True)


def test_newest_run_missing_a_rank_is_not_back_filled(tmp_path):
    t_old = 1_764_700_000 * 10**9
    write_named_run(tmp_path, t_old, 8, "on", base_ns=t_old)
    t_new = t_old + 3600 * 10**9
    write_named_run(tmp_path, t_new, 8, "on", ranks=[0, 1, 2, 3, 4, 6, 7], base_ns=t_new)
    c = census(tmp_path, "all=on")
    assert c.verdict == "INCOMPLETE TRACE" and incomplete(c) == {
        5: "no worker trace for this rank"}
    assert [r["rank"] for r in c.per_rank] == [0, 1, 2, 3, 4, 6, 7]
    assert len(c.traces.skipped_runs) == 1 and c.traces.skipped_runs[0]["ranks"] == list(
        range(8))
    assert "Skipped: an older run" in c.markdown()


def test_base_time_jump_orders_runs_by_absolute_time(tmp_path):
    a_ts = 7_000_000 * 1e6  # us after BASE
    write_named_run(tmp_path / "d", 1_767_000_000 * 10**9, 2, "off", base_ns=BASE, t0=a_ts)
    b_base = BASE + JUMP_NS
    write_named_run(tmp_path / "d", 1_767_300_000 * 10**9, 2, "on", base_ns=b_base)
    c = census(tmp_path / "d", "all=on")
    assert c.verdict == "PASS", c.table()
    assert c.traces.run_started == pytest.approx(b_base / 1e9 + 0.009, abs=1)
    assert [x["ranks"] for x in c.traces.skipped_runs] == [[0, 1]]


def test_file_name_time_when_no_base_time(tmp_path):
    import os

    d = tmp_path / "d"
    write_named_run(d, 1_764_000_000 * 10**9, 2, "off")
    write_named_run(d, 1_764_900_000 * 10**9, 2, "on")
    for f in d.iterdir():  # mtimes say the opposite (e.g. copied newest-first)
        os.utime(f, (2e9 if "-rank-" in f.name and f.name.startswith("17640") else 1e9,) * 2)
    c = census(d, "all=on")
    assert c.verdict == "PASS", c.table()
    assert c.per_rank[0]["started_source"] == "file name"


def test_cli_prints_skipped_runs(tmp_path):
    d = tmp_path / "d"
    write_named_run(d, 1_764_000_000 * 10**9, 2, "on")
    write_named_run(d, 1_764_900_000 * 10**9, 2, "on")
    p = run_cli("census", "--trace-dir", str(d), "--model-dir", str(TINY), "--fusions",
                "all=on", "--skip-records", "--results", str(tmp_path / "r"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "census: skipped an older run" in p.stdout
    md = (next((tmp_path / "r").iterdir()) / "census.md").read_text()
    assert "- Skipped: an older run" in md


# -- 8. the report: one row per check across ranks ------------------------------------------------

def test_report_one_row_per_check_with_deviating_ranks(tmp_path):
    d = write(tmp_path / "t", "on", "on", world=8, per_rank={3: {"member": "general"}})
    c = census(d, "all=on")
    table = c.table().splitlines()
    per_rank_checks = {k.what for k in c.checks if k.rank != "all"}
    assert len(table) == 2 + len({(k.what, k.scope) for k in c.checks})
    assert len(table) < 2 + len(per_rank_checks) + 8  # not one row per rank and check
    row = next(ln for ln in table if "member 'general' launches" in ln)
    assert " 7/8 " in row and "FAIL" in row and "rank 3: expected 0, seen 18 (FAIL)" in row
    fused = next(ln for ln in table if ln.startswith("fused q/kv RMSNorm launches"))
    assert " 8/8 " in fused and " 18 " in fused
    rep = c.report_table().splitlines()
    assert len(rep) == 3 and "rank 3: general x18" in rep[2]
    md = c.markdown()
    assert md.count("## Top 25 kernels") == 1 and "## Rank " not in md
    assert "| `aiter::fuse_qk_rope_concat_and_cache_mla_per_head_kernel` | 18 [rank 3: 0] |" in md


# -- 6. the MLA-region net under graph replay ----------------------------------------------------

def test_renamed_fused_kernel_is_listed_under_graph_replay(tmp_path):
    renamed = "void aiter::fused_rope_cat_cache_mla_v2<__hip_bfloat16>(__hip_bfloat16 const*)"
    d = write(tmp_path, "on", "on", graph=True,
              rename={MT["K_QPREP"]["per_head"]: renamed})
    c = census(d, "all=on")
    assert c.verdict == "CANNOT JUDGE" and c.exit_code == 4
    why = c.undecided_lines()
    assert len(why) == 1 and why[0].startswith("decode_qprep: neither the fused nor the stock")
    assert "aiter::fused_rope_cat_cache_mla_v2" in why[0] and "rank(s) 0, 1" in why[0]
    assert all(p["roles"]["unclassified"] == {"aiter::fused_rope_cat_cache_mla_v2": 18}
               for p in c.per_rank)
    row = next(ln for ln in c.table().splitlines() if ln.startswith("unclassified"))
    assert "aiter::fused_rope_cat_cache_mla_v2 x18" in row and " 2/2 " in row


# -- 5. decode-only from tokens; device spans per queue -------------------------------------------

def test_recomputed_prompt_step_is_not_decode_only(tmp_path):
    d = tmp_path / "t"
    d.mkdir()
    steps = SIX[:3] + [(0, 8, 200)] + SIX[3:]
    for r in range(2):
        MT["write"](d / MT["trace_name"](r),
                    MT["make_trace"](r, 2, [0, 1, 2], 3, steps, "on", "on"), gz=True)
    c = census(d, "all=on")
    assert c.verdict == "PASS", c.table()
    st = c.per_rank[0]["steps_detail"][3]
    assert (st["recompute"], st["decode_only"], st["tokens_per_request"]) == (True, False, 3)


def test_unlinked_kernels_map_through_their_own_queue(tmp_path):
    d = write(tmp_path, "on", "on", unlinked_queues=2)
    c = census(d, "all=on")
    assert c.verdict == "PASS", (c.incomplete, c.table())
    assert all(p["unattributed"] == 1 for p in c.per_rank)  # only the sampler after the steps


# -- 7. stream parsing --------------------------------------------------------------------------

def test_stream_header_before_and_after_the_events(tmp_path, monkeypatch):
    import gzip
    import json

    from k3rocm.checks.census import stream
    from k3rocm.checks.census.trace import parse_rank_trace

    monkeypatch.setattr(stream, "HEAD_MAX", 300)
    obj = MT["make_trace"](1, 2, [0, 1, 2], 3, SIX, "on", "on")
    head = {"schemaVersion": 1, "deviceProperties": obj["deviceProperties"],
            "distributedInfo": obj["distributedInfo"]}
    text = (json.dumps(head)[:-1] + ', "traceEvents": ' + json.dumps(obj["traceEvents"])
            + ', "traceName": "x]y", "baseTimeNanoseconds": 1764700000000000000}')
    p = tmp_path / "w.1764700000.pt.trace.json.gz"
    p.write_bytes(gzip.compress(text.encode(), mtime=0))
    rt = parse_rank_trace(p)
    assert (rt.rank, rt.world_size, rt.rank_source) == (1, 2, "distributedInfo")
    assert rt.started_source == "baseTimeNanoseconds + ts"
    assert rt.n_launches > 0 and len(rt.steps) == 6


def test_top_level_list_trace(tmp_path):
    import json

    from k3rocm.checks.census.trace import parse_rank_trace

    obj = MT["make_trace"](0, 1, [0, 1, 2], 3, SIX, "on", "on")
    p = tmp_path / "x-rank-0.1764700000.pt.trace.json"
    p.write_text(json.dumps(obj["traceEvents"]))
    rt = parse_rank_trace(p)
    assert rt.rank == 0 and len(rt.steps) == 6 and rt.mode == "gpu"


def test_census_ab_with_an_incomplete_arm_exits_4(tmp_path):
    off = write(tmp_path / "off", "off", "off")
    on = write(tmp_path / "on", "on", "on", drop=lambda s, i: s >= 4)
    p = run_cli("census-ab", "--trace-dirs", f"{off},{on}", "--model-dir", str(TINY),
                "--other-norms", "2*layers + 1", "--skip-records", "--results",
                str(tmp_path / "r"))
    assert p.returncode == 4, p.stdout[-2000:] + p.stderr
    assert "census-ab: INCOMPLETE TRACE (arm(s) on lost events" in p.stdout
