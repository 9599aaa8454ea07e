"""Reading a running container (deploy/provenance.py) on a real Docker engine.

The A/B refuses when two slots' server argv differ, so that argv must be exactly the server's:
a CI run once failed because a process that exited during the /proc scan made ``sh`` print
"cannot open /proc/N/cmdline", and docker-py's non-demuxed output mixed that into the argv.
"""

from __future__ import annotations

import pytest

from k3rocm.deploy.provenance import exec_text, server_argv

pytestmark = pytest.mark.docker

IMAGE = "k3rocm/debian:bookworm"  # .ci/debian-rootfs.sh


@pytest.fixture
def churning_server(docker_client):
    """A container whose `vllm serve ...` process (not pid 1) has a pid that sorts after the
    short-lived processes a loop starts and ends all the time: a /proc scan meets entries that
    vanish before it reaches the server. (The old scan, non-demuxed, came back with
    "cannot open /proc/N/cmdline" in 32 of 40 reads of this container.) pid 1's own cmdline
    must not match the scan, hence the words in the environment."""
    script = ("(while :; do /bin/true; done) & "
              "sh -c 'echo serving; sleep 600; :' \"$A\" \"$B\" /models/k3 "
              "--tensor-parallel-size 8 --api-key s3cret; :")
    container = docker_client.containers.run(
        IMAGE, ["sh", "-c", script], environment={"A": "vllm", "B": "serve"}, detach=True,
        remove=True, network_mode="none")
    try:
        # the server process prints this itself, after its exec: its cmdline is in place
        for line in container.logs(stream=True, follow=True):
            if b"serving" in line:
                break
        yield container
    finally:
        container.kill()


def test_exec_text_is_stdout_only(churning_server):
    assert exec_text(churning_server, ["sh", "-c", "echo out; echo err >&2"]) == "out\n"
    assert exec_text(churning_server, ["sh", "-c", "echo err >&2"]) == ""
    assert exec_text(churning_server, ["sh", "-c", "echo out; exit 3"]) is None


def test_server_argv_is_exact_while_processes_come_and_go(churning_server):
    for _ in range(40):
        argv = server_argv(churning_server)
        assert argv is not None
        assert argv[argv.index("vllm"):] == ["vllm", "serve", "/models/k3",
                                             "--tensor-parallel-size", "8", "--api-key", "***"]
        assert not any("cannot open" in a or "/proc/" in a for a in argv), argv
