"""Router instances on one host, the router-down drain timeout, one-line refusals (no Docker;
the live drain: test_scale_standin.py)."""

from __future__ import annotations

import pytest
from conftest import run_cli

from k3rocm.deploy.scale.render import router_argv
from k3rocm.deploy.scale.router import STOP_TIMEOUT_S, instance, stop_router
from k3rocm.deploy.scale.settings import load_scale
from k3rocm.errors import UsageError

TWO = {"K3_SCALE_MODE": "replicas", "K3_SCALE_NODES": "10.0.0.1:8000,10.0.0.2:8000"}


def _arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_instance_two_has_its_own_name_and_ports():
    s = load_scale(TWO, dotenv=None)
    assert instance(s, 1) == ("k3rocm-router", s)  # today's router, unchanged
    name, s2 = instance(s, 2)
    assert name == "k3rocm-router-2"
    argv = router_argv(s2)
    assert (_arg(argv, "--port"), _arg(argv, "--prometheus-port")) == ("8081", "29001")
    assert s2.router_url == "http://127.0.0.1:8081"
    assert argv[argv.index("--worker-urls"):] == router_argv(s)[argv.index("--worker-urls"):]


@pytest.mark.parametrize(("env", "n", "fragment"), [
    ({}, 0, "use 1..16"),
    ({}, 17, "use 1..16"),
    ({"K3_SCALE_ROUTER_PORT": "65535"}, 2, "> 65535"),
    ({"K3_SCALE_ROUTER_PORT": "9000", "K3_SCALE_ROUTER_METRICS_PORT": "9001"}, 2, "overlap"),
])
def test_instance_refusals(env, n, fragment):
    s = load_scale({**TWO, **env}, dotenv=None)
    with pytest.raises(UsageError, match=fragment):
        instance(s, n)


class _Container:
    def __init__(self):
        self.status, self.attrs, self.calls = "running", {"State": {"ExitCode": 0}}, []

    def stop(self, timeout):
        self.calls.append(("stop", timeout))

    def reload(self):
        pass

    def remove(self, force):
        self.calls.append(("remove", force))


class _Client:
    def __init__(self, container):
        self.containers = self
        self._c = container

    def get(self, name):
        import docker

        if self._c is None:
            raise docker.errors.NotFound(name)
        return self._c


def test_stop_router_waits_for_the_request_timeout_by_default():
    from k3rocm.deploy.scale.render import ROUTER_REQUEST_TIMEOUT_S

    assert STOP_TIMEOUT_S > ROUTER_REQUEST_TIMEOUT_S
    c = _Container()
    assert stop_router(_Client(c), "r") is True
    assert c.calls == [("stop", STOP_TIMEOUT_S), ("remove", True)]
    c = _Container()
    stop_router(_Client(c), "r", timeout=60)
    assert c.calls[0] == ("stop", 60)
    assert stop_router(_Client(None), "r") is False


@pytest.mark.parametrize(("args", "fragment"), [
    (["router-down", "--instance", "two"], "--instance (make ROUTER=)='two' is not valid"),
    (["router-up", "--instance", "17"], "router instance 17 is out of range"),
    (["router-down", "--timeout", "1h"], "--timeout (make ROUTER_TIMEOUT=)='1h' is not valid"),
])
def test_cli_refuses_bad_instance_and_timeout(args, fragment):
    r = run_cli("scale", *args, env={**TWO, "DOCKER_HOST": "unix:///nonexistent.sock"})
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], r.stderr
