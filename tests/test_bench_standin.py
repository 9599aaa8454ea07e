"""Bench end to end: real aiperf (client image) against real vLLM (the CPU stand-in server):
`make bench`, a bunched stream, a stopped server and one-line errors (bench-ab live:
test_bench_ab_standin.py; Ctrl-C: test_bench_unit.py)."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, clean_env, free_port, make, make_exit_code, only_dir
from server_fixture import start_server

pytestmark = [pytest.mark.docker, pytest.mark.server]

# Engine steps at least this far apart on the session server: a loaded 2-core machine must not
# deschedule the API server for a whole step (two steps would leave in one chunk).
STEP_MS = 30


def png_ok(path: Path) -> tuple[int, int]:
    """A PNG that Pillow verifies (every chunk's CRC), larger than 200x150; returns its size."""
    from PIL import Image

    with Image.open(path) as im:
        assert im.format == "PNG", path
        im.verify()
        size = im.size
    assert size[0] > 200 and size[1] > 150, size
    return size


def recompute(point_dir: Path) -> dict:
    """The summary's numbers from aiperf's per-request records, independently of the product."""
    import numpy as np

    recs = [json.loads(ln) for ln in (point_dir / "profile_export.jsonl").read_text().splitlines()
            if ln.strip()]
    prof = [r["metrics"] for r in recs if r["metadata"]["benchmark_phase"] == "profiling"
            and not r.get("error")]
    out: dict = {"n": len(prof)}
    for key, tag in (("ttft", "time_to_first_token"), ("itl", "inter_token_latency"),
                     ("e2el", "request_latency"), ("tps_user", "output_token_throughput_per_user"),
                     ("icl", "inter_chunk_latency")):
        vals = np.hstack([m[tag]["value"] for m in prof if tag in m] or [[]])
        if len(vals):  # tokens/s per user needs ITL > 0
            out[key] = {"avg": float(vals.mean()),
                        **{f"p{q}": float(np.percentile(vals, q)) for q in (50, 90, 99)}}
    ph = next(p for p in json.loads((point_dir / "phase_manifest.json").read_text())["phases"]
              if p["phase_kind"] == "profiling")
    dur = (ph["end_ns"] - ph["start_ns"]) / 1e9
    osl = sum(m["output_sequence_length"]["value"] for m in prof)
    isl = sum(m["input_sequence_length"]["value"] for m in prof)
    out["output_tps"], out["total_tps"] = osl / dur, (osl + isl) / dur
    return out


def test_make_bench_scaled_down_against_the_standin(standin_server, client_image, tmp_path):
    s = standin_server
    args = (f"--url {s.base_url} --model {s.model} --tokenizer {s.tokenizer_path} "
            f"--results {tmp_path} --server-timeout 120 --set request_count=3,4 "
            "--set warmup_request_count=1")
    with s.slowed(STEP_MS):
        p = make("bench", "WORKLOAD=ci-tiny", f"BENCH_ARGS={args}", timeout=600)
    assert make_exit_code(p) == 0, p.stderr[-4000:]
    assert "Traceback" not in p.stderr
    run = only_dir(tmp_path)
    last = p.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"bench ci-tiny: 2 of 2 points ok( \(stream bunched: [^)]*\))?; "
                        rf"results in {re.escape(str(run))}", last), last
    for rel in ("summary.json", "perf.csv", "report.md", "provenance.json", "command.txt",
                "workload.json", "aiperf.log"):
        assert (run / rel).is_file(), rel
    for point in ("concurrency_1__requests_3", "concurrency_2__requests_4"):
        for rel in ("profile_export.jsonl", "profile_export_aiperf.json", "phase_manifest.json"):
            assert (run / "aiperf" / point / rel).is_file(), f"{point}/{rel}"

    doc = json.loads((run / "summary.json").read_text())
    assert doc["status"] == "ok" and doc["aiperf_exit_code"] == 0
    assert [(q["concurrency"], q["request_count"], q["status"]) for q in doc["points"]] == [
        (1, 3, "ok"), (2, 4, "ok")]
    for q in doc["points"]:
        ref = recompute(Path(q["dir"]))
        assert ref["n"] == q["request_count"] == q["requests_ok"]
        assert set(q["metrics"]) == set(ref) & {"ttft", "itl", "e2el", "icl", "tps_user"}
        assert {"ttft", "itl", "e2el", "icl"} <= set(q["metrics"])
        for key, stats in q["metrics"].items():
            assert stats == pytest.approx(ref[key], rel=1e-9, abs=1e-9), key
        assert q["output_tps"] == pytest.approx(ref["output_tps"], rel=1e-9)
        assert q["total_tps"] == pytest.approx(ref["total_tps"], rel=1e-9)
        assert q["jsonl_check"]["ok"] and q["jsonl_check"]["compared"] == 4 * len(q["metrics"]) + 2
        assert q["osl_avg"] == 32  # ignore_eos + min/max tokens, counted by the server
        # Per-token streaming (<= 1.1 tokens per chunk: a loaded machine merges a step now and
        # then); ITL > the step; a chunk never splits a step; E2E - TTFT = (OSL - 1) x ITL.
        st = q["stream"]
        assert st["bunched"] is False and st["tokens_per_chunk"] <= 1.1, st
        assert q["metrics"]["itl"]["p50"] > STEP_MS, q["metrics"]["itl"]
        assert q["metrics"]["icl"]["p50"] > STEP_MS * 0.9, q["metrics"]["icl"]
        assert st["gen_ms_p50"] == pytest.approx((st["osl_avg"] - 1) * st["itl_p50"], rel=0.2)
        if q["concurrency"] == 1:  # one stream: one chunk per token, chunk gap = token gap
            assert q["osl_avg"] / 1.1 <= st["chunks_p50"] <= q["osl_avg"], st
            assert q["metrics"]["icl"]["p50"] == pytest.approx(q["metrics"]["itl"]["p50"],
                                                               rel=0.5)

    with (run / "perf.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0])[:11] == ["model", "benchmark", "tp", "inp", "out", "num_prompts",
                                  "max_concurrency", "cmd", "performance", "metric", "unit"]
    assert len(rows) == 12 and {r["status"] for r in rows} == {"ok"}
    by = {(r["max_concurrency"], r["metric"]): r for r in rows}
    assert float(by[("1", "median_tpot")]["performance"]) == pytest.approx(
        doc["points"][0]["metrics"]["itl"]["p50"], rel=1e-5)
    assert float(by[("2", "throughput_gen")]["performance"]) == pytest.approx(
        doc["points"][1]["output_tps"], rel=1e-5)
    assert by[("1", "median_ttft")]["unit"] == "ms"
    assert {(r["inp"], r["out"], r["benchmark"], r["model"]) for r in rows} == {
        ("64", "32", "ci-tiny", s.model)}
    assert all(r["cmd"] == (run / "command.txt").read_text().strip() for r in rows)
    for png in ("latency_vs_concurrency.png", "throughput_vs_interactivity.png"):
        png_ok(run / png)

    prov = json.loads((run / "provenance.json").read_text())
    srv = prov["server"]
    assert srv["vllm_version"] and srv["container"]["image_id"].startswith("sha256:")
    assert srv["container"]["env"]["K3_PROFILE"] == "cpu-smoke"
    argv = srv["rendered"]["argv"]  # as the entrypoint rendered it
    assert argv[:2] == ["vllm", "serve"] and argv[argv.index("--served-model-name") + 1] == s.model
    assert srv["overlay_manifest"] is not None, srv.get("overlay_manifest_note")
    assert set(srv["fusion_toggles"]) == {"K3_FUSE_QK_NORM", "K3_FUSE_DECODE_QPREP"}
    assert "/tmp/k3rocm-rendered.json" in doc["server_settings_from"]
    assert prov["client"]["aiperf_version"] == "0.13.0"
    assert prov["client"]["image_id"].startswith("sha256:")
    assert prov["client"]["command_line"] == (run / "command.txt").read_text().strip()
    md = (run / "report.md").read_text()
    assert "## concurrency 1 (3 requests): ok" in md and "| ITL (TPOT) (ms) |" in md
    assert "all equal" in md
    # prefix caching as the server reported it: asked on (cpu-smoke), turned off by vLLM for
    # MLA on CPU (vllm/platforms/cpu.py:521), not "on" from the argv
    assert "--enable-prefix-caching" in argv and doc["prefix_caching"]["server"] is False
    assert "MLA is enabled on a non-GPU platform" in doc["prefix_caching"]["server_from"]
    assert "prefix caching: workload any, server off (the server's own report (" in md
    assert "graphs: cudagraph_mode NONE, enforce_eager True, none captured" in md


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float) -> None:
    t0 = time.monotonic()
    while not path.exists():
        assert proc.poll() is None, f"bench ended early: {proc.communicate()}"
        assert time.monotonic() - t0 < timeout, f"{path} did not appear"
        time.sleep(0.1)


