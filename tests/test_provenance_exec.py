"""provenance.exec_text on a real engine: stdout only (stderr is never data), None on failure."""

from __future__ import annotations

import pytest

from k3rocm.deploy.provenance import exec_text

pytestmark = pytest.mark.docker

IMAGE = "k3rocm/debian:bookworm"  # .ci/debian-rootfs.sh


@pytest.fixture
def container(docker_client):
    c = docker_client.containers.run(IMAGE, ["sh", "-c", "echo up; sleep 600"], detach=True,
                                      remove=True, network_mode="none")
    try:
        for line in c.logs(stream=True, follow=True):  # running: its first line is out
            if b"up" in line:
                break
        yield c
    finally:
        c.kill()


def test_exec_text_is_stdout_only(container):
    assert exec_text(container, ["sh", "-c", "echo out; echo err >&2"]) == "out\n"
    assert exec_text(container, ["sh", "-c", "echo err >&2"]) == ""
    assert exec_text(container, ["sh", "-c", "echo out; exit 3"]) is None
