"""Bench without Docker: workloads, the exact aiperf command, validation, statistics, summary."""

from __future__ import annotations

import csv
import io
import json
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import REPO, make, make_exit_code, run_cli

from k3rocm.checks.bench import ab, stats, summary
from k3rocm.checks.bench import run as bench_run
from k3rocm.checks.bench.run import server_prefix_caching
from k3rocm.checks.bench.workloads import FIELD_NAMES, aiperf_command, load_table, resolve
from k3rocm.errors import UsageError

# The upstream PRs' aiperf command (vLLM #52494, #57640), with <local Kimi-K3 dir> filled in.
UPSTREAM_COMMAND = """aiperf profile --model moonshotai/Kimi-K3 --tokenizer /models/Kimi-K3
  --tokenizer-trust-remote-code --url http://127.0.0.1:8000 --api-key EMPTY
  --endpoint-type chat --streaming --use-server-token-count
  --synthetic-input-tokens-mean 8192 --synthetic-input-tokens-stddev 0
  --output-tokens-mean 1024 --output-tokens-stddev 0
  --extra-inputs ignore_eos:true --extra-inputs min_tokens:1024 --extra-inputs max_tokens:1024
  --warmup-request-count 3 --sweep-type zip --concurrency 1,4,8 --request-count 10,20,40
  --random-seed 42 --ui simple"""


def test_decode_8k1k_dry_run_is_exactly_the_upstream_command(tmp_path, k3):
    p = k3("bench", "--workload", "decode-8k1k", "--tokenizer", "/models/Kimi-K3", "--dry-run",
               "--results", str(tmp_path), env={"COMPOSE_FILE": "compose.yaml"})  # a GPU node
    assert p.returncode == 0, p.stderr
    (line,) = [ln for ln in p.stdout.splitlines() if ln.strip()]
    argv = shlex.split(line)
    assert argv[:-2] == shlex.split(UPSTREAM_COMMAND) and argv[-2] == "--artifact-dir"
    assert argv[-1].startswith(str(tmp_path.resolve()) + "/") and argv[-1].endswith(
        "-decode-8k1k/aiperf")
    assert not list(tmp_path.iterdir()), "a dry run creates nothing"


def test_dry_run_via_make_contacts_nothing(tmp_path):
    p = make("bench", "WORKLOAD=decode-8k1k", "DRY_RUN=1", "BENCH_ARGS=--tokenizer "
             f"/models/Kimi-K3 --results {tmp_path} --url http://127.0.0.1:9", timeout=60)
    assert make_exit_code(p) == 0, p.stderr
    argv = shlex.split(p.stdout.strip().splitlines()[-1])
    assert argv[:2] == ["aiperf", "profile"] and "http://127.0.0.1:9" in argv


def test_workloads_and_their_commands():
    assert {"decode-8k1k", "agentic-68k", "trace-128k", "ci-tiny"} <= set(load_table()[1])
    text = (REPO / "src/k3rocm/checks/bench/workloads.toml").read_text()
    assert [f for f in FIELD_NAMES if f"#   {f}" not in text and f"{f}," not in text
            and f"{f} " not in text] == []  # every field documented in the file
    cmd = aiperf_command(resolve("agentic-68k", env={}), "/out")
    assert cmd[cmd.index("--shared-system-prompt-length") + 1] == "68000"
    assert cmd[cmd.index("--concurrency") + 1] == "1,2,8,16,32"
    assert cmd[cmd.index("--output-tokens-mean") + 1] == "350"
    cmd = aiperf_command(resolve("trace-128k", env={}), "/out")
    assert cmd[cmd.index("--synthetic-input-tokens-mean") + 1] == "131072"
    assert cmd[cmd.index("--concurrency") + 1] == "8"
    assert "--sweep-type" not in cmd  # a single point is not a sweep
    assert resolve("decode-8k1k", {}).prefix_caching is False
    assert resolve("agentic-68k", {}).prefix_caching is True


def test_overrides_cli_beats_env_beats_file(k3):
    w = resolve("decode-8k1k", {"osl": "128"}, env={"BENCH_OSL": "256", "BENCH_ISL": "512",
                                                    "BENCH_CONCURRENCY": "1,2",
                                                    "BENCH_REQUEST_COUNT": "4,8"})
    assert (w.isl, w.osl, w.concurrency, w.request_count) == (512, 128, (1, 2), (4, 8))
    p = k3("bench", "--workload", "decode-8k1k", "--dry-run", "--set", "osl=128", "--set",
               "extra_args=--no-gpu-telemetry --request-timeout-seconds 60",
               env={"BENCH_OSL": "256"})
    assert p.returncode == 0, p.stderr
    argv = shlex.split(p.stdout.strip())
    assert argv[argv.index("--output-tokens-mean") + 1] == "128"
    assert argv[-4:-2] == ["--request-timeout-seconds", "60"]


@pytest.mark.parametrize("args,env,needle", [
    (["--workload", "nope"], {}, "unknown workload 'nope'"),
    (["--set", "isl=0"], {}, "isl='0': Input should be greater than or equal to 1"),
    (["--set", "concurrency=1,2"], {}, "one request_count per concurrency"),
    (["--set", "bogus=1"], {}, "--set 'bogus=1'"),
    (["--set", "url=localhost"], {}, "url='localhost'"),
    ([], {"BENCH_TYPO": "1"}, "unknown environment variable BENCH_TYPO"),
    ([], {"BENCH_STREAMING": "maybe"}, "streaming='maybe': Input should be a valid boolean"),
])
def test_bad_input_is_one_line_exit_2(k3, args, env, needle):
    p = k3("bench", *args, "--dry-run", env=env)
    assert p.returncode == 2, p.stdout + p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("k3rocm: error: ") and needle in err[0], err


