"""Shared fixtures. Tests that need Docker fail (never skip) when CI=true and the engine is missing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/ helpers importable
PRIVATE_SOCKET = "/run/k3d/docker.sock"  # .ci/dockerd.sh
if "DOCKER_HOST" not in os.environ and Path(PRIVATE_SOCKET).exists():
    os.environ["DOCKER_HOST"] = f"unix://{PRIVATE_SOCKET}"

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def need(condition: bool, why: str) -> None:
    """Skip locally, fail in CI: a skip is not a pass there."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"CI=true but {why}", pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="session")
def docker_client():
    try:
        import docker

        client = docker.from_env(timeout=600)
        client.ping()
    except Exception as exc:  # noqa: BLE001 - any failure means "no engine"
        need(False, f"no Docker engine ({exc.__class__.__name__}: {exc}); start it with "
             ".ci/dockerd.sh start")
    return client


def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess:
    """Run `python -m k3rocm ...` in a subprocess with a clean K3_* environment."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("K3_")}
    base["PYTHONPATH"] = str(REPO / "src")
    return subprocess.run([sys.executable, "-m", "k3rocm", *args], env={**base, **(env or {})},
                          cwd=cwd or REPO, capture_output=True, text=True, timeout=timeout)