def test_bunched_stream_and_stopped_server(docker_client, client_image, tmp_path):
    """One server with `--stream-interval 8`, one run of two points: the first point is marked
    "stream bunched"; the server stopped during the second point gives one line, exit 1, the
    first point kept. "During": once the first point's summary exists the engine is held, and
    the server stops once a request of point 2 is held. Point 2 has 100 requests: it cannot
    finish before the hold is set. (Ctrl-C keeping the finished points: test_bench_unit.py's
    interrupted run on the real runner; a real client container stopped by Ctrl-C:
    test_gsm8k_e2e.py, the same run_client.)"""
    srv = start_server(docker_client, name=f"k3bench-test-fail-{os.getpid()}", hold=True,
                       env={"K3_EXTRA_ARGS": "--stream-interval 8"})
    results = tmp_path / "stopped"
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "k3rocm", "bench", "--workload", "ci-tiny", "--quiet",
             "--url", srv.base_url, "--model", srv.model, "--tokenizer", str(srv.tokenizer_path),
             "--set", "concurrency=1,2", "--set", "request_count=2,100",
             "--set", "warmup_request_count=1",  # without a warmup aiperf writes no manifest
             "--results", str(results)], cwd=REPO, env=clean_env(), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        _wait_for(results, proc, 60)
        run = only_dir(results)
        _wait_for(run / "aiperf" / "concurrency_1__requests_2" / "profile_export_aiperf.json",
                  proc, 240)
        with srv.hold() as wait_held:
            wait_held(proc)  # a request of point 2 is in the engine and cannot finish
            srv.container.stop(timeout=1)
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 1, err[-3000:]
        assert "Traceback" not in err
        errs = [ln for ln in err.splitlines() if ln.startswith("k3rocm: error:")]
        assert len(errs) == 1, err[-3000:]
        assert errs[0].startswith("k3rocm: error: bench ci-tiny: 1 of 2 points failed (c=2: ")
        assert "the server is no longer reachable" in errs[0]
        assert f"raw logs and finished points kept in {run}" in errs[0]
        doc = json.loads((run / "summary.json").read_text())
        assert doc["status"] == "failed" and doc["server_reachable_after"] is False
        p1, p2 = doc["points"]
        assert p1["status"] == "ok" and p1["jsonl_check"]["ok"]
        assert p2["status"] == "failed" and p2["reason"]
        with (run / "perf.csv").open() as fh:
            failed = [r for r in csv.DictReader(fh) if r["max_concurrency"] == "2"]
        assert len(failed) == 6 and all(r["status"].startswith("failed") for r in failed)
        assert all(r["performance"] == "" for r in failed)
        report = (run / "report.md").read_text()
        assert "**FAILED**" in report
        # the first point is marked bunched: 32 tokens, the first alone, then up to 8 per
        # chunk: 5 chunks (the bound allows one more); fewer where the API server merged chunks it
        # was late to send (3.5 per request in a loaded 3-worker CI run); the claim is the mark
        st = p1["stream"]
        assert st["bunched"] is True and 2 <= st["chunks_per_request"] <= 6, st
        assert st["note"].startswith("stream bunched: ITL/TTFT not per token: "), st
        assert "WARNING c=1: stream bunched: ITL/TTFT not per token" in err
        assert "(stream bunched)" in report
        assert "--stream-interval 8" in " ".join(json.loads(
            (run / "provenance.json").read_text())["server"]["rendered"]["argv"])
        assert not [c.name for c in docker_client.containers.list(
            all=True, filters={"label": "k3rocm.bench=client"}) if run.name in c.name]
    finally:
        srv.stop()


