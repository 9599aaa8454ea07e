"""Run aiperf as a real process in the client container (docker-py) and collect what it wrote.

The container uses the host network (so ``http://127.0.0.1:<port>`` reaches the server), mounts
the run directory and the tokenizer directory at their host paths (so the printed command is
the one that ran), and runs as the calling user so results are not root-owned.
HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE are deliberately NOT set: aiperf 0.13.0 fails to load a
local tokenizer directory when either is set to anything (brief section 5).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from k3rocm import __version__
from k3rocm.errors import UsageError

CLIENT_IMAGE = f"k3rocm/clients:{__version__}"
AIPERF_VERSION = "0.13.0"
LABEL = "k3rocm.bench"
# Mounting below these would shadow what the client image needs; elsewhere (also below /tmp,
# /root, /var, /run) a host path is mounted at the same path.
_SYSTEM_PREFIXES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/opt/clients",
                    "/proc", "/sbin", "/sys", "/usr")
_SYSTEM_DIRS = ("/", "/tmp", "/root", "/run", "/var", "/opt", "/home", "/mnt")
# Environment the client never gets (the aiperf offline bug; secrets).
NEVER_PASS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def container_path(host: str | os.PathLike) -> str:
    """Where a host path is mounted in the client: the same path, unless it would shadow a
    system directory of the image."""
    p = str(Path(host).resolve())
    if p in _SYSTEM_DIRS or any(p == s or p.startswith(s + "/") for s in _SYSTEM_PREFIXES):
        return "/mnt/k3bench" + p
    return p


@dataclass
class ClientResult:
    exit_code: int | None
    interrupted: bool
    seconds: float
    log_path: Path
    container_name: str


def docker_client():
    try:
        import docker

        client = docker.from_env(timeout=600)
        client.ping()
        return client
    except ModuleNotFoundError:
        raise UsageError("docker-py is not installed: pip install 'k3rocm[host]'", 2) from None
    except Exception as exc:  # noqa: BLE001 - any failure means "no engine"
        raise UsageError(f"cannot reach the Docker engine ({exc.__class__.__name__}); start "
                         f"Docker or set DOCKER_HOST", 2) from None


def check_client_image(client, image: str) -> str:
    import docker

    try:
        return client.images.get(image).id
    except docker.errors.ImageNotFound:
        raise UsageError(f"client image {image!r} not found: build it with `make clients-image` "
                         f"(or pass --client-image)", 2) from None


def client_aiperf_version(client, image: str) -> str | None:
    try:
        out = client.containers.run(image, ["aiperf", "--version"], remove=True,
                                    network_mode="none", labels={LABEL: "client-version"})
        return out.decode().strip().splitlines()[-1]
    except Exception:  # noqa: BLE001
        return None


def run_client(client, image: str, argv: list[str], mounts: dict[str, tuple[str, str]],
               log_path: Path, name: str, progress: bool = True,
               env: dict[str, str] | None = None) -> ClientResult:
    """Run ``argv`` in a fresh client container; stream its output to ``log_path`` (and to
    stderr when ``progress``). Ctrl-C stops aiperf gracefully (SIGINT, then stop) and returns
    with ``interrupted=True``; the log and whatever aiperf finished are kept."""
    run_env = {"HOME": "/tmp", "HF_HOME": "/tmp/hf-home", "XDG_CACHE_HOME": "/tmp/.cache",
               "PYTHONUNBUFFERED": "1", "TERM": "dumb", "COLUMNS": "120"}
    run_env.update(env or {})
    for k in NEVER_PASS:
        run_env.pop(k, None)
    volumes = {host: {"bind": cpath, "mode": mode} for host, (cpath, mode) in mounts.items()}
    user = f"{os.getuid()}:{os.getgid()}" if hasattr(os, "getuid") else None
    t0 = time.time()
    container = client.containers.run(
        image, argv, name=name, detach=True, network_mode="host", environment=run_env,
        volumes=volumes, user=user, working_dir="/tmp", shm_size="1g",
        labels={LABEL: "client"})
    interrupted = False
    log_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with log_path.open("ab") as log:
            pump = threading.Thread(target=_pump, args=(container, log, progress), daemon=True)
            pump.start()
            try:
                while pump.is_alive():
                    pump.join(0.5)
            except KeyboardInterrupt:
                interrupted = True
                print("\n[bench] interrupted: stopping aiperf, keeping finished points",
                      file=sys.stderr, flush=True)
                try:
                    container.kill(signal="SIGINT")
                    container.wait(timeout=30)
                except Exception:  # noqa: BLE001
                    with contextlib.suppress(Exception):
                        container.stop(timeout=5)
                pump.join(5)
        try:
            exit_code = container.wait(timeout=60).get("StatusCode")
        except Exception:  # noqa: BLE001
            exit_code = None
    finally:
        with contextlib.suppress(Exception):
            container.remove(force=True)
    return ClientResult(exit_code, interrupted, time.time() - t0, log_path, name)


def _pump(container, log, progress: bool) -> None:
    try:
        for chunk in container.logs(stream=True, follow=True):
            log.write(chunk)
            log.flush()
            if progress:
                sys.stderr.write(chunk.decode(errors="replace"))
                sys.stderr.flush()
    except Exception:  # noqa: BLE001 - container gone
        pass
