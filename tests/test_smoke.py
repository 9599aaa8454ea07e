"""`make smoke` as a user runs it: the real compose files, our Dockerfile FROM the stand-in,
the tiny model served through our entrypoint, one streamed request, teardown."""

from __future__ import annotations

import re
import sys

import pytest
from conftest import _image_exists, free_port, make, make_exit_code, need, standin_tag
from server_fixture import MODELS_DIR

pytestmark = [pytest.mark.docker, pytest.mark.server]
PROJECT = "k3rocm-smoke-test"


def test_make_smoke_builds_serves_streams_and_tears_down(docker_client, tmp_path):
    need(_image_exists(docker_client, standin_tag()), f"{standin_tag()} is missing: make standin")
    port = free_port()
    proc = make("smoke", f"SMOKE_ARGS=--port {port} --project {PROJECT} --models-dir "
                f"{MODELS_DIR} --max-tokens 24 --results {tmp_path}", timeout=1200)
    err = proc.stderr
    print(err[-1500:], file=sys.stderr)
    assert make_exit_code(proc) == 0, err[-3000:]
    assert "server healthy after" in err
    m = re.search(r"completion_tokens (\d+), TTFT ([\d.]+) ms, ([\d.]+) tokens/s", err)
    assert m, err[-2000:]
    assert int(m.group(1)) == 24 and float(m.group(2)) > 0 and float(m.group(3)) > 0
    assert proc.stdout.strip(), "the streamed tokens are printed"
    left = docker_client.containers.list(
        all=True, filters={"label": f"com.docker.compose.project={PROJECT}"})
    assert not left, [c.name for c in left]
    # the server's log was saved into the command's run directory before it was removed
    log = next(tmp_path.glob("*-smoke")) / "server.log"
    assert "Application startup complete" in log.read_text()
