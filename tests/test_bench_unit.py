"""Bench: workloads, the exact aiperf command, overrides, validation, statistics (no Docker)."""

from __future__ import annotations

import csv
import io
import json
import shlex
import subprocess
import sys

import pytest
from conftest import REPO, run_cli

from k3rocm.checks.bench import stats, summary
from k3rocm.checks.bench.workloads import aiperf_command, resolve, workload_names
from k3rocm.errors import UsageError

# The seed's command, verbatim from the brief (section 3), with <local Kimi-K3 dir> filled in.
SEED = """aiperf profile --model moonshotai/Kimi-K3 --tokenizer /models/Kimi-K3
  --tokenizer-trust-remote-code --url http://127.0.0.1:8000 --api-key EMPTY
  --endpoint-type chat --streaming --use-server-token-count
  --synthetic-input-tokens-mean 8192 --synthetic-input-tokens-stddev 0
  --output-tokens-mean 1024 --output-tokens-stddev 0
  --extra-inputs ignore_eos:true --extra-inputs min_tokens:1024 --extra-inputs max_tokens:1024
  --warmup-request-count 3 --sweep-type zip --concurrency 1,4,8 --request-count 10,20,40
  --random-seed 42 --ui simple"""


def _bench(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_cli("bench", *args, env=env)


def test_workloads_exist():
    assert {"decode-8k1k", "agentic-68k", "trace-128k", "ci-tiny"} <= set(workload_names())


def test_decode_8k1k_dry_run_is_exactly_the_seed_command(tmp_path):
    p = _bench("--workload", "decode-8k1k", "--tokenizer", "/models/Kimi-K3", "--dry-run",
               "--results", str(tmp_path))
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1
    argv = shlex.split(lines[0])
    # Everything but the artifact location is the seed's command, in the seed's order.
    assert argv[-2] == "--artifact-dir"
    assert argv[:-2] == shlex.split(SEED)
    assert argv[-1].startswith(str(tmp_path.resolve()) + "/") and argv[-1].endswith(
        "-decode-8k1k/aiperf")
    assert not list(tmp_path.iterdir()), "a dry run creates nothing"


def test_dry_run_via_make_contacts_nothing(tmp_path):
    p = subprocess.run(["make", "-s", "-o", sys.executable, "bench", f"PY={sys.executable}",
                        "WORKLOAD=decode-8k1k", "DRY_RUN=1",
                        f"BENCH_ARGS=--tokenizer /models/Kimi-K3 --results {tmp_path} "
                        "--url http://127.0.0.1:9"],
                       cwd=REPO, capture_output=True, text=True, timeout=60,
                       env={**_env(), "PYTHONPATH": str(REPO / "src")})
    assert p.returncode == 0, p.stderr
    argv = shlex.split(p.stdout.strip().splitlines()[-1])
    assert argv[:2] == ["aiperf", "profile"] and "http://127.0.0.1:9" in argv


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith(("K3_", "BENCH_"))}


def test_other_workloads_commands():
    ag = resolve("agentic-68k", env={})
    cmd = aiperf_command(ag, "/out")
    assert cmd[cmd.index("--shared-system-prompt-length") + 1] == "68000"
    assert cmd[cmd.index("--concurrency") + 1] == "1,2,8,16,32"
    assert cmd[cmd.index("--output-tokens-mean") + 1] == "350"
    tr = resolve("trace-128k", env={})
    cmd = aiperf_command(tr, "/out")
    assert cmd[cmd.index("--synthetic-input-tokens-mean") + 1] == "131072"
    assert cmd[cmd.index("--concurrency") + 1] == "8"
    assert "--sweep-type" not in cmd  # a single point is not a sweep


