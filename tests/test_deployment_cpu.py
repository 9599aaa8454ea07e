"""One Deployment value: the CPU-or-GPU decision is made once (deployment.decide_cpu) and every
command takes its K3_* values from it (shell > .env > profile > default).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from conftest import run_cli

from k3rocm.cli import main
from k3rocm.deploy import deployment, lifecycle

CPU_FILE = "compose.cpu.yaml"


@pytest.fixture
def clean(monkeypatch, tmp_path):
    """No K3_* or COMPOSE_FILE from the caller's shell; no .env in the working directory."""
    import os

    for k in list(os.environ):
        if k.startswith("K3_") or k in ("COMPOSE_FILE", "COMPOSE_PATH_SEPARATOR",
                                         "BENCH_AB_REPEATS"):
            monkeypatch.delenv(k)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _kfd(monkeypatch, tmp_path, present: bool) -> None:
    kfd = tmp_path / "kfd"
    if present:
        kfd.touch()
    monkeypatch.setattr(deployment, "KFD", kfd, raising=False)


def _files(argv: list[str]) -> set[str]:
    return {Path(a).name for a in argv if a.endswith(".yaml")}


@pytest.mark.parametrize("gpu_node", [True, False])
def test_server_and_deployment_make_the_same_decision(clean, monkeypatch, gpu_node):
    """`k3rocm server up` and every client run the same compose files."""
    _kfd(monkeypatch, clean, gpu_node)
    dep = deployment.load_deployment(env_file=None)
    srv = lifecycle.compose_server(dep)
    assert _files(srv.argv("ps")) == set(dep.compose_files)
    assert srv.cpu == (CPU_FILE in dep.compose_files) == dep.cpu == (not gpu_node)
    if not gpu_node:  # compose.cpu.yaml's defaults, as compose applies them
        assert (dep.profile, dep.image) == ("cpu-smoke", "k3rocm/server:cpu")


@pytest.mark.parametrize("environ,dotenv,gpu,kfd,want_cpu,why", [
    # 1. the command's --gpu / --no-gpu
    ({"COMPOSE_FILE": f"compose.yaml:{CPU_FILE}"}, "", True, False, False, "--gpu"),
    ({"COMPOSE_FILE": "compose.yaml"}, "", False, True, True, "--no-gpu"),
    # 2. COMPOSE_FILE (what `make` exports; CPU=1 adds compose.cpu.yaml)
    ({"COMPOSE_FILE": "compose.yaml"}, "K3_PROFILE=cpu-smoke\n", None, False, False,
     "COMPOSE_FILE"),
    ({"COMPOSE_FILE": f"/repo/compose.yaml:/repo/{CPU_FILE}"}, "", None, True, True,
     "COMPOSE_FILE"),
    # 3. K3_PROFILE=cpu-smoke (shell or .env)
    ({}, "K3_PROFILE=cpu-smoke\n", None, True, True, "K3_PROFILE=cpu-smoke"),
    ({"K3_PROFILE": "cpu-smoke"}, "", None, True, True, "K3_PROFILE=cpu-smoke"),
    # 4. the host: /dev/kfd
    ({"K3_PROFILE": "mi355x-tp8"}, "", None, True, False, "present"),
    ({}, "", None, False, True, "absent"),
])
def test_one_precedence(clean, monkeypatch, environ, dotenv, gpu, kfd, want_cpu, why):
    _kfd(monkeypatch, clean, kfd)
    (clean / ".env").write_text(dotenv)
    dep = deployment.load_deployment(environ, ".env", gpu=gpu)
    assert dep.cpu is want_cpu and why in dep.cpu_from
    assert dep.compose_files == (("compose.yaml", CPU_FILE) if want_cpu else ("compose.yaml",))
    assert dep.to_json()["cpu"] is want_cpu


def _ab_args(*argv: str) -> argparse.Namespace:
    from k3rocm.cli import parse

    return parse(["bench-ab", "--repeats", "1", *argv])


@pytest.mark.parametrize("compose_file", ["compose.yaml", f"compose.yaml:{CPU_FILE}"])
def test_ab_arms_follow_make_like_make_up(clean, monkeypatch, compose_file):
    """`make bench-ab` arm servers use the files `make up` uses."""
    from k3rocm.checks.ab.arms import arms_from_args

    monkeypatch.setenv("COMPOSE_FILE", compose_file)
    srv = lifecycle.compose_server(deployment.load_deployment(env_file=None))
    arms = arms_from_args(_ab_args("--dry-run"))
    assert arms.cpu == srv.cpu == (CPU_FILE in compose_file)


@pytest.mark.parametrize("where", ["shell", ".env"])
def test_ab_arm_servers_get_the_deployments_paths_and_image(clean, monkeypatch, where):
    """K3_IMAGE, K3_MODELS_DIR, K3_CACHE_DIR reach the arm servers and their record alike
    from the shell or .env.
    """
    from k3rocm.checks.ab.arms import arms_from_args

    models, cache = clean / "m", clean / "c"
    models.mkdir()
    values = {"K3_IMAGE": "my/server:x", "K3_MODELS_DIR": str(models), "K3_CACHE_DIR": str(cache)}
    if where == "shell":
        for k, v in values.items():
            monkeypatch.setenv(k, v)
    else:
        (clean / ".env").write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    arms = arms_from_args(_ab_args("--no-gpu"))
    env = arms.compose_env("A")
    assert {k: env.get(k) for k in values} == values
    assert {k: arms.describe_env().get(k) for k in values} == values


