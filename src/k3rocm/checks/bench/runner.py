"""aiperf in the client container: the image, the mounts and the version; the container itself
runs through :func:`k3rocm.deploy.engine.run_client` (the one client-container runner).

The container uses the host network (so ``http://127.0.0.1:<port>`` reaches the server), mounts
the run directory and the tokenizer directory at their host paths (so the printed command is
the one that ran), and runs as the calling user so results are not root-owned.
HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE are deliberately NOT set: aiperf 0.13.0 fails to load a
local tokenizer directory when either is set to anything (HFValidationError, even with 0).
"""

from __future__ import annotations

import os
from pathlib import Path

from k3rocm import __version__
from k3rocm.deploy.engine import docker_client, image_id  # noqa: F401 - re-exported

CLIENT_IMAGE = f"k3rocm/clients:{__version__}"
AIPERF_VERSION = "0.13.0"
LABEL = "k3rocm.bench"
# Mounting below these would shadow what the client image needs; elsewhere (also below /tmp,
# /root, /var, /run) a host path is mounted at the same path.
_SYSTEM_PREFIXES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/opt/clients",
                    "/proc", "/sbin", "/sys", "/usr")
_SYSTEM_DIRS = ("/", "/tmp", "/root", "/run", "/var", "/opt", "/home", "/mnt")


def container_path(host: str | os.PathLike) -> str:
    """Where a host path is mounted in the client: the same path, unless it would shadow a
    system directory of the image."""
    p = str(Path(host).resolve())
    if p in _SYSTEM_DIRS or any(p == s or p.startswith(s + "/") for s in _SYSTEM_PREFIXES):
        return "/mnt/k3bench" + p
    return p


def client_aiperf_version(client, image: str) -> str | None:
    try:
        out = client.containers.run(image, ["aiperf", "--version"], remove=True,
                                    network_mode="none", labels={LABEL: "client-version"})
        return out.decode().strip().splitlines()[-1]
    except Exception:  # noqa: BLE001
        return None

