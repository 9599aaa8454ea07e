"""The real Dockerfile in the real Docker engine: build, --print, manifest, signal handling."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from conftest import REPO, standin_tag

from k3rocm.serving.config import render

pytestmark = pytest.mark.docker

# A stand-in `vllm` that waits for SIGTERM and exits 0: put first on PATH, it shows that the
# signal reaches the process the entrypoint exec'd (no shell or Python wrapper in between).
FAKE_VLLM = """#!/usr/bin/env python3
import signal, sys
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
print("handler-installed", flush=True)
while True:
    signal.pause()
"""


def _run(client, image, command=None, **kw):
    out = client.containers.run(image, command=command, remove=True, stdout=True, stderr=True,
                                **kw)
    return out.decode()


def test_print_inside_the_image_matches_the_host_render(docker_client, server_image):
    # /tmp stands in for the checkpoint (/models/Kimi-K3 must exist where vLLM runs)
    env = {"K3_TP": "4", "K3_MTP_K": "0", "VLLM_ROCM_USE_AITER_MLA": "0", "K3_MODEL": "/tmp"}
    out = json.loads(_run(docker_client, server_image, ["--print", "--seed", "3"],
                          environment=env))
    # inside, the image's own environment (ENV lines of the base) is part of the process env
    image_env = dict(kv.split("=", 1) for kv in
                     docker_client.images.get(server_image).attrs["Config"]["Env"] or [])
    # and so are the base facts the image build recorded (the entrypoint applies them)
    facts = json.loads(_run(docker_client, server_image, ["manifest", "show"],
                            entrypoint=["k3rocm"]))["base_facts"]
    host = render(environ={**image_env, **env}, dotenv=None,
                  passthrough=["--seed", "3"], base=facts).to_json()
    assert out["base"].pop("facts_from") == "/opt/k3rocm/manifest.json (measured at image build)"
    host["base"].pop("facts_from")
    assert out == host


def test_invalid_setting_fails_fast_inside_the_image(docker_client, server_image):
    c = docker_client.containers.run(server_image, environment={"K3_TP": "7"}, detach=True)
    try:
        status = c.wait(timeout=120)
        logs = c.logs().decode().strip().splitlines()
    finally:
        c.remove(force=True)
    assert status["StatusCode"] == 2
    assert logs == [logs[-1]] and "K3_TP='7'" in logs[-1] and "Traceback" not in "".join(logs)


def test_manifest_names_base_image_and_vllm(docker_client, server_image):
    out = _run(docker_client, server_image, ["manifest", "show"], entrypoint=["k3rocm"])
    m = json.loads(out)
    assert m["base_image"] == standin_tag()
    assert m["base_digest"] == "unknown (built from a local tag)"  # a local build has none
    assert m["vllm_version"] and m["k3rocm_version"]
    assert m["k3rocm_git_rev"] == "test"
    assert "vllm/models/kimi_k3/amd/mla.py" in m["overlay"]["source_files"]
    assert m["overlay"]["report"] is not None  # what the overlay step decided
    labels = docker_client.images.get(server_image).labels
    assert labels["org.opencontainers.image.base.name"] == standin_tag()


def test_docker_stop_reaches_the_server_process(docker_client, server_image, tmp_path):
    fake = tmp_path / "bin" / "vllm"
    fake.parent.mkdir()
    fake.write_text(FAKE_VLLM)
    fake.chmod(0o755)
    c = docker_client.containers.run(
        server_image, detach=True, init=True,
        environment={"PATH": "/fakebin:/usr/local/bin:/usr/bin:/bin",
                     "K3_PROFILE": "cpu-smoke", "K3_MODEL": "/tmp"},
        volumes={str(fake.parent): {"bind": "/fakebin", "mode": "ro"}})
    try:
        deadline = time.time() + 60
        procs: list = []
        while time.time() < deadline:
            c.reload()
            if c.status == "running":
                procs = [" ".join(p[-1:]) for p in c.top(ps_args="-eo pid,args")["Processes"]]
                # the process shows up before Python has installed its SIGTERM handler: wait
                # for the line it prints after installing it (else docker stop races it: 143)
                if (any("/fakebin/vllm" in p for p in procs)
                        and b"handler-installed" in c.logs()):
                    break
            time.sleep(0.5)
        # The entrypoint shell and the Python renderer are gone: exec replaced them.
        assert any("/fakebin/vllm serve /tmp" in p for p in procs), procs
        assert not any("-m k3rocm" in p or p.startswith(("/bin/sh", "sh "))
                       for p in procs), procs
        t0 = time.time()
        c.stop(timeout=30)
        elapsed = time.time() - t0
        c.reload()
        assert c.attrs["State"]["ExitCode"] == 0
        assert elapsed < 5, f"docker stop took {elapsed:.1f}s: SIGTERM did not reach the server"
    finally:
        c.remove(force=True)


def test_linters_are_clean():
    import subprocess

    bin_dir = Path(REPO / ".venv/bin")
    dockerfiles = [str(p.relative_to(REPO)) for p in [REPO / "Dockerfile",
                                                      *sorted(REPO.glob("docker/*/Dockerfile"))]]
    shells = ["entrypoint.sh", ".ci/run", ".ci/demo", *sorted(str(p.relative_to(REPO))
                                                  for p in REPO.glob(".ci/*.sh"))]
    for cmd in ([str(bin_dir / "ruff"), "check", "."], [str(bin_dir / "hadolint"), *dockerfiles],
                [str(bin_dir / "shellcheck"), *shells]):
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}"
