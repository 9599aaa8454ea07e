"""What served a measurement, read from the real server: over HTTP (vLLM version, models) and
through the Docker engine (image, env redacted, argv, overlay manifest, fusion decisions).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import tarfile
import time
from dataclasses import dataclass
from typing import Any

from k3rocm.deploy.server_api import ServerAPI, url_port
from k3rocm.serving.config import redact_argv, redact_env
from k3rocm.serving.fusions import FUSIONS
from k3rocm.serving.manifest import DEFAULT_PATH as MANIFEST_PATH  # what the image build writes
from k3rocm.serving.serve_cmd import RENDERED_FILE  # what `k3rocm serve` writes


def find_server_container(client, url: str):
    """The running container serving ``url``'s port (published, or host network with
    K3_PORT), ours first; None when there is none.
    """
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
        env = container_env(c)
        host_net = (attrs.get("HostConfig") or {}).get("NetworkMode") == "host"
        if port in published or (host_net and env.get("K3_PORT", "8000") == str(port)
                                 and "K3_PROFILE" in env):
            hits.append((0 if "K3_PROFILE" in env else 1, c))
    hits.sort(key=lambda t: t[0])
    return hits[0][1] if hits else None


def read_file(container, path: str) -> bytes:
    """The bytes of file ``path`` in the container, through the engine's archive API (``docker
    cp``): no process in the container, no exec state to race. Raises when it is absent."""
    chunks, _ = container.get_archive(path)
    with tarfile.open(fileobj=io.BytesIO(b"".join(chunks))) as tar:
        member = next(m for m in tar.getmembers() if m.isfile())
        return tar.extractfile(member).read()  # type: ignore[union-attr]


def read_text(container, path: str) -> str | None:
    """:func:`read_file` as text, None if it cannot be read (an exec ``cat`` of the rendered
    record came back empty once in a loaded CI run)."""
    try:
        return read_file(container, path).decode(errors="replace")
    except Exception:  # noqa: BLE001 - absent, a directory, or the engine refused
        return None


def exec_text(container, cmd: list[str], *, timeout: float = 30.0) -> str | None:
    """stdout of ``cmd`` in the container (stderr apart), None if it failed. The exit code
    is read once the engine has recorded it: an exec inspected as its stream ends can still be
    Running with no ExitCode (moby/moby#19607; docker-py's exec_run then says None, which failed
    CI), so poll exec_inspect up to ``timeout``.
    """
    api = container.client.api
    try:
        exec_id = api.exec_create(container.id, cmd)["Id"]
        stdout, _ = api.exec_start(exec_id, demux=True)
        deadline = time.monotonic() + timeout
        while (state := api.exec_inspect(exec_id))["Running"] and time.monotonic() < deadline:
            time.sleep(0.02)  # polling the engine's record of this exec, not a guess
    except Exception:  # noqa: BLE001
        return None
    if state["Running"] or state["ExitCode"] != 0:
        return None
    return (stdout or b"").decode(errors="replace")


def rendered_record(container) -> dict | None:
    """What ``k3rocm serve`` rendered in this container (env, argv, base-fact changes);
    None when absent.
    """
    text = read_text(container, RENDERED_FILE)
    try:
        data = json.loads(text) if text else None
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def container_env(container) -> dict[str, str]:
    """The container's own environment (docker inspect), not redacted."""
    return dict(e.split("=", 1) for e in (container.attrs.get("Config") or {}).get("Env") or []
                if "=" in e)


NO_RECORD = ("no rendered record in the server container: an image older than it, or not "
             "our entrypoint")