def test_overrides_cli_beats_env_beats_file():
    w = resolve("decode-8k1k", {"osl": "128"}, env={"BENCH_OSL": "256", "BENCH_ISL": "512",
                                                    "BENCH_CONCURRENCY": "1,2",
                                                    "BENCH_REQUEST_COUNT": "4,8"})
    assert (w.isl, w.osl, w.concurrency, w.request_count) == (512, 128, (1, 2), (4, 8))
    p = _bench("--workload", "decode-8k1k", "--dry-run", "--set", "osl=128", "--set",
               "extra_args=--no-gpu-telemetry --request-timeout-seconds 60",
               env={"BENCH_OSL": "256"})
    assert p.returncode == 0, p.stderr
    argv = shlex.split(p.stdout.strip())
    assert argv[argv.index("--output-tokens-mean") + 1] == "128"
    assert argv[-4:-2] == ["--request-timeout-seconds", "60"]


@pytest.mark.parametrize("args,env,needle", [
    (["--workload", "nope"], {}, "unknown workload 'nope'"),
    (["--set", "isl=0"], {}, "isl='0': must be >= 1"),
    (["--set", "concurrency=1,2"], {}, "one request_count per concurrency"),
    (["--set", "bogus=1"], {}, "--set 'bogus=1'"),
    (["--set", "url=localhost"], {}, "url='localhost'"),
    ([], {"BENCH_TYPO": "1"}, "unknown environment variable BENCH_TYPO"),
    ([], {"BENCH_STREAMING": "maybe"}, "streaming='maybe' is not a boolean"),
])
def test_bad_input_is_one_line_exit_2(args, env, needle):
    p = _bench(*args, "--dry-run", env=env)
    assert p.returncode == 2, p.stdout + p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("k3rocm: error: ") and needle in err[0], err
    assert "Traceback" not in p.stderr


def test_missing_tokenizer_fails_before_docker(tmp_path):
    p = _bench("--workload", "ci-tiny", "--tokenizer", str(tmp_path / "nope"),
               "--results", str(tmp_path), "--url", "http://127.0.0.1:9")
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        f"k3rocm: error: tokenizer directory '{tmp_path / 'nope'}' does not exist: pass the "
        "model's local directory with --tokenizer DIR (or BENCH_TOKENIZER)"]
    assert not list(tmp_path.iterdir())


def test_bench_ab_dry_run_plan():
    p = run_cli("bench-ab", "--workload", "ci-tiny", "--repeats", "2", "--dry-run", "--no-gpu",
                "--image", "k3rocm/server:cpu-0.32.0", "--server-env", "K3_PROFILE=cpu-smoke")
    assert p.returncode == 0, p.stderr
    slots = [ln for ln in p.stdout.splitlines() if ln.startswith("# slot")]
    assert [ln.split()[4].rstrip(":") for ln in slots] == ["A", "B", "B", "A"]
    assert "K3_FUSE_DECODE_QPREP=0 K3_FUSE_QK_NORM=0" in slots[0]
    assert "K3_FUSE_DECODE_QPREP=1 K3_FUSE_QK_NORM=1" in slots[1]
    assert sum(ln.startswith("aiperf profile") for ln in p.stdout.splitlines()) == 4
    p = run_cli("bench-ab", "--aa", "--dry-run", "--no-gpu", "--server-env",
                "K3_FUSE_QK_NORM=0")
    assert p.returncode == 2 and "set per arm" in p.stderr


def test_abba_order():
    from k3rocm.checks.ab.arms import sequence

    assert sequence(1) == ["A", "B"]
    assert sequence(3) == ["A", "B", "B", "A", "A", "B"]


def test_percentile_matches_numpy():
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(1)
    for n in (1, 2, 7, 40):
        xs = rng.gamma(2.0, 3.0, size=n).tolist()
        for q in (1, 50, 90, 99):
            assert summary.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)),
                                                              rel=1e-12)


