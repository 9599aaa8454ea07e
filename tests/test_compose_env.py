"""What `make config` prints is what the server container gets (real compose, stand-in image):
shell and `.env` vendor values reach the container, nothing printed is missing or different.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from conftest import REPO
from server_fixture import MODELS_DIR, ensure_smoke_model

pytestmark = pytest.mark.docker


def test_config_printout_is_what_the_container_gets(docker_client, server_image, tmp_path):
    ensure_smoke_model(docker_client, server_image)
    (tmp_path / ".env").write_text(
        "K3_MAX_NUM_SEQS=4\nVLLM_ROCM_USE_AITER_MLA=0\nNCCL_DEBUG=INFO\n"
        "HF_HOME=/cache/hf-from-dotenv\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3_")}
    env.update({
        "K3_PROFILE": "cpu-smoke", "K3_IMAGE": server_image, "K3_TP": "1",
        "K3_MODELS_DIR": str(MODELS_DIR), "K3_CACHE_DIR": str(tmp_path / "cache"),
        "K3_RESULTS_DIR": str(tmp_path / "results"),
        "K3_VENDOR_ENV_FILE": str(tmp_path / "vendor.env"),
        "VLLM_LOGGING_LEVEL": "DEBUG", "AITER_LOG_MORE": "1",  # set in the shell
        "HF_HOME": "/home/someone/.cache/huggingface",  # a host path: stays on the host
        "COMPOSE_FILE": f"{REPO / 'compose.yaml'}:{REPO / 'compose.cpu.yaml'}",
        "PYTHONPATH": str(REPO / "src"),
    })
    host = subprocess.run(
        ["python3", "-m", "k3rocm", "config", "--json", "--host-paths",
         "--vendor-env-file", str(tmp_path / "vendor.env")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert host.returncode == 0, host.stderr
    printed = json.loads(host.stdout)["env"]
    inside = subprocess.run(
        ["docker", "compose", "--project-directory", str(tmp_path), "-p", "k3rocm-envtest",
         "run", "--rm", "--no-deps", "--pull", "never", "server", "--print"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert inside.returncode == 0, inside.stderr[-3000:]
    got = json.loads(inside.stdout)["env"]
    print("host:", json.dumps(printed, sort_keys=True))
    print("container:", json.dumps(got, sort_keys=True))
    for key in ("VLLM_ROCM_USE_AITER_MLA", "NCCL_DEBUG", "VLLM_LOGGING_LEVEL", "AITER_LOG_MORE"):
        assert key in printed, key  # the user set them: printed, with their source
    assert printed["HF_HOME"] == "/cache/hf-from-dotenv"  # .env wins; the shell's host path not
    diff = {k: (v, got.get(k)) for k, v in printed.items() if got.get(k) != v}
    assert diff == {}, diff


def test_the_image_checks_what_its_own_vllm_knows(docker_client, server_image):
    """The entrypoint warns on a VLLM_* typo (closest name) and refuses a load format the
    image's vLLM lacks (0.32.0: bitsandbytes), from the base facts the build recorded."""
    def run(**env):
        env = {"K3_PROFILE": "cpu-smoke", "K3_MODEL": "/tmp", **env}
        return subprocess.run(["docker", "run", "--rm", *(a for k, v in env.items()
                                                          for a in ("-e", f"{k}={v}")),
                               server_image, "--print"], capture_output=True, text=True,
                              timeout=120)

    typo = run(VLLM_ROCM_USE_AITR="1", VLLM_LOGGING_LEVEL="DEBUG")
    assert typo.returncode == 0, typo.stderr
    warned = [ln for ln in typo.stderr.splitlines() if "warning" in ln]
    assert len(warned) == 1 and "did you mean VLLM_ROCM_USE_AITER?" in warned[0], typo.stderr
    assert json.loads(typo.stdout)["env"]["VLLM_ROCM_USE_AITR"] == "1"
    bnb = run(K3_LOAD_FORMAT="bitsandbytes")
    assert bnb.returncode == 2 and "is not a load format of this base's vLLM" in bnb.stderr