@dataclass(frozen=True)
class ServedAs:
    """The server's argv and env as ``k3rocm serve`` rendered them (``rendered``), else only
    its container's env (argv None); ``source`` says which.
    """

    argv: list[str] | None
    env: dict[str, str]
    rendered: bool
    source: str

    @property
    def tp(self) -> int | None:
        """vLLM's tensor-parallel size (1 when the argv does not set it); None: argv unknown."""
        if not self.argv:
            return None
        # "-tp N", "-tp=N" or the long flag, as whole argv items (joined by NULs)
        m = re.search(r"(?:^|\0)(?:-tp|--tensor-parallel-size)[=\0](\d+)(?:\0|$)",
                      "\0".join(self.argv))
        return int(m.group(1)) if m else 1

    def json_flag(self, flag: str) -> dict | None:
        """The JSON object after ``flag`` in the argv; None when absent or not an object."""
        argv = self.argv or []
        if flag not in argv[:-1]:
            return None
        try:
            value = json.loads(argv[argv.index(flag) + 1])
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    @property
    def profiler_max_iterations(self) -> int:
        """``--profiler-config`` max_iterations; 0 when unlimited or unknown."""
        with contextlib.suppress(ValueError, TypeError):
            return max(0, int((self.json_flag("--profiler-config") or {}).get(
                "max_iterations") or 0))
        return 0

    @property
    def speculative(self) -> tuple[int, str]:
        """Speculative tokens per step and where that was read: ``--speculative-config``,
        else (no rendered record) ``K3_MTP_K``; 0 when neither says.
        """
        spec = self.json_flag("--speculative-config")
        with contextlib.suppress(ValueError, TypeError):
            if spec is not None:
                k = int(spec.get("num_speculative_tokens") or 0)
                return k, f"--speculative-config num_speculative_tokens={k}"
        raw = "" if self.rendered else str(self.env.get("K3_MTP_K") or "").strip()
        if raw.isdigit():
            return int(raw), f"K3_MTP_K={raw}"
        return 0, "no speculative decoding seen"


def served_as(prov: dict | None = None, container=None) -> ServedAs:
    """The server's rendered argv and env, from ``prov`` (collect_provenance's result) or read
    from ``container``; the rendered record's env lies on top of the container's.
    """
    if container is not None:
        rec = rendered_record(container)
        prov = {"rendered": rec, "container": {"env": container_env(container)}}
    prov = prov or {}
    env = dict((prov.get("container") or {}).get("env") or {})
    rec = prov.get("rendered")
    if isinstance(rec, dict):
        argv = rec.get("argv")
        return ServedAs(list(argv) if isinstance(argv, list) else None,
                        {**env, **(rec.get("env") or {})}, True,
                        f"the server's rendered settings ({RENDERED_FILE})")
    return ServedAs(None, env, False,
                    f"the server container's env, argv unknown ({NO_RECORD})" if env
                    else "unknown (no server container found)")


# What the server says it runs with (the argv only says what was asked), vLLM 0.32.0:
# v1/engine/core.py:133-137 logs "Initializing a V1 LLM engine (v%s) with config: %s" (VllmConfig
# __str__, config/vllm.py:2703-2738: speculative_config, enforce_eager, enable_prefix_caching,
# cudagraph_mode); prefix caching turned off later is a line of its own (v1/engine/core.py:287,
# platforms/cpu.py:521, config/scheduler.py:300, layers/attention/mla_attention.py:559);
# "Graph capturing finished in %.0f secs" (v1/worker/gpu_model_runner.py:6582); /metrics
# vllm:cache_config_info (v1/metrics/loggers.py:1114). 0.34.0 keeps these
# (vllm@0.34.0:vllm/config/vllm.py:2893-2923, config/compilation.py:974-1001).
_ENGINE_CONFIG = re.compile(r"Initializing a V1 LLM engine \(v([^)]*)\) with config: (.*)$", re.M)
_PREFIX_OFF = re.compile(r"^.*(?:[Dd]isabling prefix caching|prefix caching to be disabled|"
                         r"prefix caching; disabling both).*$", re.M)
_GRAPHS_DONE = re.compile(r"Graph capturing finished in (\d+) secs")
_CACHE_INFO = re.compile(r'^vllm:cache_config_info\{[^}]*enable_prefix_caching="(True|False)"',
                         re.M)


def _flag(text: str, name: str) -> bool | None:
    m = re.search(rf"\b{name}=(True|False)\b", text)
    return None if m is None else m.group(1) == "True"


