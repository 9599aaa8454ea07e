"""`make selftest`: the real serving path (our Dockerfile FROM the stand-in base, compose.yaml +
compose.cpu.yaml, entrypoint.sh) on the tiny model, in its own compose project and port:
build + base check, serve, census, greedy tokens, a bench point, a second server with the
fusions off, greedy again, compare. Bad input and a setting the base cannot run stop before
any server starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from conftest import (
    REPO,
    default_sigint,
    free_port,
    make_exit_code,
    project_containers,
    run_cli,
    standin_tag,
)
from server_fixture import MODELS_DIR, ensure_smoke_model

from k3rocm.checks.selftest import GREEDY_TOKENS, compare

PROJECT = "k3rocm-selftest-test"



# ------------------------------------------------------------------------ no Docker needed


def test_compare_names_the_first_difference():
    on = [{"prompt": "a", "tokens": ["x", "y", "z"], "logprobs": [-0.1, -0.2, -0.3]},
          {"prompt": "b", "tokens": ["p", "q"], "logprobs": [-1.0, -2.0]}]
    same = compare(on, json.loads(json.dumps(on)))
    assert same["identical"] and same["max_logprob_gap"] == 0.0
    off = [{"prompt": "a", "tokens": ["x", "w", "z"], "logprobs": [-0.1, -0.9, -0.3]},
           on[1]]
    c = compare(on, off)
    assert not c["identical"]
    assert c["first_differences"] == [{"prompt": "a", "position": 1, "on": ["y"], "off": ["w"],
                                       "logprob_on": -0.2, "logprob_off": -0.9}]
    assert c["max_logprob_gap"] == pytest.approx(0.7)
    assert compare(on, [on[0], {**on[1], "tokens": ["p"]}])["first_differences"][0][
        "position"] == 1  # a shorter answer differs where it ends


@pytest.mark.parametrize("args,fragment", [
    (["--timeout", "0"], "--timeout 0 must be > 0"),
    (["--port", "70000"], "must be 1..65535"),
    (["--model", "/elsewhere/ckpt"], "not under K3_MODELS_DIR"),
    (["--bench-args", "'unclosed"], "--bench-args"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, args, fragment):
    p = run_cli("selftest", "run", *args, env={"K3_RESULTS_DIR": str(tmp_path / "r"),
                                               "COMPOSE_FILE": "compose.yaml:compose.cpu.yaml",
                                               "K3_PROFILE": "cpu-smoke"})
    assert p.returncode == 2, p.stdout + p.stderr
    assert fragment in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "r").exists()  # nothing started, no run directory


# ------------------------------------------- the A/B's arms against the image's base facts


@pytest.fixture
def seed_node(tmp_path, monkeypatch):
    """A node (compose.yaml alone, AITER on) whose serving image's manifest holds the seed
    nightly's base facts, measured from the real vLLM 0.27.1 sources; every compose call
    recorded (none may happen before the base check)."""
    import shutil

    from conftest import image_base_facts

    from k3rocm.deploy import config_cmd
    from k3rocm.deploy.lifecycle import ComposeServer

    facts = image_base_facts("0.27.1")  # the real release with the overlay applied
    monkeypatch.setattr(config_cmd, "image_base_facts",
                        lambda image: (facts, f"{image} (sha256:0123456789ab) manifest"))
    calls: list[tuple] = []
    monkeypatch.setattr(ComposeServer, "compose", lambda self, *a, **kw: calls.append(a))
    monkeypatch.setattr(ComposeServer, "up", lambda self, *a, **kw: calls.append(("up",)))
    for k in [k for k in os.environ if k.startswith("K3_")]:
        monkeypatch.delenv(k)
    models = tmp_path / "models"
    (models / "Kimi-K3-selftest").mkdir(parents=True)
    shutil.copy(REPO / "tests/data/census/models/tiny-deepseek-v3/config.json",
                models / "Kimi-K3-selftest")
    monkeypatch.setenv("COMPOSE_FILE", "compose.yaml")
    monkeypatch.setenv("K3_MODELS_DIR", str(models))
    monkeypatch.setenv("K3_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.chdir(tmp_path)
    return calls


def test_selftest_on_the_seed_base_is_refused_before_the_build(seed_node, tmp_path, capsys):
    """`make selftest` serves the A/B's two arms; on the seed nightly arm B (decode Q-prep on)
    cannot be served: the same one line as the A/B, exit 2, before the build, any server or
    the run directory. Old code: built, served the defaults (the base quietly turned Q-prep
    off) and stayed green."""
    from k3rocm.cli import main

    code = main(["selftest", "run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith(
        "k3rocm: error: arm B (K3_FUSE_DECODE_QPREP=1 K3_FUSE_QK_NORM=1) cannot be served by "
        "this base (vLLM 0.27.1"), err
    assert "needs an fp8 KV cache" in err[0] and "--on qk_norm" in err[0]
    assert seed_node == [] and not (tmp_path / "results").exists()


def test_selftest_serves_the_abs_arms(seed_node):
    """The selftest's servers are the A/B's arms (one builder): fusions-on = arm B of --on,
    fusions-off = arm A; with the --on the seed base offers, both pass its check."""
    import argparse

    from k3rocm.checks import selftest
    from k3rocm.checks.ab.arms import arm_envs

    args = argparse.Namespace(timeout=10, bench_args="", census_args="", env_file=".env",
                              model=None, port=None, project="k3selftest-t", on="qk_norm")
    dep, srv, arms = selftest._plan(args)
    assert not dep.cpu and arms == arm_envs("qk_norm")
    assert srv.env["K3_FUSE_QK_NORM"] == "1" and srv.env["K3_FUSE_DECODE_QPREP"] == "0"
    base = selftest.base_check(dep, srv, arms, ".env")
    assert sorted(base["arms"]) == ["A", "B"] and base["vllm_version"] == "0.27.1"
    assert seed_node == []


# ------------------------------------------------------------------- the real serving path


def _selftest(client, tmp_path, port: int, *extra: str, env: dict | None = None,
              timeout: float = 900) -> subprocess.CompletedProcess:
    ensure_smoke_model(client, standin_tag())
    args = " ".join(["--port", str(port), "--project", PROJECT, *extra])
    return subprocess.run(
        ["make", "-s", "--no-print-directory", "-o", sys.executable, "selftest",
         f"PY={sys.executable}", "CPU=1", f"SELFTEST_ARGS={args}"],
        cwd=REPO, capture_output=True, text=True, timeout=timeout,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("K3_")},
             "PYTHONPATH": str(REPO / "src"), "K3_MODELS_DIR": str(MODELS_DIR),
             "K3_RESULTS_DIR": str(tmp_path / "results"), **(env or {})})


@pytest.mark.docker
@pytest.mark.server
def test_make_selftest_on_the_standin(docker_client, tmp_path):
    port = free_port()
    p = _selftest(docker_client, tmp_path, port)
    print(p.stdout[-4000:], p.stderr[-3000:])
    assert make_exit_code(p) == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (run,) = [d for d in (tmp_path / "results").iterdir() if d.name.endswith("-selftest")]
    s = json.loads((run / "summary.json").read_text())
    assert s["status"] == "ok" and s["cpu_standin"] is True
    assert [st["name"] for st in s["steps"]] == ["build", "up", "census", "greedy", "bench",
                                                 "down", "off", "compare"]
    assert all(st["ok"] for st in s["steps"]), s["steps"]
    census = next(st for st in s["steps"] if st["name"] == "census")
    assert census["numbers"]["ok"] is True and census["numbers"]["mla_layers"] == 2
    assert s["greedy"]["identical"] and s["greedy"]["prompts"] == 4
    assert all(len(g["tokens"]) == GREEDY_TOKENS for g in s["greedy"]["on"])
    bench = next(st for st in s["steps"] if st["name"] == "bench")
    assert bench["numbers"]["points"][0]["status"] == "ok"
    for log in ("server-on.log", "server-off.log"):
        assert "k3rocm: exec vllm serve" in (run / log).read_text()
    # the second server really ran with the fusions off, the first as asked
    assert "K3_FUSE_QK_NORM=0  [env]" in (run / "server-off.log").read_text()
    assert (run / "summary.md").read_text().startswith("```\nk3rocm selftest: OK")
    assert project_containers(PROJECT) == []  # everything it started is gone


@pytest.mark.docker
def test_a_setting_the_base_cannot_run_stops_before_any_server(docker_client, tmp_path):
    """AITER on, and the fusions switched off on a base whose vLLM (0.32.0, the CPU stand-in's)
    ships them, with K3_OVERLAY=off at run time: that disables the k3rocm plugin whose hook
    switches upstream's fusions, so the switch would do nothing and the base check refuses it
    after the build and before any server starts (without K3_OVERLAY=off the hook serves it)."""
    p = _selftest(docker_client, tmp_path, free_port(), "--no-build",
                  env={"VLLM_ROCM_USE_AITER": "1", "K3_OVERLAY": "off"}, timeout=300)
    # k3rocm's 2 (bad input), not make's 2 (any failed recipe)
    assert make_exit_code(p) == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert "K3_FUSE_QK_NORM=0 cannot take effect on this base" in p.stderr
    assert "unset K3_OVERLAY" in p.stderr
    assert project_containers(PROJECT) == []


@pytest.mark.docker
@pytest.mark.server
def test_ctrl_c_during_the_census_stops_everything_and_keeps_what_finished(docker_client,
                                                                           tmp_path):
    """Ctrl-C as a terminal sends it (SIGINT to the whole foreground process group: make and
    k3rocm) while the census step runs against the first server: exit 130 recorded, the
    finished steps and the server log kept, the server and its project gone."""
    ensure_smoke_model(docker_client, standin_tag())
    project = PROJECT + "-int"
    args = " ".join(["--port", str(free_port()), "--project", project, "--no-build"])
    proc = subprocess.Popen(
        ["make", "-s", "--no-print-directory", "-o", sys.executable, "selftest",
         f"PY={sys.executable}", "CPU=1", f"SELFTEST_ARGS={args}"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True, preexec_fn=default_sigint,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("K3_")},
             "PYTHONPATH": str(REPO / "src"), "K3_MODELS_DIR": str(MODELS_DIR),
             "K3_RESULTS_DIR": str(tmp_path / "results")})
    seen = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # the step runner announces each step as it starts
            seen.append(line)
            if "3/8 census:" in line:
                break
        else:
            pytest.fail("selftest ended before its census step:\n" + "".join(seen[-40:]))
        os.killpg(proc.pid, signal.SIGINT)
        rest = proc.stderr.read()
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    (run,) = [d for d in (tmp_path / "results").iterdir() if d.name.endswith("-selftest")]
    s = json.loads((run / "summary.json").read_text())
    assert s["status"] == "interrupted" and s["exit_code"] == 130, s
    steps = {st["name"]: st for st in s["steps"]}
    assert steps["build"]["ok"] and steps["up"]["ok"], s["steps"]
    assert "k3rocm: exec vllm serve" in (run / "server-on.log").read_text()
    assert "INTERRUPTED" in (run / "summary.md").read_text()
    assert "Traceback" not in "".join(seen) + rest
    assert project_containers(project) == []
