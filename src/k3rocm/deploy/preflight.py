"""``k3rocm preflight`` (``make preflight``): what this node has and what serving Kimi-K3 needs.

One table, one line per check: ``ok``, ``warn`` or ``fail``, what was found, and the fix.
Exit 1 when any line fails, 0 otherwise (2: bad settings, reported before any check runs).

Single node: ROCm devices (/dev/kfd, /dev/dri render nodes), the video/render groups,
kernel.numa_balancing, free disk for the cache and results directories, the checkpoint
(config.json and size), the base and serving images, the API port, Docker and Compose versions.
Scale-out (K3_SCALE_MODE != single) adds: every node reachable, /dev/infiniband and the named
interface where the mode needs them (dp-ep), the same serving image on every node, the
router port free.
"""

from __future__ import annotations

import argparse
import contextlib
import grp
import json
import os
import re
import shutil
import socket
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from k3rocm.deploy.engine import docker_client
from k3rocm.deploy.lifecycle import REPO
from k3rocm.deploy.scale.settings import GPUS_PER_NODE
from k3rocm.deploy.server_api import ServerAPI, Unreachable
from k3rocm.errors import UsageError
from k3rocm.serving.basefacts import DEFAULT_BASE_IMAGE
from k3rocm.serving.manifest import UNKNOWN_DIGEST, base_digest

CACHE_MIN_GB = 200  # HF/vLLM/Triton caches for a 1.5 TB model's compile artefacts and more
RESULTS_MIN_GB = 5
CHECKPOINT_MIN_GB = 1000  # Kimi-K3 weights are ~1.5 TB; less is a partial download
MIN_COMPOSE = (2, 24)  # `!reset` in compose.cpu.yaml and the scale overrides


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail
    have: str
    fix: str = ""


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n < 1e12 else f"{n / 1e12:.2f} TB"


def _present(name: str, ok: bool, fix: str) -> Check:
    return Check(name, "ok" if ok else "fail", "present" if ok else "missing", "" if ok else fix)


def check_rocm_devices(dev: Path = Path("/dev")) -> list[Check]:
    out = [_present("ROCm /dev/kfd", (dev / "kfd").exists(), "install the amdgpu driver "
                    "(ROCm) and reboot; this node has no AMD GPU compute device")]
    renders = sorted((dev / "dri").glob("renderD*")) if (dev / "dri").is_dir() else []
    n = len(renders)
    status = "ok" if n >= GPUS_PER_NODE else ("warn" if n else "fail")
    out.append(Check("ROCm /dev/dri render nodes", status, f"{n} renderD* node(s)",
                     "" if status == "ok" else f"an MI355X node exposes {GPUS_PER_NODE}: check "
                     "the amdgpu driver (`rocm-smi`) and the devices passed to this host"))
    return out


def check_groups() -> list[Check]:
    out = []
    for g in ("video", "render"):
        try:
            grp.getgrnam(g)
            out.append(Check(f"group {g}", "ok", "exists"))
        except KeyError:
            out.append(Check(f"group {g}", "fail", "missing",
                             f"`groupadd {g}` (the ROCm device nodes belong to it; compose "
                             "adds the container to video and render)"))
    return out


def check_numa(path: Path = Path("/proc/sys/kernel/numa_balancing")) -> Check:
    try:
        v = path.read_text().strip()
    except OSError:
        return Check("kernel.numa_balancing", "warn", "unreadable",
                     "check `sysctl kernel.numa_balancing` (0 recommended for MI355X)")
    if v == "0":
        return Check("kernel.numa_balancing", "ok", "0")
    return Check("kernel.numa_balancing", "warn", v,
                 "`sudo sysctl -w kernel.numa_balancing=0` (AMD's MI300X/MI355X advice)")


def check_disk(label: str, path: Path, min_gb: float) -> Check:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    status = "ok" if free >= min_gb * 1e9 else "warn"
    return Check(f"free disk: {label}", status, f"{_gb(free)} free at {path}",
                 "" if status == "ok" else f"needs >= {min_gb:.0f} GB: free space or point "
                 f"K3_{label.upper()}_DIR elsewhere")