@pytest.mark.parametrize("case", ["unreachable", "client-image", "model"])
def test_bad_server_or_image_is_one_line(standin_server, client_image, tmp_path, k3, case):
    """Nothing listening (said at once, not after --server-timeout): exit 3; a missing client
    image: exit 2; a model the server does not serve: exit 3. Nothing is written. In-process:
    the real `python -m k3rocm bench` runs in the tests around it."""
    s = standin_server
    args = ["--workload", "ci-tiny", "--url", s.base_url, "--model", s.model, "--tokenizer",
            str(s.tokenizer_path), "--results", str(tmp_path / "r")]
    code, want = 3, (f"server at {s.base_url} does not serve model 'nope'; it serves {s.model}")
    if case == "unreachable":
        args[3], want = f"http://127.0.0.1:{free_port()}", "nothing listening at http://127.0.0.1:"
        args += ["--server-timeout", "2"]
    elif case == "client-image":
        args += ["--client-image", "k3rocm/clients:does-not-exist"]
        code, want = 2, "client image 'k3rocm/clients:does-not-exist' not found: build it with "
    else:
        args[5] = "nope"
    p = k3("bench", "--quiet", *args)
    assert p.returncode == code, p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("k3rocm: error: " + want), p.stderr
    assert case != "unreachable" or "connection refused" in p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "r").exists()


def test_aiperf_error_is_one_line_exit_1_and_keeps_the_log(standin_server, client_image, tmp_path):
    s = standin_server
    p = subprocess.run([sys.executable, "-m", "k3rocm", "bench", "--quiet", "--workload",
                        "ci-tiny", "--url", s.base_url, "--model", s.model, "--tokenizer",
                        str(s.tokenizer_path), "--results", str(tmp_path), "--set",
                        "extra_args=--no-such-aiperf-flag"], cwd=REPO, env=clean_env(),
                       capture_output=True, text=True, timeout=300)
    assert "Traceback" not in p.stderr
    assert p.returncode == 1, p.stderr[-2000:]
    errs = [ln for ln in p.stderr.splitlines() if ln.startswith("k3rocm: error:")]
    assert len(errs) == 1 and "2 of 2 points failed (aiperf exited with" in errs[0], errs
    assert "Unknown option: --no-such-aiperf-flag" in errs[0]
    run = only_dir(tmp_path)
    assert (run / "aiperf.log").stat().st_size > 0
    doc = json.loads((run / "summary.json").read_text())
    assert doc["status"] == "failed" and doc["aiperf_exit_code"] != 0
    assert [q["status"] for q in doc["points"]] == ["failed", "failed"]
