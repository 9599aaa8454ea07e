"""`k3rocm selftest run` / `make selftest`: the logprob comparison, what is refused before any
build or server, the steps' exit codes (faked servers), and the real serving path on the
CPU stand-in."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
from conftest import (
    REPO,
    free_port,
    image_base_facts,
    make,
    make_exit_code,
    project_containers,
    standin_tag,
)
from server_fixture import MODELS_DIR, ensure_smoke_model

from k3rocm.checks import selftest
from k3rocm.checks.ab.arms import arm_envs
from k3rocm.checks.selftest import GREEDY_TOKENS, LOGPROB_TOL, compare, compare_note
from k3rocm.cli import main
from k3rocm.deploy import config_cmd, engine, preflight, runrecord
from k3rocm.deploy.lifecycle import ComposeServer
from k3rocm.errors import UsageError

PROJECT = "k3rocm-selftest-test"


# ------------------------------------------------------------------------ no Docker needed


def _run(prompt, tokens, logprobs, top):
    return {"prompt": prompt, "tokens": tokens, "logprobs": logprobs, "top_logprobs": top}


def test_compare_judges_the_logprob_gap_against_the_tolerance():
    on = [_run("a", ["x", "y"], [-0.1, -0.2], [{"x": -0.1, "q": -3.0}, {"y": -0.2, "q": -2.0}])]
    same = compare(on, json.loads(json.dumps(on)))
    assert same["identical"] and same["ok"] and same["max_logprob_gap"] == 0.0
    assert same["tolerance"] == LOGPROB_TOL == 0.125
    near = [_run("a", ["x", "y"], [-0.1, -0.3], [{"x": -0.1, "q": -3.0}, {"y": -0.3, "q": -2.1}])]
    c = compare(on, near)
    assert c["identical"] and c["ok"] and c["max_logprob_gap"] == pytest.approx(0.1)
    far = [_run("a", ["x", "y"], [-0.1, -0.5], [{"x": -0.1, "q": -3.0}, {"y": -0.5, "q": -2.0}])]
    c = compare(on, far)
    assert c["identical"] and not c["ok"] and c["max_logprob_gap"] == pytest.approx(0.3)
    assert c["max_gap_at"]["position"] == 1
    note = compare_note(c)
    assert "max logprob gap 0.3 > tolerance 0.125 at 'a' position 1" in note
    assert "identical" in note and "top-20 spread median" in note


def test_compare_a_near_tie_flip_is_within_tolerance_and_later_positions_are_not_compared():
    on = [_run("a", ["x", "y", "z"], [-0.1, -0.69, -0.01],
               [{"x": -0.1}, {"y": -0.69, "w": -0.70}, {"z": -0.01}])]
    off = [_run("a", ["x", "w", "k"], [-0.1, -0.68, -9.0],
                [{"x": -0.1}, {"w": -0.68, "y": -0.71}, {"k": -9.0}])]
    c = compare(on, off)
    assert not c["identical"] and c["ok"], c
    assert c["first_differences"] == [{"prompt": "a", "position": 1, "on": ["y"], "off": ["w"],
                                       "logprob_on": -0.69, "logprob_off": -0.68}]
    assert c["max_logprob_gap"] == pytest.approx(0.02)  # w: -0.70 vs -0.68; y: -0.69 vs -0.71
    assert "tokens differ: 'a' at 1" in compare_note(c)


def test_compare_a_token_outside_the_other_arms_top_n_fails_or_cannot_be_judged():
    on = [_run("a", ["x", "y"], [-0.1, -0.69], [{"x": -0.1}, {"y": -0.69, "w": -0.71}])]
    off = [_run("a", ["x", "w"], [-0.1, -0.2], [{"x": -0.1}, {"w": -0.2, "v": -2.5}])]
    c = compare(on, off)
    # y is not in off's top-N: its logprob there is at most -2.5, so the gap is at least 1.81
    assert c["verdict"] == "fail" and c["max_logprob_gap"] == pytest.approx(1.81), c
    assert not c["max_gap_at"]["in_both_top_n"]
    near = [_run("a", ["x", "w"], [-0.1, -0.68], [{"x": -0.1}, {"w": -0.68}])]
    c = compare(on, near)  # y is at most -0.68 there: its gap has no bound
    assert c["verdict"] == "cannot judge" and not c["ok"], c
    assert c["unbounded"] == [{"prompt": "a", "position": 1, "token": "y"}]
    assert c["max_logprob_gap"] == pytest.approx(0.03)  # w: -0.71 vs -0.68
    assert "cannot judge 'a' position 1: a token outside the other arm's top-20" in \
        compare_note(c)
    short = [_run("a", ["x"], [-0.1], [{"x": -0.1}])]
    assert compare(on, short)["verdict"] == "cannot judge"  # an answer that ended early


@pytest.mark.parametrize("args,fragment", [
    (["--timeout", "0"], "--timeout 0 must be > 0"),
    (["--port", "70000"], "must be 1..65535"),
    (["--model", "/elsewhere/ckpt"], "not under K3_MODELS_DIR"),
    (["--bench-args", "'unclosed"], "--bench-args"),
    (["--bench-args=--no-such-flag"], "--bench-args: unrecognized arguments"),
    (["--census-args=--no-such-flag"], "--census-args: unrecognized arguments"),
])
def test_bad_input_is_one_line_exit_2(node, tmp_path, capsys, args, fragment):
    code, errors, err = _refused(capsys, *args)
    assert code == 2 and len(errors) == 1 and fragment in errors[0], err
    assert node == [] and not (tmp_path / "results").exists()


# ------------------------------------------- the A/B's arms against the image's base facts


class ImageNotFound(Exception):  # docker-py's name: engine.image_id tells it by name
    pass


class FakeDocker:
    """docker-py's client as far as the early checks ask: images.get, running containers."""

    def __init__(self):
        from k3rocm.deploy.engine import CLIENT_IMAGE

        self.images_present = {CLIENT_IMAGE}
        self.running: list = []
        self.images = self
        self.containers = self

    def get(self, ref):
        if ref not in self.images_present:
            raise ImageNotFound(ref)
        return type("Image", (), {"id": "sha256:" + "0" * 64})()

    def list(self):
        return self.running


