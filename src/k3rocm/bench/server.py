"""Fresh server containers for A/B arms (docker-py), and the CPU stand-in's EngineCore pin.

Readiness lives in :mod:`k3rocm.readiness`, provenance in :mod:`k3rocm.provenance`; both are
re-exported here for the bench modules.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3rocm.errors import UsageError
from k3rocm.provenance import (  # noqa: F401 - re-exported
    FUSION_ENV,
    MANIFEST_PATH,
    _exec_text,
    collect_provenance,
    find_server_container,
)
from k3rocm.readiness import answers, url_port, wait_ready  # noqa: F401 - re-exported

LABEL = "k3rocm.bench"


# ---------------------------------------------------------------------------------------------
# fresh servers for A/B arms


@dataclass
class ServerSpec:
    """How to start one server container for an arm (mirrors compose.yaml's `server`)."""

    image: str
    port: int = 8000
    env: dict[str, str] = field(default_factory=dict)
    models_dir: str | None = None
    cache_dir: str | None = None
    gpu: bool = False
    shm_size: str = "2g"
    extra_args: list[str] = field(default_factory=list)


def read_dotenv(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of a compose-style .env (comments, blanks and `export ` allowed)."""
    out: dict[str, str] = {}
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.removeprefix("export ").partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[key.strip()] = value
    return out


def server_env_from_host(environ: Mapping[str, str] | None = None,
                         dotenv: Path | None = Path(".env")) -> dict[str, str]:
    """The K3_* settings (and HF_TOKEN/HIP_VISIBLE_DEVICES) the host passes to the server, like
    compose does (the shell wins over ./.env); fusion toggles are set per arm by the caller."""
    environ = dict(os.environ if environ is None else environ)
    if dotenv is not None:
        environ = {**read_dotenv(dotenv), **environ}
    keep = {"HF_TOKEN", "HIP_VISIBLE_DEVICES"}
    skip = {"K3_IMAGE", "K3_MODELS_DIR", "K3_CACHE_DIR", "K3_RESULTS_DIR", "K3_BIND_ADDRESS",
            "K3_SERVER_IMAGE"}
    return {k: v for k, v in environ.items()
            if v != "" and ((k.startswith("K3_") and k not in skip) or k in keep)}


def start_server(client, spec: ServerSpec, name: str, labels: Mapping[str, str]):
    """Start a detached server container; returns the docker-py Container."""
    import docker

    try:
        client.images.get(spec.image)
    except docker.errors.ImageNotFound:
        raise UsageError(f"server image {spec.image!r} not found: build it (make build) or pass "
                         f"--image", 2) from None
    env = {**spec.env, "K3_PORT": str(spec.port)}
    kwargs: dict[str, Any] = dict(
        image=spec.image, name=name, detach=True, environment=env,
        labels={LABEL: "server", **labels}, init=True,
        ports={f"{spec.port}/tcp": ("127.0.0.1", spec.port)},
        command=spec.extra_args or None,
    )
    volumes = {}
    if spec.models_dir:
        volumes[str(Path(spec.models_dir).resolve())] = {"bind": "/models", "mode": "ro"}
    if spec.cache_dir:
        Path(spec.cache_dir).mkdir(parents=True, exist_ok=True)
        volumes[str(Path(spec.cache_dir).resolve())] = {"bind": "/cache", "mode": "rw"}
    kwargs["volumes"] = volumes
    if spec.gpu:
        kwargs.update(devices=["/dev/kfd", "/dev/dri"], group_add=["video", "render"],
                      ipc_mode="host", security_opt=["seccomp=unconfined"],
                      cap_add=["SYS_PTRACE"],
                      ulimits=[docker.types.Ulimit(name="memlock", soft=-1, hard=-1),
                               docker.types.Ulimit(name="stack", soft=67108864,
                                                   hard=67108864)])
    else:
        kwargs["shm_size"] = spec.shm_size
    return client.containers.run(**kwargs)


def stop_server(container, log_path: Path | None = None, timeout: int = 30) -> None:
    """Stop and remove a server we started, keeping its log first."""
    if container is None:
        return
    try:
        if log_path is not None:
            from k3rocm.rundir import write_bytes_atomic

            write_bytes_atomic(log_path, container.logs())
    except Exception:  # noqa: BLE001
        pass
    with contextlib.suppress(Exception):
        container.stop(timeout=timeout)
    with contextlib.suppress(Exception):
        container.remove(force=True)


_PIN_SCRIPT = r"""
w=""; e=""
for p in /proc/[0-9]*; do
  n=$(cat "$p/comm" 2>/dev/null)
  case "$n" in
    VLLM::Worker*) [ -z "$w" ] && w=$(sed -n 's/^Cpus_allowed_list:[[:space:]]*//p' "$p/status") ;;
    VLLM::EngineCor*) e=${p#/proc/} ;;
  esac
done
[ -n "$w" ] && [ -n "$e" ] || { echo "no VLLM::Worker/EngineCore process"; exit 1; }
taskset -a -p -c "$w" "$e" >/dev/null && echo "EngineCore pid $e pinned to cpus $w"
"""


def pin_engine_core(container) -> str:
    """CPU stand-in only: pin vLLM's EngineCore process to its worker's cores.

    On a 2-core machine vLLM-CPU's EngineCore busy-polls its shared-memory queue (vLLM spins
    for 1 s after each read) on the core reserved for the API server, which then streams a
    whole response in one burst: aiperf sees ITL = 0. Pinning the EngineCore next to the
    worker leaves that core to the API server and the client. Never needed on a GPU node.
    Returns a one-line description; raises UsageError if it cannot be done.
    """
    out = _exec_text(container, ["sh", "-c", _PIN_SCRIPT])
    if not out or "pinned" not in out:
        raise UsageError(f"could not pin the EngineCore in {container.name}: "
                         f"{(out or 'taskset/ps failed').strip()}", 3)
    return out.strip()