def test_bootstrap_detects_a_real_difference_and_not_a_null_one():
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(7)

    def arm(mean, servers=3, runs=2, n=40):
        return [[rng.normal(mean, 0.3, size=n).tolist() for _ in range(runs)]
                for _ in range(servers)]

    a, b = arm(10.0), arm(10.5)  # B 5% slower
    res = stats.bootstrap_diff(a, b, "p50", n_boot=500)
    assert 0.03 < res["d"] < 0.07 and res["lo"] > 0
    assert stats.verdict(res, lower_is_better=True) == "B slower"
    assert stats.verdict(res, lower_is_better=False) == "B faster"
    null = stats.bootstrap_diff(arm(10.0), arm(10.0), "p50", n_boot=500)
    assert null["lo"] < 0 < null["hi"]
    assert stats.verdict(null, lower_is_better=True) == "within noise"
    # A floor from A/A turns a tiny but "significant" effect into noise.
    assert stats.verdict({"d": 0.004, "lo": 0.001, "hi": 0.007}, True, floor=0.01) == \
        "within noise"


def test_one_server_per_arm_needs_the_aa_floor_to_claim_an_effect():
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(11)
    # Two identical arms, but each on one server whose instance is 15% off the other (as seen
    # on the 2-core stand-in): the bootstrap CI excludes 0, yet nothing is known about B.
    a = [[rng.normal(10.0, 0.2, size=40).tolist() for _ in range(2)]]
    b = [[rng.normal(8.5, 0.2, size=40).tolist() for _ in range(2)]]
    res = stats.bootstrap_diff(a, b, "p50", n_boot=300)
    assert res["servers_a"] == res["servers_b"] == 1 and res["hi"] < 0
    assert stats.verdict(res, lower_is_better=True) == "within noise"
    assert stats.verdict(res, True, floor=0.20) == "within noise"
    assert stats.verdict(res, True, floor=0.05) == "B faster"  # beyond a measured floor
    # With two servers per arm the same separation is evidence (server noise is resampled).
    a2 = a + [[rng.normal(10.0, 0.2, size=40).tolist() for _ in range(2)]]
    b2 = b + [[rng.normal(8.5, 0.2, size=40).tolist() for _ in range(2)]]
    assert stats.verdict(stats.bootstrap_diff(a2, b2, "p50", n_boot=300), True) == "B faster"


def test_repeats_needed_scales_with_the_square_of_the_halfwidth():
    assert stats.repeats_needed(0.02, 2, 0.01) == 8
    assert stats.repeats_needed(0.005, 4, 0.01) == 1
    assert stats.repeats_needed(0.02, 2, 0.01, power=0.8) > 8
    assert stats.repeats_needed(None, 2) is None


def test_perf_csv_keeps_failed_points():
    ok = {"concurrency": 1, "request_count": 8, "status": "ok", "total_tps": 10.0,
          "output_tps": 5.0, "metrics": {k: {"p50": 1.0} for k in ("ttft", "itl", "icl", "e2el")}}
    bad = {"concurrency": 2, "request_count": 12, "status": "failed", "reason": "12 request "
           "error(s): connection refused"}
    text = summary.perf_csv([ok, bad], model="m", benchmark="b", tp=8, inp=64, out=32,
                            cmd="aiperf profile ...")
    rows = list(csv.DictReader(io.StringIO(text)))
    assert list(rows[0])[:11] == summary.MAD_COLUMNS
    assert {r["metric"] for r in rows} == {"throughput_tot", "throughput_gen", "median_ttft",
                                           "median_tpot", "median_itl", "median_e2el"}
    failed = [r for r in rows if r["max_concurrency"] == "2"]
    assert len(failed) == 6 and all(r["performance"] == "" for r in failed)
    assert all(r["status"].startswith("failed: 12 request error(s)") for r in failed)


def test_summary_of_a_missing_point_is_failed(tmp_path):
    pts = summary.summarize(tmp_path / "aiperf", [(1, 8), (2, 12)])
    assert [p["status"] for p in pts] == ["failed", "failed"]
    assert "not run" in pts[0]["reason"]