def check_checkpoint(settings) -> Check:
    from k3rocm.serving.config import _host_path, _is_pathlike

    model = settings.model
    if not _is_pathlike(model):
        allowed = settings.allow_hub_download
        return Check("checkpoint", "warn" if allowed else "fail",
                     f"K3_MODEL={model} (a Hugging Face id"
                     + (", K3_ALLOW_HUB_DOWNLOAD=1)" if allowed else ")"),
                     "the first start downloads ~1.5 TB: download once into K3_MODELS_DIR and "
                     "set K3_MODEL=/models/<dir>" + ("" if allowed else
                                                     " (or set K3_ALLOW_HUB_DOWNLOAD=1)"))
    host = _host_path(settings, model)
    if not (host / "config.json").is_file():
        return Check("checkpoint", "fail", f"{host}: no config.json",
                     "put the checkpoint there (K3_MODELS_DIR is mounted at /models) or fix "
                     "K3_MODEL")
    size = sum(p.stat().st_size for p in host.rglob("*") if p.is_file())
    from k3rocm.serving import profiles

    expect_full = profiles.get(settings.profile)["meta"]["hardware"] == "amd"  # not the stand-in
    status = "ok" if size >= CHECKPOINT_MIN_GB * 1e9 or not expect_full else "warn"
    return Check("checkpoint", status, f"{host}: config.json, {_gb(size)}",
                 "" if status == "ok" else "Kimi-K3 is ~1.5 TB: the download looks incomplete")


def _compose_base_image() -> str:
    env = os.environ.get("BASE_IMAGE")
    if env:
        return env
    m = re.search(r"BASE_IMAGE:\s*\$\{BASE_IMAGE:-([^}]+)\}", (REPO / "compose.yaml").read_text()
                  if (REPO / "compose.yaml").is_file() else "")
    return m.group(1) if m else DEFAULT_BASE_IMAGE


def image_id(client, ref: str) -> str | None:
    img = _image(client, ref)
    return img.id if img is not None else None


def _image(client, ref: str):
    import docker

    try:
        return client.images.get(ref)
    except docker.errors.ImageNotFound:
        return None


def repo_digest(img) -> str:
    """A local image's registry digest (``repo@sha256:...``): known once it was pulled; a
    locally built or retagged image (the CPU stand-ins) has none."""
    digests = (img.attrs.get("RepoDigests") or []) if img is not None else []
    return digests[0] if digests else UNKNOWN_DIGEST


def check_docker(client, settings) -> list[Check]:
    out = []
    if client is None:
        where = os.environ.get("DOCKER_HOST", "the default socket")
        out.append(Check("Docker engine", "fail", f"not reachable at {where}",
                         "install docker.io and start it (or set DOCKER_HOST)"))
    else:
        v = client.version().get("Version", "?")
        out.append(Check("Docker engine", "ok", f"version {v}"))
        base = _compose_base_image()
        bimg = _image(client, base)
        bid = bimg.id if bimg is not None else None
        out.append(Check("base image", "ok" if bid else "fail",
                         f"{base}: " + (f"present {bid[:19]}, digest {repo_digest(bimg)}"
                                        if bid else "missing"),
                         "" if bid else f"`docker pull {base}` (or BASE_IMAGE=... make build); "
                         f"pin it by digest once pulled: BASE_IMAGE=<repo>@sha256:..."))
        simg = _image(client, settings.image)
        sid = simg.id if simg is not None else None
        labels = (simg.labels or {}) if simg is not None else {}
        built = labels.get("org.opencontainers.image.base.name") or "?"
        # as the build recorded it in the manifest (the label holds what make build passed)
        digest = base_digest(built, labels.get("org.opencontainers.image.base.digest"))
        out.append(Check("serving image", "ok" if sid else "warn",
                         f"{settings.image}: " + (f"present {sid[:19]}, built FROM {built} "
                                                  f"(digest {digest})" if sid else "not built"),
                         "" if sid else "`make build`"))
    try:
        r = subprocess.run(["docker", "compose", "version", "--short"], capture_output=True,
                           text=True, timeout=20)
        ver = r.stdout.strip().lstrip("v")
        nums = tuple(int(x) for x in re.findall(r"\d+", ver)[:2])
        ok = r.returncode == 0 and nums >= MIN_COMPOSE
        out.append(Check("Docker Compose", "ok" if ok else "fail",
                         f"version {ver or '?'}" if r.returncode == 0 else "not installed",
                         "" if ok else "install Docker Compose v2 >= "
                         f"{'.'.join(map(str, MIN_COMPOSE))} (`docker compose` plugin)"))
    except (OSError, subprocess.TimeoutExpired):
        out.append(Check("Docker Compose", "fail", "no docker CLI",
                         "install the docker CLI and the compose plugin"))
    return out


