"""Every command x {shell, `.env`, inline on the make line} resolves the same server URL, model, API
key, model dir, results root and image, through the real make targets in a scratch project,
observed with `--print-deployment` (no server, no Docker); expected values are written here.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, make_exit_code

PORT = 18123
SETTINGS = {
    "K3_PORT": str(PORT),
    "K3_BIND_ADDRESS": "0.0.0.0",  # published on every address: clients use 127.0.0.1
    "K3_SERVED_MODEL_NAME": "matrix-model",
    "K3_API_KEY": "matrix-secret",
    "K3_MODELS_DIR": "./models-x",  # relative: to the directory compose and make run in
    "K3_MODEL": "/models/m1",
    "K3_RESULTS_DIR": "./results-x",
    "K3_IMAGE": "k3rocm/server:matrix",
}
# Every command that takes its values from the deployment k3rocm.cli builds ("wired"), and
# config, which renders the same settings itself.
# test id -> (make target, extra make arguments, the k3rocm command the target runs)
COMMANDS = {
    "config": ("config", [], "config"),
    "bench": ("bench", ["WORKLOAD=ci-tiny"], "bench"),
    "gsm8k": ("gsm8k", [], "gsm8k"),
    "census": ("census", [], "census"),
    "wait": ("wait", [], "server wait"),
    "bench-ab": ("bench-ab", ["WORKLOAD=ci-tiny"], "ab"),
    "census-ab": ("census-ab", [], "ab"),
}
PLACEMENTS = ("shell", "dotenv", "inline")


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("matrix")
    for name in ("Makefile", "mk", "compose.yaml", "compose.cpu.yaml", "pyproject.toml"):
        (d / name).symlink_to(REPO / name)
    ckpt = d / "models-x" / "m1"
    ckpt.mkdir(parents=True)
    (ckpt / "tokenizer.json").write_text("{}")
    return d


def expected(project: Path) -> dict:
    ckpt = str(project / "models-x" / "m1")
    return {"url": f"http://127.0.0.1:{PORT}", "served_model_name": "matrix-model",
            "api_key": "***", "tokenizer": ckpt, "model_host_dir": ckpt,
            "results_root": str(project / "results-x"), "image": "k3rocm/server:matrix"}


def _env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("K3_", "BENCH_", "COMPOSE_")) and k not in ("MAKEFLAGS", "MFLAGS")}
    env["PYTHONPATH"] = str(REPO / "src")
    env.update(extra or {})
    return env


def make(project: Path, target: str, placement: str, *extra: str, env: dict | None = None,
         py: str = sys.executable) -> subprocess.CompletedProcess:
    """`make <target>` with SETTINGS placed in the shell, in .env or on the make line; ``py``:
    the make targets' Python (``PY=``)."""
    dotenv = project / ".env"
    dotenv.unlink(missing_ok=True)
    line = [f"{k}={v}" for k, v in SETTINGS.items()]
    shell = {}
    if placement == "shell":
        shell = dict(SETTINGS)
    elif placement == "dotenv":
        dotenv.write_text("# written by test_settings_matrix\n" + "\n".join(line) + "\n")
    cmd = ["make", "-s", "-o", py, target, f"PY={py}", *extra,
           *(line if placement == "inline" else [])]
    try:
        return subprocess.run(cmd, cwd=project, env=_env({**shell, **(env or {})}),
                              capture_output=True, text=True, timeout=120)
    finally:
        dotenv.unlink(missing_ok=True)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_resolves_the_same_deployment(project, command, placement):
    target, extra, runs = COMMANDS[command]
    out = project / f"view-{command}-{placement}.jsonl"
    out.unlink(missing_ok=True)
    py = project / f"py-{command}-{placement}"  # every `$(PY) -m k3rocm ...` the target runs
    py.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@" --print-deployment >> "{out}"\n')
    py.chmod(0o755)
    p = make(project, target, placement, *extra, py=str(py))
    assert make_exit_code(p) == 0, p.stderr
    views = [json.loads(x) for x in out.read_text().splitlines()]
    assert views, f"make {target} ran no k3rocm command"
    want = expected(project)
    for view in views:
        assert view["command"] == runs and view["wired"] is (command != "config"), view
        got = {k: view[k] for k in want}
        assert got == want, f"make {target} ({placement}): {got}"
        src = "env" if placement in ("shell", "inline") else ".env"
        assert {view["sources"][k] for k in SETTINGS} == {src}


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_bench_and_gsm8k_dry_runs_use_the_deployment(project, placement):
    """The exact client command lines carry the same URL, model, key, tokenizer and results."""
    want = expected(project)
    p = make(project, "bench", placement, "WORKLOAD=ci-tiny", "DRY_RUN=1")
    assert make_exit_code(p) == 0, p.stderr
    argv = shlex.split(p.stdout.strip().splitlines()[-1])
    opt = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}
    assert opt["--url"] == want["url"] and opt["--model"] == want["served_model_name"]
    assert opt["--api-key"] == SETTINGS["K3_API_KEY"]
    assert opt["--tokenizer"] == want["tokenizer"]
    assert Path(opt["--artifact-dir"]).parent.parent == Path(want["results_root"])

    p = make(project, "gsm8k", placement, "DRY_RUN=1")
    assert make_exit_code(p) == 0, p.stderr
    margs = dict(kv.split("=", 1) for kv in
                 shlex.split(p.stdout)[shlex.split(p.stdout).index("--model_args") + 1]
                 .split(","))
    assert margs["model"] == want["served_model_name"]
    assert margs["base_url"] == want["url"] + "/v1/chat/completions"


