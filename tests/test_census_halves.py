"""Both halves of each fusion on AITER-named traces built per test with make_traces.py: a rank or
step on the other path FAILs naming it; what the trace cannot prove is CANNOT JUDGE (exit 4)."""

from __future__ import annotations

from pathlib import Path

from census_helpers import KIMI, MT, TINY, census, run_cli, write

RENAMED_NORM = "void aiter::qk_dual_norm_v9<__hip_bfloat16>(__hip_bfloat16*)"
RENAMED_QPREP = "void aiter::rope_cat_cache_v9<__hip_bfloat16>(__hip_bfloat16 const*)"


def cli(d: Path, fusions: str, tmp_path: Path, model: Path = TINY):
    return run_cli("census", "--trace-dir", str(d), "--model-dir", str(model), "--fusions",
                   fusions, "--skip-records", "--results", str(tmp_path / "r"))


def judged(c, fusion: str) -> set[str]:
    """The fusion's verdict rows across ranks: {'ok'}, {'FAIL'}, {'cannot judge'}."""
    return {k.status for k in c.checks if k.fusion == fusion and k.scope == "fusion"}


# -- 1. the q/kv norm: both halves, also where the model's other norms are unknown ------------

def test_k3_fused_norm_while_the_stock_pair_still_runs_fails(tmp_path):
    c = census(write(tmp_path, "both", "on", KIMI), "all=on", KIMI)
    assert c.verdict == "FAIL" and c.exit_code == 1
    near = [k for k in c.checks if "beside the fused q/kv RMSNorm" in k.what]
    assert [(k.rank, k.expected, k.seen, k.ok) for k in near] == [(0, 0, 288, False),
                                                                  (1, 0, 288, False)]
    assert judged(c, "qk_norm") == {"FAIL"} and judged(c, "decode_qprep") == {"ok"}


def test_k3_norm_fused_under_an_unknown_name_claimed_off_is_not_pass(tmp_path):
    d = write(tmp_path / "t", "on", "off", KIMI, rename={MT["K_FUSED_NORM"]: RENAMED_NORM})
    c = census(d, "all=off", KIMI)
    assert c.verdict == "CANNOT JUDGE" and c.exit_code == 4
    assert judged(c, "qk_norm") == {"cannot judge"} and judged(c, "decode_qprep") == {"ok"}
    p = cli(d, "all=off", tmp_path, KIMI)
    assert p.returncode == 4, p.stdout[-2000:] + p.stderr
    why = [ln for ln in p.stdout.splitlines() if ln.startswith("census: cannot judge:")]
    assert len(why) == 1 and why[0].startswith("census: cannot judge: qk_norm: neither the "
                                                "fused nor the stock q/kv RMSNorm")
    assert "rank(s) 0, 1" in why[0]


def test_k3_stock_run_claimed_off_passes_by_both_halves(tmp_path):
    c = census(write(tmp_path, "off", "off", KIMI), "all=off", KIMI)
    assert c.verdict == "PASS" and not c.undecided, c.table()
    row = next(k for k in c.checks if k.what.startswith("MLA layers with their stock q/kv")
               and k.rank == 0)
    assert (row.expected, row.seen, row.ok) == (144, 144, True)


def test_k3_single_trace_without_placeable_pairs_leaves_it_to_census_ab(tmp_path):
    c = census(write(tmp_path, "off", "on", KIMI, graph=True,
                     rename={MT["K_QPREP"]["per_head"]: RENAMED_QPREP}), "all=off", KIMI)
    assert c.verdict == "CANNOT JUDGE"
    (why,) = [x for x in c.undecided_lines() if x.startswith("qk_norm")]
    assert "census-ab" in why and "--other-norms" in why


def test_qprep_fused_under_an_unknown_name_claimed_off_cannot_judge(tmp_path):
    c = census(write(tmp_path, "off", "on", graph=True,
                     rename={MT["K_QPREP"]["per_head"]: RENAMED_QPREP}), "all=off")
    assert c.verdict == "CANNOT JUDGE", c.table()
    (why,) = [x for x in c.undecided_lines() if x.startswith("decode_qprep")]
    assert "aiter::rope_cat_cache_v9" in why