def test_missing_tokenizer_fails_before_docker(tmp_path):
    """The real `python -m k3rocm bench` (the cases above run in-process)."""
    p = run_cli("bench", "--workload", "ci-tiny", "--tokenizer", str(tmp_path / "nope"),
                "--results", str(tmp_path), "--url", "http://127.0.0.1:9")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert f"tokenizer directory '{tmp_path / 'nope'}' does not exist" in p.stderr
    assert "--tokenizer DIR (or BENCH_TOKENIZER)" in p.stderr and not list(tmp_path.iterdir())


def test_bad_workload_file(tmp_path):
    f = tmp_path / "w.toml"
    f.write_text("[workloads.x]\nisl = 1\nfoo = 2\n")
    with pytest.raises(UsageError, match="unknown field"):
        resolve("x", env={}, path=f)
    f.write_text("not toml [")
    with pytest.raises(UsageError, match="not valid TOML"):
        resolve("x", env={}, path=f)


def test_bench_ab_dry_run_plan(k3):
    p = k3("bench-ab", "--workload", "ci-tiny", "--repeats", "2", "--dry-run", "--no-gpu",
                "--image", "k3rocm/server:cpu-0.32.0", "--server-env", "K3_PROFILE=cpu-smoke")
    assert p.returncode == 0, p.stderr
    slots = [ln for ln in p.stdout.splitlines() if ln.startswith("# slot")]
    assert [ln.split()[4].rstrip(":") for ln in slots] == ["A", "B", "B", "A"]
    assert "K3_FUSE_DECODE_QPREP=0 K3_FUSE_QK_NORM=0" in slots[0]
    assert "K3_FUSE_DECODE_QPREP=1 K3_FUSE_QK_NORM=1" in slots[1]
    assert sum(ln.startswith("aiperf profile") for ln in p.stdout.splitlines()) == 4
    # what the design can see, before anything starts (the cost: the test below)
    out = p.stdout
    assert "# MDE (ITL p50): unknown - no A/A of this protocol" in out
    assert "the upstream PRs' effect (vLLM PRs #52494, #57640: C=1 decode ITL moved ~0.5%)" in out
    assert "primary metric (declared before the run): ITL p50 at c=1, judged at 5%" in out


