"""`make demo` (the README's first command after set-up): end to end on the CPU stand-in (its
`make census` is the live census of a stock server: counts per engine step), SIGTERM while
serving (make down, exit 130), and bad input / a busy port (one line, exit 2)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    REPO,
    clean_env,
    free_port,
    make,
    make_exit_code,
    only_dir,
    project_containers,
    run_cli,
)
from server_fixture import MODELS_DIR, SMOKE_MODEL

from k3rocm.dev.demo import GSM8K_ITEMS, STANDIN_BASE, STEPS

SERVER_IMAGE = "k3rocm/server:cpu"  # compose.cpu.yaml's K3_IMAGE default
# lighter than the defaults: one bench point (the 2-point claims: test_bench_standin.py's
# `make bench`), a census of 2 streams with 24 tokens left when profiling starts (> 6 steps)
LIGHT = ("--bench-args '--set concurrency=1 --set request_count=3 --set warmup_request_count=1'"
         " --census-args '--concurrency 2 --max-tokens 48 --steps 6'")


# ------------------------------------------------------------------------ fast, no Docker


def test_help_lists_the_steps_and_the_targets(k3):
    p = k3("demo", "--help")
    assert p.returncode == 0, p.stderr
    for target in ("make tinymodel", "make up CPU=1", "make bench WORKLOAD=ci-tiny",
                   "make gsm8k", "make census", "make down CPU=1"):
        assert target in p.stdout, target


@pytest.mark.parametrize("args, fragment", [
    (["--port", "70000"], "--port 70000 is not a port"),
    (["--project", "Not A Name"], "is not a compose project name"),
    (["--gsm8k-data", "/nonexistent-k3"], "has no train.jsonl"),
    (["--bench-args", "'unclosed"], "--bench-args"),
])
def test_bad_input_is_one_line_exit_2(k3, tmp_path, args, fragment):
    p = k3("demo", "--results", str(tmp_path / "r"), *args)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert fragment in p.stderr
    assert not (tmp_path / "r").exists()  # nothing started, no run directory


def test_no_docker_engine_is_exit_3(tmp_path):
    """The exit-code table: no Docker engine is a server/engine problem (3), not bad input
    (through the real entry point; the other cases run in-process)."""
    p = run_cli("demo", "--results", str(tmp_path / "r"),
                env={"DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"})
    assert p.returncode == 3, p.stdout + p.stderr
    assert "no Docker engine answers" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("args", [[], ["everything"]])
def test_setup_script_needs_ci_or_demo(args):
    p = subprocess.run(["bash", str(REPO / ".ci" / "setup.sh"), *args], capture_output=True,
                       text=True, timeout=30)
    assert p.returncode == 2 and p.stderr.startswith("usage: .ci/setup.sh ci|demo"), p.stderr
    assert p.stdout == ""  # nothing done


def test_bundled_items_are_gsm8ks_first_items():
    from k3rocm.checks.gsm8k import data

    src = data.resolve(str(GSM8K_ITEMS), None)  # the same check `make gsm8k` applies
    assert src.test_items == 5
    rows = [json.loads(ln) for ln in (GSM8K_ITEMS / "test.jsonl").read_text().splitlines()]
    # openai/grade-school-math test.jsonl, items 1-5: Janet's ducks, the robe, Josh's house,
    # James's sprints, Wendi's chickens.
    assert [r["answer"].rsplit("#### ", 1)[1] for r in rows] == ["18", "3", "70000", "540", "20"]
    assert rows[0]["question"].startswith("Janet\u2019s ducks lay 16 eggs per day.")
    train = (GSM8K_ITEMS / "train.jsonl").read_text().splitlines()
    assert len(train) >= 5  # 5-shot examples come from the train split


# --------------------------------------------------------------------------- with Docker


@pytest.mark.docker
def test_busy_port_is_refused_before_anything_starts(docker_client, tmp_path, k3):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        p = k3("demo", "--port", str(port), "--results", str(tmp_path / "r"),
               "--project", "k3rocm-demo-busy")
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"port {port} on 127.0.0.1 is in use" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "r").exists()
    assert project_containers("k3rocm-demo-busy") == []


@pytest.mark.docker
@pytest.mark.server
def test_make_demo_end_to_end(docker_client, tmp_path):
    port, project, results = free_port(), "k3rocm-demo-test", tmp_path / "results"
    t0 = time.monotonic()
    p = make("demo", f"DEMO_ARGS=--port {port} --project {project} --results {results} "
             f"--models-dir {MODELS_DIR} {LIGHT}", timeout=1500)
    wall = time.monotonic() - t0
    print(f"make demo: {wall:.0f}s\n{p.stdout}\n{p.stderr[-4000:]}", file=sys.stderr)
    assert make_exit_code(p) == 0, p.stdout + p.stderr[-4000:]
    assert "Traceback" not in p.stderr
    assert p.stdout.startswith("k3rocm demo: OK in "), p.stdout
    assert project_containers(project) == []  # make down removed what make up started

    demo = only_dir(results, "-demo")
    summary = json.loads((demo / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["exit_code"] == 0
    steps = {s["name"]: s for s in summary["steps"]}
    assert [s["name"] for s in summary["steps"]] == list(STEPS)
    assert all(s["ok"] for s in summary["steps"]), summary["steps"]
    for name in ("model", "up", "bench", "gsm8k", "census", "down"):
        assert Path(steps[name]["log"]).is_file(), name
        assert "make --no-print-directory" in steps[name]["command"], name
    # The summary links every run directory, and the stdout summary prints those links.
    bench, gsm8k, census = (only_dir(results, s) for s in ("-ci-tiny", "-gsm8k", "-census"))
    log = only_dir(results, "-server-log") / "server.log"
    assert steps["bench"]["run_dir"] == str(bench)
    assert steps["gsm8k"]["run_dir"] == str(gsm8k)
    assert steps["census"]["run_dir"] == str(census)
    assert steps["down"]["run_dir"] == str(log)
    for path in (bench, gsm8k, census, log, demo):
        assert f"{path}" in p.stdout  # outside the checkout: printed as absolute paths

    # Our image, built FROM the stand-in base by compose.
    img = docker_client.images.get(SERVER_IMAGE)
    assert img.labels.get("org.opencontainers.image.base.name") == STANDIN_BASE
    # Served through our entrypoint with the cpu-smoke profile and the profiler armed.
    text = log.read_text()
    assert "k3rocm: profile cpu-smoke" in text and "k3rocm: exec vllm serve" in text
    assert f"K3_PROFILER_DIR=/results/{demo.name}/traces" in text

    b = json.loads((bench / "summary.json").read_text())
    assert b["status"] == "ok", b.get("status")
    assert [pt["concurrency"] for pt in b["points"]] == [1]
    assert all(pt["status"] == "ok" for pt in b["points"])
    prov = json.loads((bench / "provenance.json").read_text())
    assert SERVER_IMAGE in json.dumps(prov["server"])

    g = json.loads((gsm8k / "summary.json").read_text())
    # random weights: the run happens and is scored, and it is below the gate
    assert g["status"] == "below_gate" and g["exit_code"] == 1
    assert g["items"]["evaluated"] == 5 and not g["comparable"]
    assert steps["gsm8k"]["numbers"]["status"] == "below_gate"

    assert steps["census"]["numbers"]["ok"] is True
    _census_of_the_stock_server(census, demo, Path(steps["census"]["log"]), tmp_path)


def _census_of_the_stock_server(run_dir: Path, demo: Path, log: Path, tmp_path: Path) -> None:
    """`make census` on the demo's stock cpu-smoke server: the real trace's counts per engine
    step, collected from the results volume; the same traces claimed "q/kv norm on" fail."""
    data = json.loads((run_dir / "census.json").read_text())
    assert data["ok"] is True and data["verdict"] == "PASS"
    layers = json.loads((MODELS_DIR / SMOKE_MODEL / "config.json").read_text())[
        "num_hidden_layers"]
    assert data["model"]["mla_layers"] == layers
    rank0 = data["ranks"][0]
    assert rank0["mode"] == "cpu" and rank0["steps"] == 6 and rank0["decode_steps"] >= 1
    steps = rank0["steps"]
    # the stock MLA layer's KV-cache write once per layer and step; the native RMSNorm (one
    # aten::rsqrt each) 4x per layer (input, post, q_a, kv_a) + the final norm
    per_step = rank0["per_step"]
    assert all(s.get("vllm::unified_mla_kv_cache_update") == layers for s in per_step)
    assert all(s.get("aten::rsqrt") == 4 * layers + 1 for s in per_step)
    sep = next(c for c in data["checks"] if c["role"] == "qk_norm")
    assert (sep["expected"], sep["seen"], sep["status"]) == (2 * layers * steps,) * 2 + ("ok",)
    assert data["provenance"]["server"]["container"]["image_id"]
    # the server's argv/env as `k3rocm serve` rendered them in the container, not from /proc
    assert "/tmp/k3rocm-rendered.json" in data["provenance"]["server_settings_from"]
    assert data["provenance"]["load"]["prefill_s"] >= 0
    assert list((run_dir / "traces").glob("*.pt.trace.json.gz"))
    # collected from the results volume on the host (the server container's bind mount)
    assert list((demo / "traces").glob("*.pt.trace.json.gz"))
    assert "from " + str(demo / "traces") in log.read_text()

    # The same real traces claimed as "q/kv norm on" fail: the counts and the missing records.
    q = run_cli("census", "--trace-dir", str(run_dir / "traces"), "--model-dir",
                str(MODELS_DIR / SMOKE_MODEL), "--fusions", "qk_norm=on,decode_qprep=off",
                "--world-size", "1", "--results", str(tmp_path / "claimed"))
    assert q.returncode == 1, q.stdout + q.stderr
    rows = [ln for ln in q.stdout.splitlines() if " FAIL " in ln
            and not ln.startswith("census:")]
    # the records row, the fused and stock counts, the steps off the asked path, the verdict
    assert len(rows) == 5, rows
    assert any("the overlay did not run" in r for r in rows)
    assert any(r.startswith("engine steps off the asked q/kv RMSNorm path") for r in rows)
    assert any(r.startswith("q/kv RMSNorm fusion (qk_norm asked on): both halves")
               for r in rows)
    fused = next(r for r in rows if "fused q/kv RMSNorm launches" in r)
    assert f" {layers * steps} " in fused and " 0 " in fused
    assert any("stock q/kv RMSNorm launches" in r for r in rows)


@pytest.mark.docker
@pytest.mark.server
def test_sigterm_while_serving_stops_the_server(docker_client, tmp_path):
    port, project, results = free_port(), "k3rocm-demo-term", tmp_path / "results"
    proc = subprocess.Popen([sys.executable, "-m", "k3rocm", "demo", "--port", str(port),
                             "--project", project, "--results", str(results), "--models-dir",
                             str(MODELS_DIR)], cwd=REPO, env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        # SIGTERM once `make up` has started the server and waits for it (its "waiting up to"
        # line): a container alone may still be inside `compose up -d`, not yet serving.
        deadline = time.monotonic() + 600
        while not any("waiting up to" in f.read_text(errors="replace")
                      for f in results.glob("*-demo/logs/*-up.log")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "`make up` not waiting after 600 s"
            time.sleep(1)
        assert project_containers(project)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out + err[-3000:]
    assert "Traceback" not in err
    assert out.startswith("k3rocm demo: INTERRUPTED"), out
    assert project_containers(project) == []
    demo = only_dir(results, "-demo")
    summary = json.loads((demo / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["exit_code"] == 130
    names = [s["name"] for s in summary["steps"]]
    assert names[-1] == "down" and summary["steps"][-1]["ok"], summary["steps"]
    assert "up" in names and not any(n in names for n in ("bench", "gsm8k", "census"))
    assert (only_dir(results, "-server-log") / "server.log").is_file()