def test_usage_error_is_raised_for_bad_workload_file(tmp_path):
    f = tmp_path / "w.toml"
    f.write_text("[workloads.x]\nisl = 1\nfoo = 2\n")
    with pytest.raises(UsageError, match="unknown field"):
        resolve("x", env={}, path=f)
    f.write_text("not toml [")
    with pytest.raises(UsageError, match="not valid TOML"):
        resolve("x", env={}, path=f)


def test_workloads_file_fields_documented():
    text = (REPO / "src/k3rocm/checks/bench/workloads.toml").read_text()
    from k3rocm.checks.bench.workloads import FIELD_NAMES

    for f in FIELD_NAMES:
        assert f"#   {f}" in text or f"{f}," in text or f"{f} " in text, f
    json.dumps(resolve("decode-8k1k", env={}).protocol())


# --- is the stream per token? (fixed per-request records with a known answer) ---------------

def _write_stream_point(d, per_request: list[tuple[int, list[float], float, float]]):
    """aiperf 0.13 profile_export.jsonl records: (OSL, inter-chunk gaps ms, TTFT ms, E2E ms)."""
    d.mkdir(parents=True)
    lines = []
    for osl, gaps, ttft, e2e in per_request:
        itl = (e2e - ttft) / (osl - 1) if osl > 1 else 0.0
        lines.append(json.dumps({
            "metadata": {"benchmark_phase": "profiling"},
            "metrics": {"output_sequence_length": {"value": osl},
                        "inter_chunk_latency": {"value": gaps},
                        "time_to_first_token": {"value": ttft},
                        "request_latency": {"value": e2e},
                        "inter_token_latency": {"value": itl}}}))
    (d / "profile_export.jsonl").write_text("\n".join(lines) + "\n")
    return d


def test_stream_per_token_is_not_bunched(tmp_path):
    # 32 tokens, 32 chunks (31 gaps of 5 ms): one token per chunk.
    d = _write_stream_point(tmp_path / "p", [(32, [5.0] * 31, 20.0, 20.0 + 31 * 5.0)] * 4)
    st = summary.judge_stream(summary.stream_shape(d))
    assert st["chunks_per_request"] == 32 and st["tokens_per_chunk"] == 1.0
    assert st["bunched"] is False and st["note"] is None
    assert st["itl_p50"] == pytest.approx(5.0)


def test_stream_interval_8_is_bunched(tmp_path):
    # --stream-interval 8: 32 tokens arrive as 1 + 4 chunks (first token alone, then 8s).
    d = _write_stream_point(tmp_path / "p", [(32, [40.0, 40.0, 40.0, 35.0], 20.0, 175.0)] * 4)
    st = summary.judge_stream(summary.stream_shape(d))
    assert st["chunks_per_request"] == 5 and st["tokens_per_chunk"] == pytest.approx(6.4)
    assert st["bunched"] is True
    assert st["note"].startswith("stream bunched: ITL/TTFT not per token: 6.40 tokens per chunk")


def test_one_burst_with_itl_zero_is_bunched(tmp_path):
    # All 32 tokens in one chunk right after the first token: ITL p50 ~0.
    d = _write_stream_point(tmp_path / "p", [(32, [0.05], 329.0, 329.1)] * 3)
    st = summary.judge_stream(summary.stream_shape(d))
    assert st["bunched"] and "ITL p50 0.0032 ms with 32 output tokens" in st["note"]


def test_speculative_decoding_allows_a_step_worth_of_tokens_per_chunk(tmp_path):
    # MTP k=2: up to 3 tokens per step; 2.5 tokens per chunk is per step, not bunched.
    d = _write_stream_point(tmp_path / "p", [(30, [6.0] * 11, 20.0, 86.0)] * 2)
    server = {"server_argv": ["vllm", "serve", "/m", "--speculative-config",
                              '{"method":"mtp","num_speculative_tokens":2}']}
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
    assert pts[0]["stream"]["bunched"]
    md = summary.markdown_report(pts, "t", [])
    assert "(stream bunched)" in md and "**c=1: stream bunched: ITL/TTFT not per token" in md