def test_bench_ab_dry_run_prints_hours_and_whether_the_upstream_effect_can_be_seen(tmp_path, k3):
    """The default GPU A/B (4 servers per arm, A B B A A B B A): 8 cold starts at the bundle's
    own 1800 s guess = 4.0 h; without an A/A the MDE is 2.37 x the server CV (0.5% needs a CV
    <= 0.21%); with an A/A of this workload under the results root (1% CV) the MDE is printed
    and 0.5% is out of reach."""
    p = k3("bench-ab", "--workload", "decode-8k1k", "--tokenizer", str(tmp_path),
                "--dry-run", "--gpu", "--results", str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert ("# cost: 8 cold server start(s) (4 server(s) per arm), 8 run(s); estimated 4.0 h "
            "(assumed 1800s per start (GPU)") in p.stdout
    assert "order A B B A A B B A (4 server(s) per arm" in p.stdout
    assert ("with 4 server(s) per arm and no A/A the MDE is 2.37 x the server-to-server CV: it "
            "sees 0.5% only if that CV is <= 0.21%") in p.stdout
    aa = tmp_path / "20261201T000000Z-decode-8k1k-aa"
    aa.mkdir()
    (aa / "comparison.json").write_text(json.dumps({"mode": "aa", "protocol_key": "k", "rows": [
        {"concurrency": 1, "metric": "ITL p50", "aa_component": {"var_log": 1e-4, "df": 7}}]}))
    p = k3("bench-ab", "--workload", "decode-8k1k", "--tokenizer", str(tmp_path),
                "--dry-run", "--gpu", "--results", str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert "# MDE (ITL p50, 80% power, two-sided 5%): 2." in p.stdout
    assert f"(from the A/A {aa}; its protocol is checked when the run starts)" in p.stdout
    assert "0.5% ITL p50: the MDE 2." in p.stdout and "CANNOT see it with 4 server(s)" in p.stdout


# --- A/B statistics: the server is the unit

def test_the_statistics_keep_their_values():
    """Every function that reads a distribution (t, F, beta, binomial), pinned to 1e-9."""
    a, b = [10.0, 10.2, 9.8, 10.1], [10.15, 9.9, 10.3, 10.0]
    want = {(): (0.6279734215557218, -0.02329009270451543, 0.0366444505572594,
                 0.04164282921978191, 48),
            ((10.0,), (10.4,), 4e-4, 5): (0.22418869744681902, -0.032931860091889975,
                                          0.11843204771772564, 0.10375241354092202, 65),
            ((10.0, 10.3), (10.4, 10.9), 1e-4, 2): (0.08312043447391593, -0.009926974591594417,
                                                    0.11161752318002383, 0.08060171760579138,
                                                    70)}
    for case, (p, lo, hi, m, need) in want.items():
        res = (stats.compare_servers(case[0], case[1], {"var_log": case[2], "df": case[3]})
               if case else stats.compare_servers(a, b))
        assert [res["p"], res["lo"], res["hi"], res["mde"]] == pytest.approx([p, lo, hi, m],
                                                                             rel=1e-9)
        assert res["servers_for_1pct"] == need
    assert res["floor_check"]["p_run_noisier"] == pytest.approx(0.11498610944056475, rel=1e-9)
    assert stats.interval(res, 0.0125) == pytest.approx((-0.04118048986508005,
                                                         0.147851616115922), rel=1e-9)
    quiet = stats.compare_servers(a, b, {"var_log": 1.7e-4 / 25, "df": 7})["floor_check"]
    assert quiet["p_run_noisier"] == pytest.approx(3.4055972096491693e-05, rel=1e-9)
    assert [stats.mde(4e-4, df, 3, 3) for df in (1, 2, 4, 9, 30)] == pytest.approx(
        [0.2585593290040591, 0.09153234808930977, 0.06258545403807436, 0.052708952329408865,
         0.04842824227261855], rel=1e-9)
    assert [stats.servers_needed(v, e, x) for v, e, x in (
        (4e-4, 0.01, 0), (1e-4, 0.01, 7), (2.5e-3, 0.02, 3), (1e-4, 0.01, 0), (2.5e-5, 0.01, 0),
        (4e-4, 0.01, 7), (1e-4, 0.02, 0))] == [65, 17, 102, 17, 6, 65, 6]
    line = stats.design_line(0.01 ** 2, 7, 4)
    assert line.startswith("MDE (ITL p50, 80% power, two-sided 5%): ")
    assert "for an A/B with 4 server(s) per arm" in line and "needed for 1%: 17" in line
    assert "3.04 x the server-to-server CV: it sees 2.0% only if that CV is <= 0.65%" in \
        stats.effect_line(0.02, 3)
    assert "the MDE 2.18% CANNOT see it with 4 server(s) per arm; servers per arm needed: 5" \
        in stats.effect_line(0.02, 4, 1e-4, 6)
    assert [stats.binom_upper(k, n) for k, n in ((0, 1319), (5, 1000), (26, 1319), (306, 1319))
            ] == pytest.approx([0.0022686375071624175, 0.010484076911415278,
                                0.02724678990797605, 0.2519239533666641], rel=1e-9)
    assert [stats.mcnemar_exact(x, y) for x, y in ((2, 8), (10, 10), (3, 17), (0, 306), (40, 0))
            ] == pytest.approx([0.109375, 1.0, 0.0025768280029296836, 1.5340917079055365e-92,
                                1.8189894035458565e-12], rel=1e-9)
    assert [stats.noninferiority_lower(1319, x, y) for x, y in ((10, 10), (3, 17), (0, 5))
            ] == pytest.approx([-0.0055769590946179995, -0.016995456510383745,
                                -0.007953810832528422], rel=1e-9)
    assert [stats.noninferiority_pass_rate(1319, 0.01, 0.02),
            stats.noninferiority_pass_rate(1319, 0.0115, 0.02, 0.01),
            stats.noninferiority_pass_rate(200, 0.02, 0.05, 0.01)] == pytest.approx(
        [0.8168710575034547, 0.11403590655063685, 0.15222053331469795], rel=1e-9)
    assert stats.server_value([[1.0, 2.0, 4.0], 3.0], "p50") == 2.5


def _arms(rng, n: int, cv: float = 0.01, effect: float = 0.0, mean: float = 10.0):
    """n server values per arm: a log-normal level per server (CV ``cv``) times the p50 noise
    of its requests (0.2%)."""
    def arm(m):
        return (m * rng.lognormal(0.0, cv, n) * rng.normal(1.0, 0.002, n)).tolist()

    return arm(mean), arm(mean * (1 + effect))


def _false_rate(rng, trials: int, servers: int, **kw) -> float:
    return sum(stats.verdict(stats.compare_servers(*_arms(rng, servers), **kw), True)
               in ("B faster", "B slower") for _ in range(trials)) / trials


@pytest.mark.parametrize("servers", [2, 4, 8])
def test_identical_arms_are_called_different_at_the_stated_rate(servers):
    """5% +- 1.5 points on 2500 simulated identical arms (binomial SE 0.44 points)."""
    np = pytest.importorskip("numpy")
    rate = _false_rate(np.random.default_rng(20261204 + servers), 2500, servers)
    assert abs(rate - stats.ALPHA) < 0.015, rate


def test_one_server_per_arm_is_testable_only_with_the_aa_variance_component():
    """1 server per arm: 'inconclusive' whatever the numbers; pooled with an A/A of 1 server
    per arm (df 1) the false-positive rate is 5% again."""
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(7)
    res = stats.compare_servers([10.0], [8.5])
    assert res["p"] is None and stats.verdict(res, True).startswith("inconclusive: no estimate")
    trials, called = 2500, 0
    for _ in range(trials):
        res = stats.compare_servers(*_arms(rng, 1),
                                    floor=stats.variance_component(sum(_arms(rng, 1), [])))
        called += stats.verdict(res, True) in ("B faster", "B slower")
    assert res["df"] == 1 and res["floor_used"]
    assert abs(called / trials - stats.ALPHA) < 0.015, called / trials


def test_power_at_the_printed_mde_is_80_percent():
    """1500 trials at 4 and 8 servers per arm: 80% +- 4 points (SE 1.0)."""
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(3)
    for servers in (4, 8):
        m = stats.mde(0.01 ** 2, 2 * servers - 2, servers, servers)
        found = sum(stats.verdict(stats.compare_servers(*_arms(rng, servers, effect=m)), True)
                    == "B slower" for _ in range(1500))
        assert abs(found / 1500 - 0.80) < 0.04, (servers, m, found / 1500)


def test_three_way_wording():
    up = stats.compare_servers([10.0, 10.1, 9.9, 10.0], [11.0, 11.1, 10.9, 11.0])
    assert up["p"] < 0.001 and up["lo"] < 0.1 < up["hi"]
    assert stats.verdict(up, lower_is_better=True) == "B slower"
    assert stats.verdict(up, lower_is_better=False) == "B faster"
    flat = stats.compare_servers([10.0, 10.3, 9.8, 10.1], [10.1, 9.9, 10.2, 10.0])
    v = stats.verdict(flat, True)
    assert v.startswith("inconclusive: the CI [-2.93%, +3.04%] includes 0; effects smaller "
                        "than ") and v.endswith("% cannot be seen with 4 server(s) per arm"), v
    assert stats.pct_text(flat['mde']) in v and stats.pct_text(2.117) == "212%"
    assert stats.verdict(stats.compare_servers([], [1.0]), True) == "no data"


def test_holm_and_the_level_each_row_is_judged_at():
    assert stats.holm([0.01, 0.04, 0.03, None]) == pytest.approx([0.03, 0.06, 0.06, None])
    assert stats.holm([]) == []
    ps = [0.004, 0.03, 0.012, 0.2, None]  # .004 x4 and .012 x3 rejected, .03 x2 stops
    levels = stats.holm_levels(ps)
    assert levels == pytest.approx([0.05 / 4, 0.05 / 2, 0.05 / 3, 0.05 / 2, None])
    for p, p_adj, lv in zip(ps, stats.holm(ps), levels, strict=True):
        if p is not None:
            assert (p < lv) == (p_adj < 0.05)


def test_secondary_rows_print_the_ci_their_holm_verdict_used():
    """Identical arms, 4 servers per arm, 9 secondary rows: each row's unadjusted 95% CI beside
    its Holm verdict would read "inconclusive" with a CI excluding 0 in about a quarter of the
    reports; the CI printed is the one the verdict used: on 400 simulated
    reports no row shows a CI that excludes 0 beside "inconclusive", nor one that includes 0
    beside "B faster/slower"."""
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(29)
    labels = [label for _, _, label, _ in stats.AB_METRICS]
    mismatched = unadjusted = 0
    for _ in range(400):
        values = {(c, label): dict(zip("AB", _arms(rng, 4), strict=True))
                  for c in (1, 4) for label in labels}
        rows = ab.judge(values, ("ITL p50", 1))
        for r in rows:
            excludes = r["ci_lo"] > 0 or r["ci_hi"] < 0
            mismatched += excludes == r["verdict"].startswith("inconclusive")
            unadjusted += (r["lo"] > 0 or r["hi"] < 0) and r["verdict"].startswith("inconclusive")
        sec = next(r for r in rows if not r["primary"])
        assert sec["ci_level"] > 0.95 and sec["ci_lo"] <= sec["lo"]
    assert mismatched == 0 and unadjusted > 0
    md = ab.comparison_markdown({"mode": "ab", "workload": "w", "protocol": [],
                                 "protocol_key": "k", "runs": [], "rows": rows,
                                 "headline": "h"})
    assert "CI of the verdict (level)" in md and "Holm) |" in md and "(95%) |" in md


def test_primary_row_is_judged_alone_and_the_others_with_holm():
    a, b = [10.0, 10.2, 9.9, 10.1], [10.25, 10.45, 10.15, 10.35]  # +2.5%, p ~ 0.01
    values = {(1, "ITL p50"): {"A": a, "B": b}, (1, "ITL p90"): {"A": a, "B": b},
              (4, "ITL p50"): {"A": a, "B": b}, (4, "output tokens/s"): {"A": b, "B": a}}
    rows = ab.judge(values, ("ITL p50", 1))
    prim = [r for r in rows if r["primary"]]
    assert [(r["metric"], r["concurrency"]) for r in prim] == [("ITL p50", 1)]
    assert 0.01 < prim[0]["p"] < 0.05 and prim[0]["verdict"] == "B slower"
    for r in rows:
        if not r["primary"]:
            assert r["p_holm"] == pytest.approx(min(1.0, 3 * r["p"]))
            assert r["verdict"].startswith("inconclusive")  # 3 x p > 5%
            # its MDE at Holm's strictest step: 5% / 3 secondary rows
            assert r["mde"] == pytest.approx(stats.mde(r["var_log"], 6, 4, 4, alpha=0.05 / 3))
            assert r["mde"] > prim[0]["mde"] == pytest.approx(stats.mde(prim[0]["var_log"], 6,
                                                                        4, 4))


def test_primary_flag_is_validated():
    w = resolve("decode-8k1k", {})
    assert ab.parse_primary(None, w) == ("ITL p50", 1)
    assert ab.parse_primary("ttft:p50@4", w) == ("TTFT p50", 4)
    with pytest.raises(UsageError, match="--primary 'itl:p50@3'"):
        ab.parse_primary("itl:p50@3", w)


@pytest.mark.parametrize("injected", [0.02, 0.10])
def test_calibration_can_fail(injected):
    """The 95% CI covers an injected effect in >= 91% of 400 calibrations (4 servers per arm);
    an estimator biased +50% fails the same check."""
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(int(injected * 1000))
    trials, covered, biased = 400, 0, 0
    for _ in range(trials):
        a, b = _arms(rng, 4, effect=injected)
        covered += stats.covers(stats.compare_servers(a, b), injected)
        biased += stats.covers(stats.compare_servers(a, [x * (1 + 0.5 * injected) for x in b]),
                               injected)
    assert covered / trials >= 0.91 > biased / trials, (covered / trials, biased / trials)


# --- calibration against the delay the server really applied ---------------------------

NOMINAL_MS, BASE_MS, A_ITL = 38.8, 30.0, 37.25  # a loaded run: A's ITL p50 ~37 ms
T0 = 1_767_000_000_000_000_000  # wall-clock ns of the profiling phase's start


def _cal_run_tree(tmp_path, applied_factor: float, records: bool = True) -> list[dict]:
    """Two slots (A, B) as bench-ab leaves them: each run's summary.json point (its aiperf dir
    with the profiling window), provenance.json (the server's recorded env) and, per slot,
    the step-delay double's record. Both arms sleep BASE_MS per step (A's sleeps wake on
    time), B NOMINAL_MS more; B's sleeps last ``applied_factor`` times what was asked. Steps
    outside the profiling window (warmup) slept 10x as long: they must not count."""
    runs = []
    slot_dir = tmp_path / "runs"
    for slot, arm in enumerate("AB"):
        run_dir = slot_dir / f"{slot:02d}-{arm}-0"
        point = run_dir / "aiperf" / "concurrency_1__requests_16"
        point.mkdir(parents=True)
        (point / "phase_manifest.json").write_text(json.dumps({"phases": [
            {"phase_kind": "warmup", "start_ns": T0 - 10**9, "end_ns": T0 - 1},
            {"phase_kind": "profiling", "start_ns": T0, "end_ns": T0 + 30 * 10**9}]}))
        (run_dir / "summary.json").write_text(json.dumps({"points": [
            {"concurrency": 1, "request_count": 16, "status": "ok", "dir": str(point)}]}))
        env = {"K3_TEST_BASE_DELAY_MS": f"{BASE_MS:g}"}
        asked, factor = BASE_MS, 1.0
        if arm == "B":
            env["K3_TEST_STEP_DELAY_MS"] = f"{NOMINAL_MS:g}"
            asked, factor = BASE_MS + NOMINAL_MS, applied_factor
        (run_dir / "provenance.json").write_text(json.dumps(
            {"server": {"container": {"env": env}}}))
        lines = [f"{T0 - 5 * 10**8} {asked:.4f} {asked * 10:.4f}"]  # a warmup step
        # 400 steps in the window, B's applied sleep = base + factor * nominal on average
        extra = 0.0 if arm == "A" else (factor - 1) * (BASE_MS + NOMINAL_MS)
        lines += [f"{T0 + (k + 1) * 50_000_000} {asked:.4f} "
                  f"{asked + extra + (0.2 if k % 2 else -0.2) + 0.2:.4f}" for k in range(400)]
        if records:
            ab.applied_record_path(slot_dir, slot, arm).write_text("\n".join(lines) + "\n")
        runs.append({"slot": slot, "arm": arm, "run": 0, "server": f"k3ab-x-{slot:02d}{arm}",
                     "run_dir": str(run_dir), "status": "ok"})
    return runs


def _itl_row(effect_ms: float, half_width: float = 0.05) -> dict:
    d = effect_ms / A_ITL
    return {"concurrency": 1, "metric": "ITL p50", "primary": True, "a": A_ITL,
            "b": A_ITL + effect_ms, "d": d, "lo": d - half_width, "hi": d + half_width,
            "verdict": "B slower"}


def test_calibration_is_judged_against_the_applied_delay(tmp_path):
    """B's server really slept 1.28x the nominal extra, and the detector saw exactly that.
    Judged against the applied delay (read from the double's record, inside the profiling
    window only) the CI covers the expected effect; judged against the nominal 38.8 ms / A it
    would miss."""
    factor = 1.28
    runs = _cal_run_tree(tmp_path, factor)
    applied_extra = (factor - 1) * (BASE_MS + NOMINAL_MS) + NOMINAL_MS  # B - A, per step
    comp = {"rows": [_itl_row(applied_extra)], "runs": runs}
    (c,) = ab.calibration(comp, NOMINAL_MS)
    assert c["applied_ms"] == pytest.approx(applied_extra, abs=1e-3)
    assert c["applied_a_ms"] == pytest.approx(BASE_MS + 0.2, abs=1e-3)
    assert c["requested_b_ms"] == pytest.approx(BASE_MS + NOMINAL_MS)
    assert c["steps_a"] == c["steps_b"] == 400  # the warmup step is not counted
    assert c["expected_d"] == pytest.approx(applied_extra / A_ITL, abs=1e-4)
    assert c["nominal_d"] == pytest.approx(NOMINAL_MS / A_ITL, abs=1e-4)
    assert c["applied_over_injected"] == pytest.approx(applied_extra / NOMINAL_MS, abs=1e-3)
    assert c["detected_over_applied"] == pytest.approx(1.0, abs=1e-3)
    assert c["covered"] is True and c["why"] is None
    assert stats.covers(comp["rows"][0], c["nominal_d"]) is False  # nominal: a miss
    assert ab.refusal({"calibration": [c]}, tmp_path) is None
    md = ab.comparison_markdown({"mode": "cal", "workload": "ci-tiny", "protocol": [],
                                 "protocol_key": "k", "rows": [], "runs": [],
                                 "headline": "h", "calibration": [c]})
    row = next(ln for ln in md.splitlines() if ln.startswith("| 1 | 38.8 | "))
    assert f"| {applied_extra:.4g} | " in row and "| yes |" in row  # nominal beside applied
    assert c["rest_a_ms"] == pytest.approx(A_ITL - BASE_MS - 0.2, abs=1e-3)
    assert c["rest_b_ms"] == pytest.approx(c["rest_a_ms"], abs=1e-3)  # the sleep explains B

    # A detector that reports the nominal effect when the server applied 1.28x of it fails.
    (c,) = ab.calibration({"rows": [_itl_row(NOMINAL_MS)], "runs": runs}, NOMINAL_MS)
    assert c["covered"] is False
    line, code = ab.refusal({"calibration": [c]}, tmp_path)
    assert code == 1 and line.startswith("k3rocm: error: bench-ab calibration failed: c=1 "
                                         f"expected {c['expected_d'] * 100:+.2f}% (applied "
                                         f"{applied_extra:.4g} ms/step, injected 38.8) "
                                         f"outside the CI [{c['lo'] * 100:+.2f}%, ")


def test_calibration_without_the_record_of_the_applied_delay_is_not_judged(tmp_path):
    """Arm B asked for a sleep but its record is missing: no expected effect, exit 4 (and
    never a pass on the nominal value)."""
    runs = _cal_run_tree(tmp_path, 1.0, records=False)
    (c,) = ab.calibration({"rows": [_itl_row(NOMINAL_MS)], "runs": runs}, NOMINAL_MS)
    assert c["covered"] is None and c["expected_d"] is None
    assert "asked for a sleep but left no record of it in 00-A-stepdelay.tsv" in c["why"] or \
        "asked for a sleep but left no record of it in 01-B-stepdelay.tsv" in c["why"]
    line, code = ab.refusal({"calibration": [c]}, tmp_path)
    assert code == 4 and "calibration cannot be judged: c=1: arm " in line


def test_the_step_delay_double_records_the_sleep_it_really_took(tmp_path, monkeypatch):
    """The double (tests/doubles/stepdelay) writes each sleep's measured duration, not the
    requested one, in the format and at the path bench-ab reads."""
    sys.path.insert(0, str(REPO / "tests" / "doubles" / "stepdelay"))
    try:
        import k3rocm_test_stepdelay as double
    finally:
        sys.path.pop(0)
    assert double.APPLIED_FILE == ab.STEP_DELAY_RECORD
    assert set(ab._DELAY_VARS) == {double.ENV, double.BASE_ENV, double.DELAY_FILE_ENV}
    real_sleep = time.sleep
    monkeypatch.setattr(time, "sleep", lambda s: real_sleep(s * 1.28))  # a late wake-up
    rec = double._Record(str(tmp_path / "applied.tsv"))
    before = time.time_ns()
    for _ in range(3):
        rec.sleep(0.02)
    got = ab._read_applied(tmp_path / "applied.tsv")
    assert len(got) == 3
    for t, requested, applied in got:
        assert before <= t <= time.time_ns()
        assert requested == 20.0 and applied >= 25.6, (requested, applied)


# --- summary: perf.csv, missing points, stream shape, inputs


def test_ctrl_c_keeps_the_finished_point_and_removes_the_client(tmp_path, monkeypatch, k3):
    """Ctrl-C (a real SIGINT) while point 2 runs, through the real runner (cli, run_bench,
    engine.run_client; only Docker and the server are fakes): the client container gets SIGINT
    and is removed, exit 130, one line, point 1 kept in summary.json, perf.csv and report.md.
    Real aiperf in a real client container stopped by Ctrl-C: test_gsm8k_e2e.py (run_client)."""
    seen, gone = [], threading.Event()

    def logs(out: Path):  # aiperf: point 1 written, then Ctrl-C while point 2 runs
        point = _write_stream_point(out / "concurrency_1__requests_2",
                                    [(32, [5.0] * 31, 20.0, 175.0)] * 2)
        (point / "profile_export_aiperf.json").write_text('{"request_count": {"avg": 2}}')
        yield b"point c=1 done; point c=2 running\n"
        while not waiting():  # the user presses Ctrl-C once run_client waits for aiperf
            gone.wait(0.01)
        os.kill(os.getpid(), signal.SIGINT)
        gone.wait(30)

    def waiting() -> bool:  # the main thread is in run_client's pump.join
        f = sys._current_frames().get(threading.main_thread().ident)
        while f and f.f_back and not (f.f_code.co_name == "join"
                                      and f.f_back.f_code.co_name == "run_client"):
            f = f.f_back
        return bool(f and f.f_back)

    def run(image, argv, detach=False, **kw):  # docker-py's containers.run
        out = Path(argv[argv.index("--artifact-dir") + 1])
        return SimpleNamespace(  # the Container methods run_client uses
            logs=lambda **kw: logs(out), wait=lambda timeout=None: {"StatusCode": 130},
            kill=lambda signal: seen.append(signal) or gone.set(),
            remove=lambda force=False: seen.append(f"removed, force={force}")
        ) if detach else b"0.13.0\n"

    docker = SimpleNamespace(images=SimpleNamespace(get=lambda ref: SimpleNamespace(id="sha256:c")),
                             containers=SimpleNamespace(run=run, list=lambda *a, **kw: []))
    monkeypatch.setattr(bench_run, "docker_client", lambda: docker)
    monkeypatch.setattr(bench_run, "wait_ready", lambda *a, **kw: 0.0)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    old = signal.signal(signal.SIGINT, signal.default_int_handler)  # a background pytest ignores it
    try:
        p = k3("bench", "--workload", "ci-tiny", "--quiet", "--url", "http://127.0.0.1:9",
               "--tokenizer", str(tmp_path / "tok"), "--results", str(tmp_path / "r"), "--set",
               "concurrency=1,2", "--set", "request_count=2,100")
    finally:
        signal.signal(signal.SIGINT, old)
    assert p.returncode == 130, p.stderr
    (run_dir,) = (tmp_path / "r").iterdir()
    assert p.stderr.strip().splitlines()[-1] == ("k3rocm: error: bench ci-tiny: interrupted; 1 "
                                                 f"of 2 points finished and kept in {run_dir}")
    assert seen == ["SIGINT", "removed, force=True"]
    doc = json.loads((run_dir / "summary.json").read_text())
    assert doc["status"] == "interrupted" and doc["points"][1]["reason"].startswith("not run")
    assert [q["status"] for q in doc["points"]] == ["ok", "failed"]
    with (run_dir / "perf.csv").open() as fh:
        assert {r["status"] for r in csv.DictReader(fh) if r["max_concurrency"] == "1"} == {"ok"}
    assert "## concurrency 1 (2 requests): ok" in (run_dir / "report.md").read_text()
    assert (run_dir / "aiperf.log").read_bytes().startswith(b"point c=1 done")


def test_perf_csv_keeps_failed_points_and_a_missing_point_is_failed(tmp_path):
    ok = {"concurrency": 1, "request_count": 8, "status": "ok", "total_tps": 10.0,
          "output_tps": 5.0, "metrics": {k: {"p50": 1.0} for k in ("ttft", "itl", "icl", "e2el")}}
    bad = {"concurrency": 2, "request_count": 12, "status": "failed", "reason": "12 request "
           "error(s): connection refused"}
    rows = list(csv.DictReader(io.StringIO(summary.perf_csv(
        [ok, bad], model="m", benchmark="b", tp=8, inp=64, out=32, cmd="aiperf profile ..."))))
    assert list(rows[0])[:11] == summary.MAD_COLUMNS
    assert {r["metric"] for r in rows} == {"throughput_tot", "throughput_gen", "median_ttft",
                                           "median_tpot", "median_itl", "median_e2el"}
    failed = [r for r in rows if r["max_concurrency"] == "2"]
    assert len(failed) == 6 and all(r["performance"] == "" for r in failed)
    assert all(r["status"].startswith("failed: 12 request error(s)") for r in failed)
    pts = summary.summarize(tmp_path / "aiperf", [(1, 8), (2, 12)])
    assert [p["status"] for p in pts] == ["failed", "failed"] and "not run" in pts[0]["reason"]


def _write_stream_point(d, per_request: list[tuple[int, list[float], float, float]]):
    """aiperf 0.13 profile_export.jsonl records: (OSL, inter-chunk gaps ms, TTFT ms, E2E ms)."""
    d.mkdir(parents=True)
    (d / "profile_export.jsonl").write_text("".join(json.dumps({
        "metadata": {"benchmark_phase": "profiling"},
        "metrics": {"output_sequence_length": {"value": osl},
                    "inter_chunk_latency": {"value": gaps},
                    "time_to_first_token": {"value": ttft}, "request_latency": {"value": e2e},
                    "inter_token_latency": {"value": (e2e - ttft) / (osl - 1)}}}) + "\n"
        for osl, gaps, ttft, e2e in per_request))
    return d


@pytest.mark.parametrize("requests,chunks,note", [
    ([(32, [5.0] * 31, 20.0, 175.0)] * 4, 32, None),  # one token per chunk
    ([(32, [40.0, 40.0, 40.0, 35.0], 20.0, 175.0)] * 4, 5,  # --stream-interval 8
     "stream bunched: ITL/TTFT not per token: 6.40 tokens per chunk"),
    ([(32, [0.05], 329.0, 329.1)] * 3, 2,  # one burst: ITL ~0
     "ITL p50 0.0032 ms with 32 output tokens"),
])
def test_stream_shape_and_bunched(tmp_path, requests, chunks, note):
    st = summary.judge_stream(summary.stream_shape(_write_stream_point(tmp_path / "p", requests)))
    assert st["chunks_per_request"] == chunks and st["bunched"] is (note is not None)
    assert st["note"] is None if note is None else note in st["note"]


def test_speculative_decoding_allows_a_step_worth_of_tokens_per_chunk(tmp_path):
    # MTP k=2: up to 3 tokens per step; 2.5 tokens per chunk is per step, not bunched.
    d = _write_stream_point(tmp_path / "p", [(30, [6.0] * 11, 20.0, 86.0)] * 2)
    server = {"rendered": {"argv": ["vllm", "serve", "/m", "--speculative-config",
                                    '{"method":"mtp","num_speculative_tokens":2}']}}
    per_step, src = summary.tokens_per_step(server)
    assert (per_step, src) == (3, "--speculative-config num_speculative_tokens=2")
    assert summary.judge_stream(summary.stream_shape(d), per_step, src)["bunched"] is False
    assert summary.judge_stream(summary.stream_shape(d))["bunched"] is True  # without MTP
    assert summary.tokens_per_step({"container": {"env": {"K3_MTP_K": "0"}}})[0] == 1
    assert summary.tokens_per_step(None) == (1, "no speculative decoding seen")


def test_bunched_point_is_marked_in_the_report(tmp_path):
    d = _write_stream_point(tmp_path / "aiperf" / "concurrency_1__requests_4",
                            [(32, [40.0, 40.0, 40.0, 35.0], 20.0, 175.0)] * 4)
    (d / "profile_export_aiperf.json").write_text(json.dumps({
        "request_count": {"avg": 4}, "output_sequence_length": {"avg": 32}}))
    pts = summary.summarize(tmp_path / "aiperf", [(1, 4)])
    md = summary.markdown_report(pts, "t", [])
    assert "(stream bunched)" in md and "**c=1: stream bunched: ITL/TTFT not per token" in md


def test_server_counters_and_input_flags(tmp_path):
    """Counters in aiperf 0.13.0's server_metrics_export.json (metrics[name]["series"][i]
    ["stats"]["total"]); a point whose inputs differ from the workload's is flagged."""
    def counter(*totals):
        return {"series": [{"stats": {"total": t}} for t in totals]}

    (tmp_path / "server_metrics_export.json").write_text(json.dumps({"metrics": {
        "vllm:prefix_cache_hits": counter(4096, 0.0),
        "vllm:prefix_cache_queries": counter(40960, 40960),
        "vllm:spec_decode_num_draft_tokens": counter(2000),
        "vllm:spec_decode_num_accepted_tokens": counter(1500)}}))
    sm = summary.server_counters(tmp_path)
    assert sm["prefix_cache_hit_rate"] == pytest.approx(0.05)
    assert sm["mtp_acceptance_rate"] == pytest.approx(0.75)
    assert summary.server_counters(tmp_path / "nothing") is None
    clean = {"isl_avg": 8230.0, "osl_avg": 1024.0, "osl_mismatch_count": 0.0,
             "server_metrics": {**sm, "prefix_cache_hits": 0.0}}
    assert summary.input_flags(clean, 8192, 1024, prefix_caching=False) == []
    # the stand-in's chat template: ISL 64 counted as 79 by the server; fewer than asked is off
    assert summary.input_flags({**clean, "isl_avg": 79.0}, 64, 1024, None) == []
    assert summary.input_flags({**clean, "isl_avg": 60.0}, 64, 1024, None)[0].startswith("ISL")
    off = {"isl_avg": 9000.0, "osl_avg": 1000.5, "osl_mismatch_count": 3.0, "server_metrics": sm}
    assert summary.input_flags(off, 8192, 1024, prefix_caching=False) == [
        "OSL: 3 request(s) off the requested 1024 tokens (aiperf osl_mismatch_count)",
        "OSL: server counted 1000.5 output tokens on average, not 1024",
        "ISL: server counted 9000 input tokens on average for 8192 asked (expected "
        "8192..8355 with the chat template)",
        "prefix cache: 4096 token hit(s) while the workload needs prefix caching off"]
    assert summary.input_flags({**clean, "server_metrics": sm}, 8192, 1024, None) == []
    assert summary.input_flags({**clean, "server_metrics": None}, 8192, 1024, False) == [
        "prefix cache: hits not scraped from the server (cannot check 0)"]


def test_server_prefix_caching_from_the_argv():
    assert server_prefix_caching({"rendered": {
        "argv": ["vllm", "serve", "--no-enable-prefix-caching"]}}) is False
    assert server_prefix_caching({"rendered": {"argv": ["vllm", "serve"]}}) is True  # default on
    assert server_prefix_caching({}) is None


# --- the pooled A/A: its variance checked

def test_a_quieter_aa_is_not_pooled_and_lowers_the_false_rate():
    """An A/A a quarter as noisy (df 7) is not pooled and the row says why; one that matches is
    pooled. Identical arms, 4 servers per arm, an A/A of 4 per arm at half the CV: the check
    lowers the false rate of the pooled test."""
    a, b = [10.0, 10.2, 9.8, 10.1], [10.15, 9.9, 10.3, 10.0]
    own = stats.compare_servers(a, b)
    quiet = {"var_log": own["var_log"] / 25, "df": 7}
    res = stats.compare_servers(a, b, floor=quiet)
    assert not res["floor_used"] and res["df"] == 6 and res["lo"] == own["lo"]
    assert res["floor_check"]["note"].startswith("A/A not pooled: this run is noisier than the "
                                                 "A/A (server CV ")
    same = stats.compare_servers(a, b, floor={"var_log": own["var_log"], "df": 7})
    assert same["floor_used"] and same["df"] == 13
    one = stats.compare_servers([10.0], [10.1], floor=quiet)  # nothing to check it with
    assert one["floor_used"] and "unchecked" in one["floor_check"]["note"]
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(2029)
    called = {False: 0, True: 0}
    for _ in range(1500):
        aa = stats.variance_component(sum(_arms(rng, 4, cv=0.005), []))
        a, b = _arms(rng, 4)
        for check in called:
            res = stats.compare_servers(a, b, floor=aa, check_floor=check)
            called[check] += stats.verdict(res, True) in ("B faster", "B slower")
    rates = {k: v / 1500 for k, v in called.items()}  # ~12% and ~9% (6000 trials)
    assert rates[False] > 0.095 and rates[True] < 0.11, rates
    assert rates[False] - rates[True] > 0.02, rates


def test_an_old_aa_is_flagged_beside_the_verdict():
    row = {"primary": True, "floor_check": {"pooled": True, "note": "A/A pooled"}}
    doc = {"same_protocol": True, "dir": "results/20261201T080000Z-ci-tiny-aa"}
    assert ab.aa_age_hours(doc, "20261203T080000Z") == pytest.approx(48.0)
    notes = ab.aa_notes([row], doc, "20261203T080000Z")
    assert notes and "the pooled A/A is 48 h older than this run" in notes[0]
    assert ab.aa_notes([row], {**doc, "finished_utc": "20261203T070000Z"},
                       "20261203T080000Z") == []
    refused = {"primary": True, "floor_check": {"pooled": False, "note": "A/A not pooled: x"}}
    assert ab.aa_notes([refused], {**doc, "finished_utc": "20261203T070000Z"},
                       "20261203T080000Z") == ["A/A not pooled: x"]