def check_base(settings, environ, dotenv) -> Check:
    """The serving image's base facts against these settings (what `k3rocm serve` will do)."""
    from k3rocm.deploy.config_cmd import image_base_facts
    from k3rocm.serving.config import render

    facts, where = image_base_facts(settings.image)
    if facts is None:
        return Check("base facts", "warn", where, "`make build`; the server checks at start")
    try:
        r = render(environ, dotenv, host_paths=True, check_model=False, base=facts)
    except UsageError as exc:
        return Check("base facts", "fail", str(exc).split(";")[0], str(exc).split("; ", 1)[-1])
    b = r.base
    changed = [n.split(" (")[0] for n in b["notes"] if n.startswith(("K3_", "graphs:"))]
    return Check("base facts", "ok", f"vLLM {b['vllm_version']}, {b['heads_per_rank']} heads/"
                 f"rank: decode route {b['decode_route']['route']}" +
                 (f"; at start: {', '.join(changed)}" if changed else ""))


def port_free(host: str, port: int) -> bool:
    """Whether this process could listen on host:port now (preflight and the demo ask)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def check_port(label: str, host: str, port: int, fix: str) -> Check:
    free = port_free(host, port)
    return Check(label, "ok" if free else "fail",
                 f"{host}:{port} {'free' if free else 'in use'}", "" if free else fix)


def check_node(address: str, timeout: float = 5.0) -> Check:
    """The node's API server: /health 200 ok; refused or another answer: warn; no route: fail."""
    try:
        code = ServerAPI(f"http://{address}", timeout=timeout).health()
    except Unreachable as exc:
        if exc.refused:
            return Check(f"node {address}", "warn", "host up, API port closed",
                         "start the server on that node (`make up` there)")
        return Check(f"node {address}", "fail", f"unreachable ({exc.reason})",
                     "check the address in K3_SCALE_NODES, routing and firewalls")
    if code == 200:
        return Check(f"node {address}", "ok", "/health 200")
    return Check(f"node {address}", "warn", f"/health answered HTTP {code}",
                 "the server there is starting or unhealthy: `make logs` on that node")


