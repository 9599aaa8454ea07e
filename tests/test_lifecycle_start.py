"""A server that fails to start (``K3_MODEL=/models/no-such-model``: the entrypoint exits 2 in
seconds), on the real engine with the real compose files and the CPU stand-in image.

``k3rocm server up`` exits 3, the container stopped and removed, its log saved in a run
directory the error names; plain ``docker compose up`` gives up after compose.yaml's
``on-failure:2``.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from conftest import REPO, _image_exists, free_port, project_containers, run_cli

from k3rocm.deploy.lifecycle import ComposeServer
from k3rocm.deploy.runrecord import FILENAME

IMAGE = os.environ.get("K3_SERVER_IMAGE") or "k3rocm/server:cpu-0.32.0"  # server_fixture's


@pytest.fixture
def image(request, docker_client) -> str:
    """The stand-in serving image, built only when missing."""
    return IMAGE if _image_exists(docker_client, IMAGE) else request.getfixturevalue(
        "server_image")


def _env(tmp_path, image: str) -> dict[str, str]:
    for d in ("models", "cache", "results"):
        (tmp_path / d).mkdir(exist_ok=True)
    return {"K3_IMAGE": image, "K3_PROFILE": "cpu-smoke", "K3_MODEL": "/models/no-such-model",
            "K3_PORT": str(free_port()), "K3_MODELS_DIR": str(tmp_path / "models"),
            "K3_CACHE_DIR": str(tmp_path / "cache"), "K3_RESULTS_DIR": str(tmp_path / "results")}


def _remove(project: str) -> None:
    ComposeServer(project=project, cpu=True, inherit_env=False).down(timeout=0)


@pytest.mark.docker
def test_make_up_stops_a_server_that_fails_to_start_and_keeps_its_log(image, tmp_path):
    project = f"k3failstart-{os.getpid()}"
    env = _env(tmp_path, image)
    t0 = time.monotonic()
    try:
        r = run_cli("server", "up", "--project", project, "--env-file", str(tmp_path / ".env"),
                    "--timeout", "600", env=env, timeout=900)
        took = time.monotonic() - t0
        left = project_containers(project)
    finally:
        _remove(project)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 3, r.stdout + r.stderr
    assert not left, f"containers left in {project}: {left}; stderr: {r.stderr[-1500:]}"
    last = err[-1]
    assert last.startswith("k3rocm: error: the server container ") and "exited" in last, last
    assert "before it became ready; stopped and removed" in last, last
    assert "not healthy within" not in last  # seen from the container's state, not a timeout
    m = re.search(r"its log: (\S+)$", last)
    assert m, last
    log = Path(m.group(1))
    assert log.is_file() and log.parent.parent == tmp_path / "results", log
    # the run directory `make down` writes: the run record of what was serving, then the log
    assert log.parent.name.endswith("-server-log") and (log.parent / FILENAME).is_file(), \
        sorted(p.name for p in log.parent.iterdir())
    text = log.read_text()
    assert "k3rocm: error:" in text and "/models/no-such-model" in text, text[-2000:]
    # the last log lines are on the terminal too, before the error line
    assert any("/models/no-such-model" in ln for ln in err[:-1]), r.stderr[-2000:]
    assert took < 300, f"{took:.0f} s"


@pytest.mark.docker
def test_plain_docker_compose_up_gives_up_after_two_restarts(image, tmp_path):
    project = f"k3restarts-{os.getpid()}"
    srv = ComposeServer(project=project, cpu=True, env=_env(tmp_path, image), inherit_env=False)
    try:
        p = srv.compose("up", "--no-build", "server", timeout=600)  # foreground, as a user
        c = srv.container()
        assert c is not None
        state, restarts = c.attrs["State"], c.attrs["RestartCount"]
        # the container's own log keeps every attempt; compose's attached output can miss one
        # ("context canceled" as it re-attaches after a restart, seen in a loaded CI run)
        log = c.logs().decode(errors="replace")
    finally:
        srv.down(timeout=0)
    out = p.stdout + p.stderr  # compose's own exit code: 0 or 1 (seen both); it returned
    assert (state["Status"], state["ExitCode"], restarts) == ("exited", 2, 2), (state, out)
    assert log.count("/models/no-such-model") == 3, log[-3000:]  # 3 attempts, each logged once


@pytest.mark.docker
def test_compose_files_give_the_server_a_bounded_restart_policy():
    """`docker compose config` accepts compose.yaml (GPU) and with compose.cpu.yaml, each with
    a bounded restart policy."""
    import json

    for files in (["compose.yaml"], ["compose.yaml", "compose.cpu.yaml"]):
        args = [a for f in files for a in ("-f", str(REPO / f))]
        p = subprocess.run(["docker", "compose", *args, "config", "--format", "json"],
                           capture_output=True, text=True, timeout=120, cwd=REPO,
                           env={k: v for k, v in os.environ.items() if not k.startswith("K3_")})
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["services"]["server"]["restart"] == "on-failure:2", files


NEVER = "0001-01-01T00:00:00Z"
UP = {"Status": "running", "ExitCode": 0, "FinishedAt": NEVER, "OOMKilled": False}


@pytest.mark.parametrize("state, restarts, says", [
    (UP, 0, None),
    ({**UP, "Health": {"Status": "starting", "FailingStreak": 40}}, 0, None),
    ({**UP, "Status": "restarting", "ExitCode": 1}, 1,
     "exited with code 1 and is restarting (restart 1 of compose.yaml's restart policy)"),
    ({**UP, "Status": "exited", "ExitCode": 137, "OOMKilled": True}, 0,
     "exited with code 137 (OOM-killed)"),
    ({**UP, "Status": "exited", "ExitCode": 1}, 2, "exited with code 1 after 2 restart(s)"),
    # a poll that sees only the next attempt running: the exit is in FinishedAt
    ({**UP, "FinishedAt": "2026-12-05T08:00:00.1Z"}, 1, "exited and was restarted (restart 1"),
    ({**UP, "Health": {"Status": "unhealthy", "FailingStreak": 3, "Log": [
        {"Output": "urllib.error.URLError: <urlopen error [Errno 111]>\n"}]}}, 0,
     "is unhealthy: /health failed 3 checks in a row after the healthcheck's start period "
     "(urllib.error.URLError: <urlopen error [Errno 111]>)"),
])
def test_failure_reads_the_engines_state(state, restarts, says):
    """ComposeServer.failure on the Engine API's ContainerState and RestartCount."""
    from types import SimpleNamespace

    c = SimpleNamespace(id="c1", reload=lambda: None,
                        attrs={"State": state, "RestartCount": restarts})
    srv = ComposeServer(project="p", inherit_env=False)
    srv.__dict__.update(_container=c, _exits={"c1": NEVER})
    got = srv.failure()
    assert got == says if says is None else (got or "").startswith(says), got