# -- 2. a rank or a step on the other path: FAIL naming it, not lost events ----------------------

def test_rank_on_the_stock_path_fails_naming_the_rank(tmp_path):
    c = census(write(tmp_path, "on", "on", graph=True,
                     per_rank={1: {"norm": "off", "qprep": "off"}}), "all=on")
    assert not c.incomplete and c.verdict == "FAIL" and c.exit_code == 1
    assert {k.rank for k in c.checks if k.ok is False} == {1}
    row = next(ln for ln in c.table().splitlines() if ln.startswith("fused Q-prep launches"))
    assert " 1/2 " in row and "rank 1: expected 18, seen 0 (FAIL)" in row


def test_step_on_the_stock_path_fails_naming_the_step(tmp_path):
    c = census(write(tmp_path, "on", "on", graph=True, stock_steps=(3,)), "all=on")
    assert not c.incomplete and c.verdict == "FAIL"
    rows = [k for k in c.checks if k.what.startswith("engine steps off the asked")]
    assert {(k.rank, k.fusion, k.seen) for k in rows} == {
        (r, f, 1) for r in (0, 1) for f in ("qk_norm", "decode_qprep")}
    q = next(k for k in rows if k.fusion == "decode_qprep" and k.rank == 0)
    assert "step 3: fused Q-prep 0/3" in q.rule and "step 3: stock KV-cache write 3/0" in q.rule
    assert "step 2" not in q.rule


def test_lost_kernels_still_incomplete_beside_a_stock_rank(tmp_path):
    c = census(write(tmp_path, "on", "on", graph=True,
                     per_rank={1: {"drop": lambda s, i: s > 0 and i % 8 != 0}}), "all=on")
    assert c.verdict == "INCOMPLETE TRACE" and [x["rank"] for x in c.incomplete] == [1]


def test_random_losses_on_every_rank_and_step_stay_incomplete(tmp_path):
    import random

    def drop(seed):
        return lambda s, i: random.Random(seed * 1_000_003 + s * 10_007 + i).random() < 0.05

    c = census(write(tmp_path, "on", "on", KIMI, graph=True,
                     per_rank={0: {"drop": drop(1)}, 1: {"drop": drop(2)}}), "all=on", KIMI)
    assert c.verdict == "INCOMPLETE TRACE" and {x["rank"] for x in c.incomplete} == {0, 1}


# -- 3. kernels that cannot be attributed to steps; malformed fields --------------------------

def test_kernels_not_attributable_to_steps_cannot_judge(tmp_path):
    d = write(tmp_path / "t", "on", "on", unlinked_queues=2, step_spans=False)
    c = census(d, "all=on")
    assert c.verdict == "CANNOT JUDGE" and c.exit_code == 4
    assert not any(k.ok is False for k in c.checks)
    (why,) = c.undecided_lines()
    assert "can be attributed to an engine step" in why and "rank(s) 0, 1" in why
    p = cli(d, "all=on", tmp_path)
    assert p.returncode == 4 and "census: CANNOT JUDGE" in p.stdout, p.stdout[-1500:]


def test_k3_rank_with_the_stock_norm_pair_fails_naming_the_rank(tmp_path):
    c = census(write(tmp_path, "on", "on", KIMI, graph=True, per_rank={1: {"norm": "off"}}),
               "all=on", KIMI)
    assert c.verdict == "FAIL" and not c.incomplete and not c.undecided
    rows = {k.rank: k for k in c.checks if k.fusion == "qk_norm" and k.scope == "fusion"}
    assert (rows[0].ok, rows[1].ok) == (True, False)
    assert "while rank(s) 0 show them" in rows[1].rule
    assert judged(c, "decode_qprep") == {"ok"}