def remote_image_id(host: str, image: str, timeout: float = 15.0) -> str | None:
    """The image id on a remote node through the docker CLI's ssh transport (None: unknown)."""
    try:
        r = subprocess.run(["docker", "-H", f"ssh://{host}", "image", "inspect", "--format",
                            "{{.Id}}", image], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() or None if r.returncode == 0 else None


def check_scale(s, settings, client, net: Path = Path("/sys/class/net"),
                dev: Path = Path("/dev")) -> list[Check]:
    out = [check_node(node) for node in s.nodes]
    local = {"127.0.0.1", "localhost", "::1", socket.gethostname()}
    with contextlib.suppress(OSError):
        local.update(i[4][0] for i in socket.getaddrinfo(socket.gethostname(), None))
    if s.mode == "dp-ep":
        out.append(_present("/dev/infiniband", (dev / "infiniband").is_dir(),
                            f"{s.mode} moves KV/activations over RDMA: install the RDMA driver "
                            "(rdma-core) or use K3_SCALE_MODE=replicas"))
        out.append(_present(f"interface {s.ifname}", (net / s.ifname).exists(),
                            "set K3_SCALE_IFNAME to an interface of `ip -br link`"))
    here = image_id(client, settings.image) if client else None
    ids = {}
    for i, node in enumerate(s.nodes):
        host = s.node_host(i)
        ids[node] = here if host in local else remote_image_id(host, settings.image)
    known = {k: v for k, v in ids.items() if v}
    unknown = [k for k, v in ids.items() if not v]
    if len(set(known.values())) > 1:
        out.append(Check("same serving image on every node", "fail",
                         "; ".join(f"{k} {v[:19]}" for k, v in known.items()),
                         f"build or load the same {settings.image} on every node"))
    elif unknown:
        out.append(Check("same serving image on every node", "warn",
                         f"unknown on {', '.join(unknown)}",
                         "ssh access for `docker -H ssh://NODE image inspect`, or compare "
                         f"`docker image inspect {settings.image}` ids by hand"))
    else:
        out.append(Check("same serving image on every node", "ok",
                         f"{next(iter(known.values()))[:19]} on {len(known)} nodes"))
    out.append(check_port("router port", s.router_host, s.router_port,
                          "stop what listens there (`make router-down`) or change "
                          "K3_SCALE_ROUTER_PORT"))
    return out


def run_checks(environ=None, dotenv: str = ".env") -> list[Check]:
    from k3rocm.deploy.scale.settings import load_scale
    from k3rocm.serving.config import load_settings

    environ = dict(os.environ if environ is None else environ)
    # bad input: exit 2 before any check runs; the checkpoint itself is a line of the table
    settings, _ = load_settings(environ, dotenv, host_paths=True, check_model=False)
    s = load_scale(environ, dotenv, tp=settings.tp)
    checks = [*check_rocm_devices(), *check_groups(), check_numa(),
              check_disk("cache", Path(settings.cache_dir).expanduser(), CACHE_MIN_GB),
              check_disk("results", Path(settings.results_dir).expanduser(), RESULTS_MIN_GB),
              check_checkpoint(settings)]
    client = docker_client(timeout=30, required=False)
    checks += check_docker(client, settings)
    checks.append(check_base(settings, environ, dotenv))
    if s.mode == "single":
        port = check_port("API port", settings.bind_address, settings.port,
                          "stop what listens there (`make down`) or change K3_PORT")
        if port.status == "fail" and _our_server_on(client, settings.port):
            port = Check("API port", "ok", f"{settings.bind_address}:{settings.port} served by "
                         "the running compose server (`make up` keeps it)", "")
        checks.append(port)
    else:
        checks += check_scale(s, settings, client)
    return checks


def _our_server_on(client, port: int) -> bool:
    """Is the port served by this bundle's compose server (so `make up` may run again)?"""
    from k3rocm.deploy.provenance import find_server_container

    c = find_server_container(client, f"http://localhost:{port}") if client else None
    return c is not None and c.labels.get("com.docker.compose.service") == "server"


def format_table(checks: list[Check]) -> str:
    w1 = max(len(c.name) for c in checks)
    w3 = min(60, max(len(c.have) for c in checks))
    lines = [f"{'check':<{w1}}  {'stat':<4}  {'found':<{w3}}  fix",
             f"{'-' * w1}  ----  {'-' * w3}  ---"]
    for c in checks:
        lines.append(f"{c.name:<{w1}}  {c.status:<4}  {c.have:<{w3}}  {c.fix}".rstrip())
    n = {k: sum(c.status == k for c in checks) for k in ("ok", "warn", "fail")}
    lines.append(f"{n['ok']} ok, {n['warn']} warn, {n['fail']} fail")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--env-file", default=".env", help="optional KEY=VALUE file")
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")


def run(args: argparse.Namespace) -> int:
    checks = run_checks(dotenv=args.env_file)
    if not checks:
        raise UsageError("no checks ran")
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        print(format_table(checks))
    return 1 if any(c.status == "fail" for c in checks) else 0