def test_derivations_without_make(tmp_path):
    """The rules behind the view, each with a value that would show a wrong rule."""
    from k3rocm.deploy.deployment import load_deployment

    d = load_deployment({"K3_BIND_ADDRESS": "::", "K3_PORT": "9", "K3_RESULTS_DIR": str(tmp_path),
                         "K3_MODELS_DIR": str(tmp_path / "m"), "K3_MODEL": "/models/a/b",
                         "COMPOSE_FILE": "compose.yaml"}, None)  # `make` without CPU=1
    assert d.url == "http://[::1]:9" and d.compose_files == ("compose.yaml",)
    assert d.model_host_dir == tmp_path / "m" / "a" / "b" and d.model_container_dir == "/models/a/b"
    assert d.host_path("/results/traces/x") == tmp_path / "traces" / "x"
    assert d.container_path(tmp_path / "run1") == "/results/run1"
    assert d.host_path("/elsewhere") is None and d.container_path("/elsewhere") is None
    assert d.image == "k3rocm/server:latest" and d.api_key is None
    # compose.cpu.yaml in COMPOSE_FILE (make CPU=1): its profile and image defaults, as compose
    cpu = load_deployment({"COMPOSE_FILE": "compose.yaml:compose.cpu.yaml"}, None)
    assert (cpu.profile, cpu.served_model_name, cpu.image) == ("cpu-smoke", "k3-smoke",
                                                                 "k3rocm/server:cpu")
    assert cpu.compose_files == ("compose.yaml", "compose.cpu.yaml")
    # an explicit profile or image wins over the override's defaults
    own = load_deployment({"COMPOSE_FILE": "compose.yaml:compose.cpu.yaml",
                           "K3_PROFILE": "mi355x-tp8", "K3_IMAGE": "x:1"}, None)
    assert (own.profile, own.image) == ("mi355x-tp8", "x:1")
    hub = load_deployment({"K3_MODEL": "moonshotai/Kimi-K3"}, None)
    assert hub.model_host_dir is None and hub.tokenizer is None


def test_make_config_writes_nothing_and_says_what_the_base_decides(project):
    """`make config` only prints: a vendor variable in its shell is shown but no
    .k3rocm/vendor.env is written (the next `make up` writes its own)."""
    vendor = project / ".k3rocm" / "vendor.env"
    vendor.unlink(missing_ok=True)
    p = make(project, "config", "shell", env={"VLLM_LOGGING_LEVEL": "DEBUG"})
    assert make_exit_code(p) == 0, p.stderr
    assert "VLLM_LOGGING_LEVEL" in p.stdout  # printed, with its source
    assert not vendor.exists(), vendor.read_text()
    line = {ln.split()[0]: ln for ln in p.stdout.splitlines() if ln.startswith("  K3_")}
    for key in ("K3_KV_CACHE_DTYPE", "K3_FUSE_DECODE_QPREP", "K3_FUSE_QK_NORM"):
        assert "(the base decides at start: facts unknown" in line[key], line[key]
    assert "the base decides" not in line["K3_MAX_MODEL_LEN"]
    for target in ("build", "up"):
        dry = subprocess.run(["make", "-n", target, f"PY={sys.executable}"], cwd=project,
                             env=_env(), capture_output=True, text=True, timeout=60)
        assert "--vendor-env-file .k3rocm/vendor.env" in dry.stdout, (target, dry.stdout)