def test_ab_models_dir_from_dotenv_is_checked_before_any_server(clean):
    from k3rocm.checks.ab.arms import arms_from_args
    from k3rocm.errors import UsageError

    (clean / ".env").write_text(f"K3_MODELS_DIR={clean / 'missing'}\n")
    with pytest.raises(UsageError, match="K3_MODELS_DIR .*missing.* does not exist"):
        arms_from_args(_ab_args("--no-gpu"))


@pytest.mark.parametrize("where", ["shell", ".env"])
def test_selftest_on_the_standin_keeps_a_fusion_switch_the_user_set(clean, monkeypatch, where):
    """On the stand-in the selftest turns the fusions off unless the user set a switch; its
    server runs its deployment's compose files."""
    from k3rocm.checks import selftest

    _kfd(monkeypatch, clean, False)
    (clean / "models" / "x").mkdir(parents=True)
    if where == "shell":
        monkeypatch.setenv("K3_FUSE_QK_NORM", "1")
    else:
        (clean / ".env").write_text("K3_FUSE_QK_NORM=1\n")
    args = argparse.Namespace(timeout=10, bench_args="", census_args="", env_file=".env",
                              model="/models/x", port=None, project="k3selftest-t", on="all",
                              deployment=deployment.load_deployment())
    dep, srv, _ = selftest._plan(args, check_model=False)
    assert _files(srv.argv("ps")) == set(dep.compose_files) and srv.cpu == dep.cpu
    assert srv.cpu and srv.env["K3_FUSE_QK_NORM"] == "1"
    assert srv.env["K3_FUSE_DECODE_QPREP"] == "0"


def test_the_deployment_is_loaded_once_per_command(clean, monkeypatch, capsys):
    """k3rocm.cli loads the deployment (shell, .env) once and passes it down: the selftest
    server's settings are it re-rendered (with_env), not a second load."""
    real, reads = deployment.read_dotenv, []
    monkeypatch.setattr(deployment, "read_dotenv", lambda p: reads.append(p) or real(p))
    (clean / ".env").write_text("K3_PORT=8123\n")
    assert main(["selftest", "run", "--model", "/models/x", "--print-deployment"]) == 0
    view = json.loads(capsys.readouterr().out)
    assert reads == [".env"] and view["url"].endswith(":8124") and view["model"] == "/models/x"


def test_gsm8k_looks_in_the_deployments_cache_dir(clean, monkeypatch):
    """K3_CACHE_DIR from .env: GSM8K items are found under <cache>/huggingface."""
    from k3rocm.checks.gsm8k import data

    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    d = clean / "elsewhere" / "huggingface" / "datasets" / data.ARROW_DIR / "main" / "0"
    d.mkdir(parents=True)
    (d / "gsm8k-test.arrow").write_bytes(b"x")
    (clean / ".env").write_text(f"K3_CACHE_DIR={clean / 'elsewhere'}\n")
    p = run_cli("gsm8k", "--dry-run", cwd=clean,
                env={"HF_HOME": "", "HF_DATASETS_CACHE": "", "COMPOSE_FILE": "compose.yaml"})
    assert p.returncode == 0, p.stderr
    assert str(clean / "elsewhere" / "huggingface") in p.stderr and "none yet" not in p.stderr


def test_smoke_writes_into_the_deployments_results_root(clean, monkeypatch):
    seen = {}

    class Stop(Exception):
        pass

    class Fake:
        def __init__(self, **kw):
            seen.update(kw)

        def compose(self, *a, **kw):
            raise Stop

    monkeypatch.setattr(lifecycle, "ComposeServer", Fake)
    (clean / ".env").write_text(f"K3_RESULTS_DIR={clean / 'res'}\n")
    with pytest.raises(Stop):
        main(["smoke"])
    assert seen["env"]["K3_RESULTS_DIR"] == str(clean / "res") and seen["cpu"] is True


def test_demo_port_is_the_deployments(clean, tmp_path):
    """K3_PORT from .env is the demo's port: a bad one is a one-line exit 2 first."""
    (clean / ".env").write_text("K3_PORT=70000\n")
    p = run_cli("demo", "--results", str(tmp_path / "r"), cwd=clean,
                env={"DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"})
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.count("\n") == 1 and "K3_PORT" in p.stderr and "70000" in p.stderr


def test_demo_names_the_image_make_up_runs(clean, monkeypatch):
    import functools

    from k3rocm.checks import steps
    from k3rocm.dev import demo

    (clean / ".env").write_text("K3_IMAGE=my/server:dotenv\n")
    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    args = p.parse_args(["--results", str(clean / "r"), "--models-dir", str(clean / "m")])
    args.deployment = deployment.load_deployment(gpu=args.gpu)
    demo._validate(args)
    pipe = steps.Pipeline("demo", demo.STEPS)
    res = pipe.step("up", functools.partial(demo._make_step, pipe, ["true"],
                                            {"PATH": "/usr/bin:/bin"}, args))
    assert res.ok and res.note.startswith("my/server:dotenv FROM ")


def test_image_defaults_are_compose_files_own():
    import re

    from conftest import REPO

    from k3rocm.serving.settings import Settings

    def default(name: str) -> str:
        found = re.findall(r"^    image: \$\{K3_IMAGE:-([^}]+)\}$", (REPO / name).read_text(),
                           re.MULTILINE)
        assert len(found) == 1, found
        return found[0]

    assert default("compose.yaml") == Settings().image
    assert default(CPU_FILE) == deployment.CPU_IMAGE
