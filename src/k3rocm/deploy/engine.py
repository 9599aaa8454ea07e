"""The Docker engine: one client factory (:func:`docker_client`: no engine is exit 3) and one
client-container runner (:func:`run_client`: aiperf, lm-eval; Ctrl-C stops the tool gracefully
and keeps what it finished).
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
from k3rocm.errors import ServerError, UsageError

# The one client image (aiperf and lm-eval; `make clients-image`): bench, gsm8k and the demo.
CLIENT_IMAGE = f"k3rocm/clients:{__version__}"

# Long enough for a slow `containers.run`/`wait` on a loaded 2-core host or a big image.
DOCKER_TIMEOUT = 600


def docker_client(timeout: float = DOCKER_TIMEOUT, required: bool = True):
    """A pinged docker-py client. ``required=False``: None when there is no engine."""
    try:
        import docker
    except ModuleNotFoundError:
        if not required:
            return None
        raise UsageError("docker-py is not installed: pip install 'k3rocm[host]'") from None
    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
        return client
    except Exception as exc:  # noqa: BLE001 - any failure means "no engine"
        if not required:
            return None
        raise ServerError(f"cannot reach the Docker engine ({exc.__class__.__name__}): start "
                          "Docker or set DOCKER_HOST") from None


def local_image(client, ref: str, what: str = "client image",
          hint: str = "build it with `make clients-image` (or pass --client-image)",
          required: bool = True):
    """The local image (docker-py's Image), never pulled; a missing one is bad input (exit 2),
    or None when not ``required``."""
    try:
        return client.images.get(ref)
    except Exception as exc:  # noqa: BLE001 - docker.errors.ImageNotFound and friends
        if exc.__class__.__name__ not in ("ImageNotFound", "NotFound"):
            raise ServerError(f"the Docker engine could not inspect {ref!r} "
                              f"({exc.__class__.__name__})") from None
        if not required:
            return None
        raise UsageError(f"{what} {ref!r} not found: {hint}") from None


def image_id(client, ref: str, *args, **kwargs) -> str | None:
    """:func:`local_image`'s id (None: missing and not ``required``)."""
    img = local_image(client, ref, *args, **kwargs)
    return None if img is None else img.id


@dataclass
class ClientResult:
    exit_code: int | None
    interrupted: bool
    seconds: float
    log_path: Path


def run_client(client, image: str, argv: list[str], mounts: dict[str, tuple[str, str]],
               log_path: Path, name: str, *, progress: bool = True,
               env: dict[str, str] | None = None, labels: dict[str, str] | None = None,
               tool: str = "the client", tag: str = "k3rocm") -> ClientResult:
    """Run ``argv`` in a fresh client container (host network, as the calling user;
    ``mounts``: host path -> (container path, "ro"|"rw")), its output streamed to ``log_path`` (and
    stderr when ``progress``). Ctrl-C: SIGINT, then stop, ``interrupted=True``. Always removed.
    """
    run_env = {"HOME": "/tmp", "HF_HOME": "/tmp/hf-home", "XDG_CACHE_HOME": "/tmp/.cache",
               "PYTHONUNBUFFERED": "1", "TERM": "dumb", "COLUMNS": "120"}
    run_env.update(env or {})
    volumes = {host: {"bind": cpath, "mode": mode} for host, (cpath, mode) in mounts.items()}
    user = f"{os.getuid()}:{os.getgid()}" if hasattr(os, "getuid") else None
    t0 = time.time()
    container = client.containers.run(
        image, argv, name=name, detach=True, network_mode="host", environment=run_env,
        volumes=volumes, user=user, working_dir="/tmp", shm_size="1g", labels=labels or {})
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
                print(f"\n[{tag}] interrupted: stopping {tool}, keeping finished work",
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
    return ClientResult(exit_code, interrupted, time.time() - t0, log_path)


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