def served_config(log_text: str | None, metrics_text: str | None = None) -> dict[str, Any]:
    """Prefix caching, speculative decoding and graph mode as the server reports them
    (its log, else /metrics), each with its source; None where the server said nothing.
    """
    log = log_text or ""
    engine = _ENGINE_CONFIG.findall(log)
    cfg = engine[-1][1] if engine else ""
    out: dict[str, Any] = {"vllm_version": engine[-1][0] if engine else None,
                           "engine_config_logged": bool(engine)}
    caching, src = _flag(cfg, "enable_prefix_caching"), "the engine's config line"
    off = _PREFIX_OFF.findall(log)
    if off:
        caching, src = False, off[-1].strip()[-200:]
    elif caching is None and metrics_text:
        m = _CACHE_INFO.search(metrics_text)
        if m:
            caching, src = m.group(1) == "True", "/metrics vllm:cache_config_info"
    out["prefix_caching"] = {"value": caching, "from": src if caching is not None else
                             "the server's log and metrics say nothing about it"}
    spec = re.search(r"speculative_config=(None|SpeculativeConfig\(method='?([^,']*)'?, .*?"
                     r"num_spec_tokens=(\d+)\))", cfg)
    out["speculative"] = (None if spec is None else
                          {"method": None, "num_spec_tokens": 0} if spec.group(1) == "None" else
                          {"method": spec.group(2), "num_spec_tokens": int(spec.group(3))})
    mode = re.search(r"'cudagraph_mode': <CUDAGraphMode\.(\w+)", cfg)
    captured = _GRAPHS_DONE.findall(log)
    out["graphs"] = {"enforce_eager": _flag(cfg, "enforce_eager"),
                     "cudagraph_mode": mode.group(1) if mode else None,
                     "captured": bool(captured),
                     "capture_seconds": int(captured[-1]) if captured else None}
    return out


def collect_provenance(url: str, api_key: str | None, client=None, container=None) -> dict:
    """What served the measurement; best effort per item, what is unknown says so."""
    api = ServerAPI(url, api_key, timeout=5)
    prov: dict[str, Any] = {"url": url}
    try:
        r = api.get("/version")
        prov["vllm_version"] = r.json().get("version") if r.status_code == 200 else None
    except Exception as exc:  # noqa: BLE001
        prov["vllm_version"] = None
        prov["vllm_version_error"] = str(exc)[:200]
    try:
        prov["models"] = api.model_list()
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
    env = container_env(container)
    prov["container"] = {
        "id": attrs.get("Id"), "name": attrs.get("Name", "").lstrip("/"),
        "image_ref": cfg.get("Image"), "image_id": attrs.get("Image"),
        "created": attrs.get("Created"), "started": (attrs.get("State") or {}).get("StartedAt"),
        "entrypoint": cfg.get("Entrypoint"), "cmd": redact_argv(cfg.get("Cmd")),
        "path": attrs.get("Path"), "args": redact_argv(attrs.get("Args")),
        "env": redact_env(env),
    }
    image = prov["image"] = {"ref": cfg.get("Image"), "id": attrs.get("Image"), "tags": [],
                             "digests": []}
    try:
        img = container.client.images.get(attrs.get("Image") or cfg.get("Image"))
        image.update(id=img.id, tags=list(img.tags), created=img.attrs.get("Created"),
                     digests=list(img.attrs.get("RepoDigests") or []))
    except Exception as exc:  # noqa: BLE001 - best effort
        image["note"] = f"image not inspectable ({exc.__class__.__name__})"
    procs = []
    with contextlib.suppress(Exception):
        top = container.top()
        idx = top["Titles"].index("CMD") if "CMD" in top["Titles"] else -1
        procs = [p[idx] for p in top.get("Processes") or []]
    prov["server_processes"] = [" ".join(redact_argv(p.split(" "))) for p in procs[:20]]
    manifest = read_text(container, MANIFEST_PATH)
    try:
        prov["overlay_manifest"] = json.loads(manifest) if manifest else None
    except json.JSONDecodeError:
        prov["overlay_manifest"] = {"unparsed": manifest[:4000]}
    if prov["overlay_manifest"] is None:
        prov["overlay_manifest_note"] = f"{MANIFEST_PATH} not readable in the server container"
    rendered = rendered_record(container)
    prov["rendered"] = rendered
    renv = (rendered or {}).get("env") or {}
    prov["fusion_toggles"] = {
        f.env: renv.get(f.env) or env.get(f.env, f"unset (default {'on' if f.default else 'off'})")
        for f in FUSIONS}
    logs = ""
    with contextlib.suppress(Exception):
        logs = container.logs().decode(errors="replace")
    metrics = None
    with contextlib.suppress(Exception):
        metrics = api.metrics_text()
    prov["served_config"] = served_config(logs, metrics)
    try:
        from k3rocm.serving.decisions import final_in_log

        final = final_in_log(logs, "server log")
        prov["fusion_decisions"] = [
            {k: r.get(k) for k in ("pid", "tp_rank", "layer_kind", "phase", "fusions")}
            for r in final.values()]
    except Exception:  # noqa: BLE001 - provenance is best effort
        prov["fusion_decisions"] = []
    return prov
