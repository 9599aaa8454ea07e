"""The overlay's Docker helpers: one container runner, the stand-ins, in-container pytest."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from conftest import REPO, _image_exists, need, standin_tag

SITE = "/usr/local/lib/python3.11/dist-packages"
WHEEL_CACHE = Path.home() / ".cache" / "k3rocm" / "wheels-pytest"
LABEL = {"k3rocm.test": "overlay"}


def require_image(client, tag: str) -> str:
    need(_image_exists(client, tag), f"image {tag} is missing: build it first "
         "(k3rocm standin / make standin)")
    return tag


def require_standin(client, version: str) -> str:
    return require_image(client, standin_tag(version))


def run_container(client, image: str, script: str, env: dict | None = None,
                  volumes: dict | None = None, timeout: int = 900) -> tuple[int, str]:
    """``bash -c script`` in a fresh labelled container (VLLM_TARGET_DEVICE=cpu); return (exit
    code, combined log). ``volumes``: bind mounts in docker SDK form."""
    c = client.containers.run(image, entrypoint=["bash", "-c", script], detach=True,
                              labels=LABEL, shm_size="1g", volumes=volumes or {},
                              environment={"VLLM_TARGET_DEVICE": "cpu", **(env or {})})
    try:
        rc = c.wait(timeout=timeout)["StatusCode"]
        return rc, c.logs(stdout=True, stderr=True).decode(errors="replace")
    finally:
        c.remove(force=True)


def sections(log: str) -> dict[str, str]:
    """A log split at the script's ``=== NAME`` lines."""
    parts = re.split(r"^=== (\S+)$", log, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def pytest_wheels() -> Path:
    """pytest and its pure-Python deps as wheels (for offline install in containers)."""
    marker = WHEEL_CACHE / ".complete"
    if marker.exists():
        return WHEEL_CACHE
    import pytest

    WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
    p = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:",
                        "-d", str(WHEEL_CACHE), f"pytest=={pytest.__version__}"],
                       capture_output=True, text=True, timeout=300)
    need(p.returncode == 0, f"cannot download pytest wheels: {p.stderr[-500:]}")
    marker.touch()
    return WHEEL_CACHE


# Copy the repo parts we need, install pytest (offline) and our package (entry point).
SETUP_SH = """
set -eu
export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1
mkdir -p /tmp/k3 && cd /repo && cp -r pyproject.toml src overlay tests /tmp/k3/
find /tmp/k3 -name __pycache__ -prune -exec rm -rf {} +
python3 -m pip install -q --find-links /wheels pytest >/dev/null
python3 -m pip install -q --no-deps --no-build-isolation /tmp/k3 >/dev/null
cd /tmp/k3
"""


def run_in_standin(client, image: str, script: str, before: str = "",
                   volumes: dict | None = None, timeout: int = 900) -> tuple[int, str]:
    """``before`` (the image as built, the repo at /repo), SETUP_SH, then ``script``."""
    return run_container(client, image, before + SETUP_SH + script, timeout=timeout,
                         volumes={str(REPO): {"bind": "/repo", "mode": "ro"},
                                  str(pytest_wheels()): {"bind": "/wheels", "mode": "ro"},
                                  **(volumes or {})})
