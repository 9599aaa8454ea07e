"""`k3rocm selftest run`: the deployment of `make up` with only K3_MODEL and K3_PORT changed, in
its own compose project; run record first; the server always stopped and its log kept.

The compose server is replaced by a recorder (no Docker): what is checked here is what the
command asks of deploy.lifecycle.ComposeServer, the settings it renders and the run directory.
The real compose server is covered by the lifecycle tests."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from k3rocm import cli
from k3rocm.deploy.deployment import load_deployment
from k3rocm.deploy.lifecycle import ComposeServer
from k3rocm.errors import ServerError


@pytest.fixture
def node(tmp_path, monkeypatch):
    models, results = tmp_path / "models", tmp_path / "results"
    for d in ("Kimi-K3", "Kimi-K3-selftest"):
        (models / d).mkdir(parents=True)
        (models / d / "config.json").write_text("{}")
    env_file = tmp_path / "settings.env"
    env_file.write_text(f"K3_MODELS_DIR={models}\nK3_RESULTS_DIR={results}\n"
                        "K3_PORT=8100\nK3_MAX_MODEL_LEN=16384\n")
    for k in ("K3_MODELS_DIR", "K3_RESULTS_DIR", "K3_PORT", "K3_MODEL", "COMPOSE_FILE",
              "K3_PROFILE", "K3_IMAGE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("COMPOSE_FILE", "compose.yaml")  # the GPU node's compose files
    return tmp_path, env_file


class Recorder:
    def __init__(self, monkeypatch, wait=None):
        self.calls: list[tuple] = []
        self.servers: list[ComposeServer] = []
        rec = self

        def up(srv, build=False):
            rec.servers.append(srv)
            rec.calls.append(("up", build))

        def wait_(srv, timeout, every=10, quiet=False):
            rec.calls.append(("wait", timeout))
            if wait is not None:
                raise wait
            return 12.5

        def down(srv, log_path=None, timeout=60):
            rec.calls.append(("down", log_path))
            Path(log_path).write_text("server log\n")

        monkeypatch.setattr(ComposeServer, "up", up)
        monkeypatch.setattr(ComposeServer, "wait", wait_)
        monkeypatch.setattr(ComposeServer, "down", down)
        monkeypatch.setattr(ComposeServer, "provenance",
                            lambda srv, client=None: {"vllm_version": "x", "project": srv.project})


def _run_dir(tmp: Path) -> Path:
    (d,) = (tmp / "results").iterdir()
    return d


def test_serves_the_slice_as_make_up_would(node, monkeypatch, capsys):
    tmp, env_file = node
    rec = Recorder(monkeypatch)
    assert cli.main(["selftest", "run", "--env-file", str(env_file)]) == 0
    (srv,) = rec.servers
    assert srv.project == "k3rocm-selftest" and not srv.cpu
    assert srv.env == {"K3_MODEL": "/models/Kimi-K3-selftest", "K3_PORT": "8101"}
    assert srv.url == "http://127.0.0.1:8101" and srv.model == "moonshotai/Kimi-K3"
    assert [c[0] for c in rec.calls] == ["up", "wait", "down"]
    assert rec.calls[0] == ("up", True)  # built first, as `make up`
    # everything but the model and the port rendered exactly as the deployment's own server
    base = load_deployment(env_file=str(env_file), check_model=True)
    mine = load_deployment({**os.environ, **srv.env}, env_file=str(env_file))
    assert mine.rendered.env == base.rendered.env
    swap = {base.model: mine.model, str(base.port): str(mine.port)}
    assert mine.rendered.argv == [swap.get(a, a) for a in base.rendered.argv]
    assert "16384" in mine.rendered.argv  # the .env setting reached it
    run_dir = _run_dir(tmp)
    assert run_dir.name.endswith("-selftest")
    assert rec.calls[-1] == ("down", run_dir / "server.log")
    assert (run_dir / "server.log").read_text() == "server log\n"
    prov = json.loads((run_dir / "provenance.json").read_text())
    assert prov["deployment"]["model"] == "/models/Kimi-K3-selftest"
    assert prov["server"]["project"] == "k3rocm-selftest"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["result"] == "served" and summary["server_ready_s"] == 12.5


@pytest.mark.parametrize("error,code,result", [
    (KeyboardInterrupt(), 130, "interrupted"),
    (ServerError("the server container exited"), 3, "failed: the server container exited"),
])
def test_server_stopped_and_log_kept_on_failure(node, monkeypatch, capsys, error, code, result):
    tmp, env_file = node
    rec = Recorder(monkeypatch, wait=error)
    assert cli.main(["selftest", "run", "--env-file", str(env_file), "--no-build"]) == code
    assert [c[0] for c in rec.calls] == ["up", "wait", "down"] and rec.calls[0] == ("up", False)
    run_dir = _run_dir(tmp)
    assert (run_dir / "server.log").is_file() and (run_dir / "provenance.json").is_file()
    assert json.loads((run_dir / "summary.json").read_text())["result"] == result


def test_bad_input_starts_nothing(node, monkeypatch, capsys, tmp_path):
    tmp, env_file = node
    rec = Recorder(monkeypatch)
    for argv, msg in (
        (["--model", str(tmp_path / "elsewhere")], "not under K3_MODELS_DIR"),
        (["--model", "/models/missing"], "does not exist"),
        (["--port", "8100"], "the deployment's own port"),
        (["--port", "0"], "must be 1..65535"),
        (["--timeout", "0"], "must be > 0"),
    ):
        assert cli.main(["selftest", "run", "--env-file", str(env_file), *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert msg in err and err.startswith("k3rocm: error:") and "\n" not in err
    assert rec.calls == [] and not (tmp / "results").exists()
    # a host path under K3_MODELS_DIR is the container's /models/...
    ok = tmp / "models" / "Kimi-K3-selftest"
    assert cli.main(["selftest", "run", "--env-file", str(env_file), "--model", str(ok)]) == 0
    assert rec.servers[0].env["K3_MODEL"] == "/models/Kimi-K3-selftest"