def gpu_server(name="k3rocm-server-1", project="k3rocm", port="8000"):
    """A running `make up` server as the engine shows it: /dev/kfd mapped, K3_* env."""
    return type("Container", (), {
        "name": name, "labels": {"com.docker.compose.project": project},
        "image": type("Image", (), {"tags": ["k3rocm/server:latest"], "id": "sha256:0"})(),
        "attrs": {"HostConfig": {"Devices": [{"PathOnHost": "/dev/kfd"},
                                             {"PathOnHost": "/dev/dri"}]},
                  "Config": {"Env": ["K3_PROFILE=mi355x-tp8", f"K3_PORT={port}"]}}})()


class Calls(list):
    docker: FakeDocker


@pytest.fixture
def node(tmp_path, monkeypatch):
    """A node (compose.yaml, AITER on) whose serving image holds the base facts of the real
    vLLM 0.27.1 sources; every compose call recorded (none may happen before the checks)."""
    facts = image_base_facts("0.27.1")  # the real release with the overlay applied
    monkeypatch.setattr(config_cmd, "image_base_facts",
                        lambda image: (facts, f"{image} (sha256:0123456789ab) manifest"))
    calls: Calls = Calls()
    def compose(self, *a, **kw):  # recorded; as if it failed
        calls.append(a)
        return subprocess.CompletedProcess(a, 1, "", "")

    monkeypatch.setattr(ComposeServer, "compose", compose)
    monkeypatch.setattr(ComposeServer, "up", lambda self, *a, **kw: calls.append(("up",)))
    # the Docker engine (client image present, no container) and idle GPUs: tests change them
    docker = FakeDocker()
    monkeypatch.setattr(engine, "docker_client", lambda *a, **kw: docker)
    monkeypatch.setattr(preflight, "gpu_memory",
                        lambda: [(f"card{i}", 3, 1000) for i in range(8)])
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
    calls.docker = docker  # type: ignore[attr-defined]
    return calls


def _args(**kw):
    import argparse

    from k3rocm.deploy.deployment import load_deployment

    return argparse.Namespace(**{"timeout": 10, "bench_args": "", "census_args": "",
                                 "env_file": ".env", "model": None, "port": None,
                                 "project": "k3selftest-t", "on": "qk_norm", "workload": None,
                                 "deployment": load_deployment(), **kw})


def test_selftest_serves_the_abs_arms(node):
    """Fusions-on = the A/B's arm B of --on, fusions-off = arm A; both pass the base check."""
    dep, srv, arms = selftest._plan(_args())
    assert not dep.cpu and arms == arm_envs("qk_norm")
    assert srv.env["K3_FUSE_QK_NORM"] == "1" and srv.env["K3_FUSE_DECODE_QPREP"] == "0"
    base = selftest.base_check(dep, srv, arms, ".env")
    assert sorted(base["arms"]) == ["A", "B"] and base["vllm_version"] == "0.27.1"
    assert node == []


