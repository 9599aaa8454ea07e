"""Helpers for the overlay's Docker tests (tests/test_overlay_*.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import REPO, _image_exists, need, standin_tag

SITE = "/usr/local/lib/python3.11/dist-packages"
WHEEL_CACHE = Path.home() / ".cache" / "k3rocm" / "wheels-pytest"
LABEL = {"k3rocm.test": "overlay"}


def require_standin(client, version: str) -> str:
    tag = standin_tag(version)
    need(_image_exists(client, tag), f"stand-in image {tag} is missing: build it first "
         "(k3rocm standin / make standin)")
    return tag


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


# Shell run in a throwaway stand-in container: copy the repo parts we need, install
# pytest (offline) and our package (entry point), optionally apply the overlay.
SETUP_SH = """
set -eu
export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1
mkdir -p /tmp/k3 && cd /repo && cp -r pyproject.toml src overlay tests /tmp/k3/
find /tmp/k3 -name __pycache__ -prune -exec rm -rf {} +
python3 -m pip install -q --find-links /wheels pytest >/dev/null
python3 -m pip install -q --no-deps --no-build-isolation /tmp/k3 >/dev/null
cd /tmp/k3
"""


def run_in_standin(client, image: str, script: str, env: dict | None = None,
                   timeout: int = 900, volumes: dict | None = None) -> tuple[int, str]:
    """Run SETUP_SH + script in a fresh container; return (exit code, combined log).
    ``volumes``: more bind mounts (docker SDK form)."""
    wheels = pytest_wheels()
    c = client.containers.run(
        image, entrypoint=["bash", "-c", SETUP_SH + script], detach=True, labels=LABEL,
        environment={"VLLM_TARGET_DEVICE": "cpu", **(env or {})},
        volumes={str(REPO): {"bind": "/repo", "mode": "ro"},
                 str(wheels): {"bind": "/wheels", "mode": "ro"}, **(volumes or {})},
        shm_size="1g",
    )
    try:
        rc = c.wait(timeout=timeout)["StatusCode"]
        log = c.logs(stdout=True, stderr=True).decode(errors="replace")
    finally:
        c.remove(force=True)
    return rc, log