def test_failure_counts_only_exits_after_the_wait_began():
    """`make wait` on a server that crashed and was restarted before: that exit is history."""
    from types import SimpleNamespace

    c = SimpleNamespace(id="c1", reload=lambda: None, attrs={
        "State": {**UP, "FinishedAt": "2026-12-01T00:00:00Z"}, "RestartCount": 1})
    srv = ComposeServer(project="p", inherit_env=False)
    srv.__dict__.update(_container=c, _exits={"c1": "2026-12-01T00:00:00Z"})
    assert srv.failure() is None


def test_gpu_compose_files_on_a_host_without_kfd_are_refused_before_compose(monkeypatch):
    import k3rocm.deploy.lifecycle as lc
    from k3rocm.errors import UsageError

    monkeypatch.setattr(lc, "KFD", Path("/nonexistent/kfd"))
    monkeypatch.setattr(ComposeServer, "compose", lambda *a, **kw: pytest.fail("compose ran"))
    with pytest.raises(UsageError, match=r"/nonexistent/kfd.*CPU=1") as ei:
        ComposeServer(project="p", inherit_env=False).up()
    assert ei.value.exit_code == 2


@pytest.mark.docker
def test_a_container_compose_could_not_start_is_removed(image, tmp_path):
    """The port is taken: compose creates the container and cannot start it; exit 2, and
    nothing of the project is left."""
    import socket

    project = f"k3portbusy-{os.getpid()}"
    env = _env(tmp_path, image)
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        env["K3_PORT"] = str(s.getsockname()[1])
        try:
            r = run_cli("server", "up", "--project", project, "--env-file",
                        str(tmp_path / ".env"), "--timeout", "60", env=env, timeout=600)
            left = project_containers(project)
        finally:
            _remove(project)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "starting the server" in r.stderr and ("already" in r.stderr), r.stderr[-1500:]
    assert not left, f"containers left in {project}: {left}"


def test_a_failed_up_saves_the_log_before_removing_what_compose_created(monkeypatch, tmp_path):
    """`compose up -d` fails after its container ran (e.g. interrupted while waiting for it):
    the log is saved to the caller's path before ``down`` removes the container."""
    import k3rocm.deploy.lifecycle as lc
    from k3rocm.errors import UsageError

    calls = []
    monkeypatch.setattr(lc, "KFD", tmp_path)  # the GPU files' device check passes
    monkeypatch.setattr(ComposeServer, "container", lambda self, client=None: None)
    monkeypatch.setattr(ComposeServer, "compose", lambda self, *a, **kw:
                        subprocess.CompletedProcess(a, 130, "", "Error: interrupted"))
    monkeypatch.setattr(ComposeServer, "down",
                        lambda self, log_path=None, timeout=None: calls.append((log_path, timeout)))
    with pytest.raises(UsageError, match="starting the server .* failed: .*interrupted") as ei:
        ComposeServer(project="p", inherit_env=False).up(log_path=lambda: tmp_path / "s.log")
    assert ei.value.exit_code == 3 and calls == [(tmp_path / "s.log", 0)]