# ------------------------------------------------- refused before any build or server (fakes)


@contextlib.contextmanager
def busy_port():
    """A port something listens on (as the engine's proxy does for a published port)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def _refused(capsys, *argv: str) -> tuple[int, list[str], list[str]]:
    code = main(["selftest", "run", "--on", "qk_norm", *argv])  # an arm this base serves
    err = capsys.readouterr().err.strip().splitlines()
    return code, [ln for ln in err if ln.startswith("k3rocm: error: ")], err


def _gpu_memory_in_use(node, monkeypatch):
    monkeypatch.setattr(preflight, "gpu_memory",
                        lambda: [("card0 (0000:05:00.0)", 4, 1000), ("card3", 620, 1000)])
    return []


@pytest.mark.parametrize("setup,fragments", [
    (lambda node, mp: ["--no-build"],
     ["serving image 'k3rocm/server:latest' not found", "drop --no-build"]),
    (_gpu_memory_in_use, ["GPU memory in use: card3 62%", "asks vLLM for 0.95 of each GPU"]),
], ids=["no-build", "gpu-memory"])
def test_refused_before_any_build(node, monkeypatch, tmp_path, capsys, setup, fragments):
    """What a build or a load would find late: one line, exit 2, nothing built, served or
    written (the client image, the port, the GPUs held: test_every_problem_is_one_line...)."""
    code, errors, err = _refused(capsys, *setup(node, monkeypatch))
    assert code == 2 and len(errors) == 1, err
    assert all(f in errors[0] for f in fragments), errors[0]
    assert "card0" not in errors[0]
    assert err[-1].startswith("k3rocm selftest: nothing expensive was started"), err
    assert node == [] and not (tmp_path / "results").exists()


def test_the_client_image_the_bench_step_will_use_is_the_one_checked(node, capsys):
    node.docker.images_present.clear()
    node.docker.images_present.add("my/clients:1")
    with busy_port() as port:  # refused for its port, so nothing runs
        code, errors, err = _refused(capsys, "--bench-args=--client-image my/clients:1",
                                     "--port", str(port))
    assert code == 2 and len(errors) == 1 and "is in use" in errors[0], err
    assert node == []


def test_every_problem_is_one_line_and_all_are_named_at_once(node, tmp_path, capsys):
    """The operator fixes everything in one go: each problem its own line with what to do,
    base check too; exit 2, nothing built, served or written."""
    node.docker.images_present.clear()
    node.docker.running.append(gpu_server())
    with busy_port() as port:  # and arm B (--on all), which this base cannot serve
        code = main(["selftest", "run", "--port", str(port)])
    err = capsys.readouterr().err.strip().splitlines()
    errors = [ln for ln in err if ln.startswith("k3rocm: error: ")]
    assert code == 2 and len(errors) == 4, err
    for fragments, line in zip(
            (("client image 'k3rocm/clients:", "not found", "make clients-image"),
             (f"port {port} on 127.0.0.1 is in use", "--port N"),
             ("the GPUs are held by running container(s) k3rocm-server-1 (k3rocm/server:latest, "
              "compose project k3rocm, port 8000)", "make down"),
             ("cannot be served by this base",)), errors, strict=True):
        assert all(f in line for f in fragments), line
    assert err[-1].startswith("k3rocm selftest: nothing expensive was started"), err
    assert node == [] and not (tmp_path / "results").exists()


def test_the_gpu_check_is_skipped_on_the_cpu_standin_and_says_so(node, monkeypatch):
    monkeypatch.setenv("COMPOSE_FILE", "compose.yaml:compose.cpu.yaml")
    node.docker.running.append(gpu_server())
    dep, _, _ = selftest._plan(_args(on="all"), check_model=False)
    problems, notes = selftest.early_checks(dep, None)
    assert dep.cpu and problems == [], problems
    assert "GPU check skipped: CPU stand-in" in notes


def test_the_servers_get_this_shells_vendor_variables(node, monkeypatch, tmp_path):
    """As `make up`: this shell's vendor variables, into the run's own file, never the shared
    .k3rocm/vendor.env an earlier shell wrote (the summary says where that one differs)."""
    monkeypatch.setenv("VLLM_ROCM_USE_AITER_MHA", "0")
    for compose_file, extra in (("compose.yaml", []),
                                ("compose.yaml:compose.cpu.yaml", ["TORCHDYNAMO_DISABLE=1"])):
        monkeypatch.setenv("COMPOSE_FILE", compose_file)
        vendor = tmp_path / f"vendor-{len(extra)}.env"
        dep, srv, _ = selftest._plan(_args(), check_model=False, vendor_file=vendor)
        assert srv.compose_env()["K3_VENDOR_ENV_FILE"] == str(vendor)
        lines = [ln for ln in vendor.read_text().splitlines() if not ln.startswith("#")]
        assert lines == ["VLLM_ROCM_USE_AITER_MHA=0", *extra], lines
    (tmp_path / "repo" / ".k3rocm").mkdir(parents=True)
    (tmp_path / "repo" / ".k3rocm" / "vendor.env").write_text(
        "VLLM_ROCM_USE_AITER_MHA=1\nAITER_OLD_SHELL=1\n")
    note = selftest.vendor_note(dep, tmp_path / "repo")
    assert note.startswith("vendor variables from this shell: VLLM_ROCM_USE_AITER_MHA ("), note
    assert "differs in AITER_OLD_SHELL, VLLM_ROCM_USE_AITER_MHA: not used" in note
    assert node == []


@pytest.fixture
def fake_pipeline(node, monkeypatch, tmp_path):
    """The whole selftest on that node with the servers, the census and bench subprocesses
    and the greedy requests faked: ``answers`` (on, off) and ``codes`` (step -> exit code)."""
    monkeypatch.setattr(ComposeServer, "compose",  # the build succeeds
                        lambda self, *a, **kw: subprocess.CompletedProcess(a, 0, "", ""))
    monkeypatch.setattr(ComposeServer, "wait", lambda self, timeout, **kw: 1.0)
    monkeypatch.setattr(ComposeServer, "provenance", lambda self: {})
    fake = {"codes": {}, "downs": []}
    monkeypatch.setattr(ComposeServer, "down",
                        lambda self, **kw: fake["downs"].append(Path(kw["log_path"]).name))
    monkeypatch.setattr(runrecord, "build", lambda **kw: {})
    answer = [{"prompt": p, "tokens": ["token_id:7"] * GREEDY_TOKENS,
               "logprobs": [-0.5] * GREEDY_TOKENS,
               "top_logprobs": [{"token_id:7": -0.5, "token_id:9": -1.5}] * GREEDY_TOKENS}
              for p in selftest.PROMPTS]
    fake["answers"] = [answer, answer]
    monkeypatch.setattr(selftest, "greedy",
                        lambda *a, **kw: json.loads(json.dumps(fake["answers"].pop(0))))
    def measure(name):
        def fn(args, dep):
            if fake["codes"].get(name) == 2:
                raise UsageError(f"{name}: refused", 2)
            if fake["codes"].get(name) == "sigint":
                raise KeyboardInterrupt
            return fake["codes"].get(name, 0), {}, tmp_path / name
        return fn

    for name in ("census", "bench"):
        monkeypatch.setattr(selftest, f"{name}_step", measure(name))
    return fake


def _summary(tmp_path) -> dict:
    (run,) = (tmp_path / "results").iterdir()
    return json.loads((run / "summary.json").read_text())


def test_an_exit_2_after_a_server_started_is_exit_4_not_bad_input(fake_pipeline, tmp_path,
                                                                  capsys):
    """Exit 2 promises that nothing expensive was started. A step that refuses its input once
    the servers have run (here the bench step) makes the selftest exit 4, cannot judge, and its
    row says why."""
    fake_pipeline["codes"]["bench"] = 2
    code = main(["selftest", "run", "--on", "qk_norm"])
    out, err = capsys.readouterr()
    assert code == 4, out + err
    assert "nothing expensive was started" not in err
    s = _summary(tmp_path)
    bench = next(st for st in s["steps"] if st["name"] == "bench")
    assert bench["exit_code"] == 2 and "found after a server had started" in bench["note"]
    assert "k3rocm: error: bench: refused" in Path(bench["log"]).read_text()  # its output, its log
    assert s["exit_code"] == 4 and "k3rocm selftest: FAILED (exit 4)" in out
    compare_row = next(st for st in s["steps"] if st["name"] == "compare")
    assert compare_row["ok"] and "max logprob gap 0 <= tolerance 0.125" in compare_row["note"]


def test_the_compare_step_judges_the_gap_not_token_identity(fake_pipeline, tmp_path, capsys):
    """Identical tokens whose logprobs moved by 0.3 nats fail: exit 1."""
    off = json.loads(json.dumps(fake_pipeline["answers"][1]))
    off[2]["logprobs"][5] = -0.8
    off[2]["top_logprobs"][5] = {"token_id:7": -0.8, "token_id:9": -1.5}
    fake_pipeline["answers"][1] = off
    assert main(["selftest", "run", "--on", "qk_norm"]) == 1, capsys.readouterr()
    row = next(st for st in _summary(tmp_path)["steps"] if st["name"] == "compare")
    assert row["numbers"]["verdict"] == "fail" and row["numbers"]["identical"]
    assert f"tolerance 0.125 at {off[2]['prompt']!r} position 5" in row["note"]


@pytest.mark.parametrize("census", ["sigint", 130])
def test_ctrl_c_during_the_census_stops_everything_and_keeps_what_finished(fake_pipeline,
                                                                           tmp_path, capsys,
                                                                           census):
    """Ctrl-C while the census runs (raised in it, or the census stopped on it and kept what it
    finished: its 130): exit 130 recorded, the finished steps kept, the running server stopped
    with its log saved. Live, with real containers: test_gsm8k_e2e's and test_demo's signal
    tests (the one client runner, compose down)."""
    fake_pipeline["codes"]["census"] = census
    assert main(["selftest", "run", "--on", "qk_norm"]) == 130
    out = capsys.readouterr().out
    s = _summary(tmp_path)
    assert s["status"] == "interrupted" and s["exit_code"] == 130, s
    assert [(st["name"], st["ok"], st["exit_code"]) for st in s["steps"]] == [
        ("build", True, 0), ("up", True, 0), ("census", False, 130)]
    assert fake_pipeline["downs"] == ["server-on.log"]
    assert "k3rocm selftest: INTERRUPTED" in out and "INTERRUPTED" in (
        Path(s["run_dir"]) / "summary.md").read_text()


# ------------------------------------------------------------------- the real serving path


def _selftest(client, tmp_path, *args: str, timeout: float = 900,
              **env: str) -> subprocess.CompletedProcess:
    """`make selftest CPU=1` on a free port."""
    ensure_smoke_model(client, standin_tag())
    args = " ".join(["--port", str(free_port()), "--project", PROJECT, *args])
    return make("selftest", "CPU=1", f"SELFTEST_ARGS={args}", timeout=timeout,
                K3_MODELS_DIR=str(MODELS_DIR), K3_RESULTS_DIR=str(tmp_path / "results"), **env)


@pytest.mark.docker
@pytest.mark.server
def test_make_selftest_on_the_standin(docker_client, tmp_path):
    p = _selftest(docker_client, tmp_path,  # the bench step's one point, short
                  "--bench-args='--set request_count=2 --set warmup_request_count=1'")
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
    assert (Path(census["run_dir"]) / "census.json").is_file()  # the census's own run
    assert "census: PASS" in Path(census["log"]).read_text()
    assert s["greedy"]["identical"] and s["greedy"]["prompts"] == 4
    assert all(len(g["tokens"]) == GREEDY_TOKENS for g in s["greedy"]["on"])
    # both servers are stock on the stand-in: the logprobs agree within the tolerance
    g = s["greedy"]
    assert g["ok"] and g["max_logprob_gap"] is not None and g["max_logprob_gap"] <= LOGPROB_TOL
    assert all(len(top) >= 2 for top in g["on"][0]["top_logprobs"])  # top-N came back
    compare_row = next(st for st in s["steps"] if st["name"] == "compare")
    assert f"<= tolerance {LOGPROB_TOL:g}" in compare_row["note"]
    # checked before the build; the servers got this shell's vendor variables, from the run
    assert "GPU check skipped: CPU stand-in" in s["checked_first"]
    assert any(c.startswith("client image ") for c in s["checked_first"])
    assert "TORCHDYNAMO_DISABLE=1" in (run / "vendor.env").read_text()
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
    p = _selftest(docker_client, tmp_path, "--no-build", timeout=300,
                  VLLM_ROCM_USE_AITER="1", K3_OVERLAY="off")
    # k3rocm's 2 (bad input), not make's 2 (any failed recipe)
    assert make_exit_code(p) == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert "K3_FUSE_QK_NORM=0 cannot take effect on this base" in p.stderr
    assert "unset K3_OVERLAY" in p.stderr
    # refused with the other early checks: before any server and any run directory
    assert "k3rocm selftest: nothing expensive was started" in p.stderr
    assert not (tmp_path / "results").exists()
    assert project_containers(PROJECT) == []
