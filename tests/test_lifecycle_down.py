"""`make down` keeps the grace period the container was created with (a scale node's override:
drain + 30 s), read from the engine's own SIGTERM -> SIGKILL events: 3 s here against
compose.yaml's 40 s.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from k3rocm.deploy.lifecycle import ComposeServer

pytestmark = pytest.mark.docker

IMAGE = "k3rocm/debian:bookworm"  # .ci/debian-rootfs.sh
BASE = f"""services:
  server:
    image: {IMAGE}
    command: ["sh", "-c", "trap '' TERM; echo serving; while :; do sleep 1; done"]
    stop_grace_period: 40s
"""
NODE = """services:
  server:
    stop_grace_period: 3s
"""


def test_down_keeps_the_containers_own_grace_period(docker_client, tmp_path):
    (tmp_path / "compose.yaml").write_text(BASE)
    (tmp_path / "node2.yaml").write_text(NODE)
    project = f"k3down-{int(time.time() * 1000) % 10**9}"
    up = subprocess.run(["docker", "compose", "-p", project, "-f", "compose.yaml", "-f",
                         "node2.yaml", "up", "-d"], cwd=tmp_path, capture_output=True,
                        text=True, timeout=120)
    assert up.returncode == 0, up.stderr
    srv = ComposeServer(project=project, repo=tmp_path, inherit_env=False)
    try:
        c = srv.container(docker_client)
        assert c is not None and c.attrs["Config"]["StopTimeout"] == 3
        for line in c.logs(stream=True, follow=True):  # the TERM trap is set
            if b"serving" in line:
                break
        since = int(time.time()) - 1
        srv.down()
        events = docker_client.events(since=since, until=int(time.time()) + 1, decode=True,
                                      filters={"container": c.id, "event": "kill"})
        kills = {e["Actor"]["Attributes"].get("signal"): e["timeNano"] for e in events}
        assert {"15", "9"} <= set(kills), kills
        grace = (kills["9"] - kills["15"]) / 1e9
        assert 2.5 <= grace < 20, f"SIGKILL {grace:.1f} s after SIGTERM (expected the 3 s grace)"
        assert docker_client.containers.list(all=True, filters={"id": c.id}) == []
    finally:
        subprocess.run(["docker", "compose", "-p", project, "-f", "compose.yaml", "down", "-t",
                        "0"], cwd=tmp_path, capture_output=True, timeout=120)
