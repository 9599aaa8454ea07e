"""``k3rocm preflight`` (``make preflight``): what this node has and what serving Kimi-K3 needs.

One table, one line per check (ok, warn, fail; skip when it cannot apply here); exit 1 when a
line fails, 2 on bad settings before any check. The mode's own last checks are the ``tail`` of
:func:`run_checks` (single node: the API port; scale-out picks its own).
"""

from __future__ import annotations

import argparse
import grp
import json
import math
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from k3rocm.deploy.engine import CLIENT_IMAGE, docker_client, local_image
from k3rocm.deploy.lifecycle import REPO
from k3rocm.errors import UsageError
from k3rocm.options import DeploymentFlags
from k3rocm.rundir import columns
from k3rocm.serving.basefacts import DEFAULT_BASE_IMAGE
from k3rocm.serving.manifest import UNKNOWN_DIGEST, base_digest

CACHE_MIN_GB = 200  # HF/vLLM/Triton caches for a 1.5 TB model's compile artefacts and more
RESULTS_MIN_GB = 5
CHECKPOINT_MIN_GB = 1000  # Kimi-K3 weights are ~1.5 TB; less is a partial download
MIN_COMPOSE = (2, 24)  # `!reset` in compose.cpu.yaml
GPUS_PER_NODE = 8  # one MI355X node

# Kimi-K3's MXFP4 MoE needs gfx950 (MI355X). KFD's gfx_target_version = major*10000 +
# minor*100 + stepping (linux amdkfd/kfd_device.c kgd2kfd_probe; kfd_topology.c writes it).
REQUIRED_ARCH = "gfx950"
KFD_NODES = "class/kfd/kfd/topology/nodes"  # under the sysfs root
DRM = "class/drm"  # cardN/device/mem_info_vram_{total,used}: amdgpu_vram_mgr.c (bytes)
# vLLM's own default when K3_GPU_MEMORY_UTILIZATION is unset (vllm@0.32.0:vllm/config/cache.py:102)
VLLM_DEFAULT_GPU_MEMORY_UTILIZATION = 0.92


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail | skip (cannot apply here: no GPU to ask)
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


def gfx_name(version: int) -> str:
    """KFD's gfx_target_version as the ISA name: 90500 -> gfx950, 90010 -> gfx90a."""
    return f"gfx{version // 10000}{version // 100 % 100:x}{version % 100:x}"


def kfd_gpu_archs(sys_root: Path = Path("/sys")) -> dict[str, str]:
    """GPU node -> ISA name from the KFD topology (CPU nodes, simd_count 0, left out)."""
    out = {}
    nodes = sys_root / KFD_NODES
    for node in sorted(nodes.iterdir() if nodes.is_dir() else [],
                       key=lambda p: int(p.name) if p.name.isdigit() else -1):
        try:
            props = dict(re.findall(r"^(\w+)\s+(\d+)\s*$", (node / "properties").read_text(),
                                    re.M))
        except OSError:
            continue
        if int(props.get("simd_count", 0)):
            out[f"node {node.name}"] = gfx_name(int(props.get("gfx_target_version", 0)))
    return out


def _tool_output(argv: list[str]) -> str:
    """stdout of a ROCm tool on the host, "" when it is absent or fails."""
    if not shutil.which(argv[0]):
        return ""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return r.stdout if r.returncode == 0 else ""


def check_gpu_arch(sys_root: Path = Path("/sys"), dev: Path = Path("/dev"),
                   tool=_tool_output) -> Check:
    """Every GPU is gfx950: the KFD topology in sysfs, else rocminfo's agent names."""
    name = f"GPU arch ({REQUIRED_ARCH})"
    if not (dev / "kfd").exists():
        return Check(name, "skip", "skipped: no /dev/kfd")
    archs, source = kfd_gpu_archs(sys_root), "KFD topology"
    if not archs:  # an agent's "Name: gfx950" line; its ISA lines read "amdgcn-amd-amdhsa--..."
        names = re.findall(r"^\s*Name:\s+(gfx[0-9a-f]+)\s*$", tool(["rocminfo"]), re.M)
        archs, source = {f"agent {i}": a for i, a in enumerate(names)}, "rocminfo"
    if not archs:
        return Check(name, "warn", f"unknown: no GPU node in {sys_root / KFD_NODES} and no "
                     "rocminfo", "check the amdgpu driver and ROCm (`rocminfo | grep gfx`)")
    wrong = {k: a for k, a in archs.items() if a != REQUIRED_ARCH}
    if not wrong:
        return Check(name, "ok", f"{len(archs)} GPU(s), all {REQUIRED_ARCH} ({source})")
    found = ", ".join(sorted(set(wrong.values())))
    return Check(name, "fail", f"{found} on {len(wrong)} of {len(archs)} GPU(s): "
                 f"{', '.join(wrong)} ({source})",
                 f"Kimi-K3's MXFP4 MoE needs {REQUIRED_ARCH} (MI355X/MI350X): run on an MI355X "
                 f"node" + (f", or set HIP_VISIBLE_DEVICES to its {REQUIRED_ARCH} GPUs"
                            if len(wrong) < len(archs) else ""))


def gpu_memory(sys_root: Path = Path("/sys")) -> list[tuple[str, int, int]]:
    """(GPU, used, total bytes) per amdgpu DRM card with VRAM counters, named by card and PCI."""
    out = []
    drm = sys_root / DRM
    cards = [c for c in (drm.iterdir() if drm.is_dir() else []) if re.fullmatch(r"card\d+",
                                                                               c.name)]
    for card in sorted(cards, key=lambda c: int(c.name[4:])):
        d = card / "device"
        try:
            total = int((d / "mem_info_vram_total").read_text())
            used = int((d / "mem_info_vram_used").read_text())
        except (OSError, ValueError):
            continue
        pci = d.resolve().name
        out.append((f"{card.name} ({pci})" if re.fullmatch(r"[0-9a-f]{4}:.*", pci) else card.name,
                    used, total))
    return out


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def gpu_holders(client) -> list[str]:
    """The running containers that may hold GPU memory, named: this bundle's servers (our
    entrypoint's K3_PROFILE in their env; with compose project and port) and any other with
    /dev/kfd mapped in. [] when no engine answers."""
    from k3rocm.deploy.provenance import container_env

    try:
        running = client.containers.list() if client is not None else []
    except Exception:  # noqa: BLE001 - engine gone mid-run: holders unknown
        return []
    out = []
    for c in running:
        env = container_env(c)
        ours = "K3_PROFILE" in env
        if ours or any(d.get("PathOnHost") == "/dev/kfd"
                       for d in (c.attrs.get("HostConfig") or {}).get("Devices") or []):
            image = (c.image.tags or [c.image.id[:19]])[0]
            project = (c.labels or {}).get("com.docker.compose.project")
            what = (f"compose project {project}, " if project else "") + \
                f"port {env.get('K3_PORT', '8000')}" if ours else "not a k3rocm server"
            out.append(f"{c.name} ({image}, {what})")
    return out


def check_hbm(settings, client, sys_root: Path = Path("/sys"),
              dev: Path = Path("/dev")) -> Check:
    """Each GPU has K3_GPU_MEMORY_UTILIZATION of its HBM free, else vLLM refuses to start
    (vllm@0.32.0:vllm/v1/worker/utils.py:761, request_memory).
    """
    name = "free HBM"
    if not (dev / "kfd").exists():
        return Check(name, "skip", "skipped: no /dev/kfd")
    gpus = gpu_memory(sys_root)
    if not gpus:
        return Check(name, "warn", f"unknown: no mem_info_vram_total under {sys_root / DRM}",
                     "check the amdgpu driver (`amd-smi static` / `rocm-smi --showmeminfo vram`)")
    util = settings.gpu_memory_utilization or VLLM_DEFAULT_GPU_MEMORY_UTILIZATION
    short = [(g, used, total) for g, used, total in gpus if total - used < math.ceil(total * util)]
    need = max(math.ceil(total * util) for _, _, total in gpus)
    what = f"K3_GPU_MEMORY_UTILIZATION {util} needs {_gib(need)} free on each"
    if not short:
        return Check(name, "ok", f"{len(gpus)} GPU(s), at most {_gib(max(u for _, u, _ in gpus))} "
                     f"used; {what}")
    found = (f"{len(short)} of {len(gpus)} GPU(s) short ({what}): "
             + ", ".join(f"{g} {_gib(used)} used" for g, used, _ in short))
    holders = gpu_holders(client)
    if len(holders) == 1 and _our_server_on(client, settings.port):
        return Check(name, "warn", found, f"held by the running compose server {holders[0]}: "
                     "`make up` keeps or recreates it; `make down` frees them for the selftest "
                     "or another server")
    running = f"container(s) {', '.join(holders)} run here"
    free = len(gpus) - len(short)
    if free >= settings.tp:
        return Check(name, "warn", found, f"{free} GPU(s) are free and K3_TP is {settings.tp}: "
                     "set HIP_VISIBLE_DEVICES to free ones (vLLM takes the first visible ones)"
                     + (f"; {running}" if holders else ""))
    if holders:
        return Check(name, "fail", found, f"{running}: `make down` (or `docker stop <name>`) "
                     "frees them")
    return Check(name, "fail", found, "held by processes outside this bundle's containers: "
                 "`amd-smi process` names them; stop them or lower K3_GPU_MEMORY_UTILIZATION")


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
    """K3_MODEL: a Hub id (a download at start), or a host directory whose bytes
    :func:`k3rocm.deploy.checkpoint.verify` checks (headers only).
    """
    from k3rocm.deploy.checkpoint import verify
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
                     "`make model` downloads it there (K3_MODELS_DIR is mounted at /models), "
                     "or fix K3_MODEL")
    t0 = time.monotonic()
    problems = verify(host)
    took = f"verified in {time.monotonic() - t0:.1f} s, headers only"
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        return Check("checkpoint", "fail", f"{host}: {problems[0]}{more} ({took})",
                     "`make model` fetches what is missing; `make model VERIFY=1` lists every "
                     "problem")
    size = sum(p.stat().st_size for p in host.glob("*.safetensors"))
    from k3rocm.serving import profiles

    expect_full = profiles.get(settings.profile)["meta"]["hardware"] == "amd"  # not the stand-in
    status = "ok" if size >= CHECKPOINT_MIN_GB * 1e9 or not expect_full else "warn"
    return Check("checkpoint", status, f"{host}: complete, {_gb(size)} of shards ({took})",
                 "" if status == "ok" else "Kimi-K3 is ~1.56 TB: this complete copy is another "
                 "(smaller) checkpoint")


def _compose_base_image() -> str:
    env = os.environ.get("BASE_IMAGE")
    if env:
        return env
    m = re.search(r"BASE_IMAGE:\s*\$\{BASE_IMAGE:-([^}]+)\}", (REPO / "compose.yaml").read_text()
                  if (REPO / "compose.yaml").is_file() else "")
    return m.group(1) if m else DEFAULT_BASE_IMAGE


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
        bimg = local_image(client, base, required=False)
        bid = bimg.id if bimg is not None else None
        # its registry digest (none for a locally built or retagged image)
        digest = bid and (bimg.attrs.get("RepoDigests") or [UNKNOWN_DIGEST])[0]
        out.append(Check("base image", "ok" if bid else "fail",
                         f"{base}: " + (f"present {bid[:19]}, digest {digest}"
                                        if bid else "missing"),
                         "" if bid else f"`docker pull {base}` (or BASE_IMAGE=... make build); "
                         f"pin it by digest once pulled: BASE_IMAGE=<repo>@sha256:..."))
        simg = local_image(client, settings.image, required=False)
        sid = simg.id if simg is not None else None
        labels = (simg.labels or {}) if simg is not None else {}
        built = labels.get("org.opencontainers.image.base.name") or "?"
        # as the build recorded it in the manifest (the label holds what make build passed)
        digest = base_digest(built, labels.get("org.opencontainers.image.base.digest"))
        out.append(Check("serving image", "ok" if sid else "warn",
                         f"{settings.image}: " + (f"present {sid[:19]}, built FROM {built} "
                                                  f"(digest {digest})" if sid else "not built"),
                         "" if sid else f"run `make build` (it builds FROM {base}; `make up` "
                         "builds it too)"))
        cimg = local_image(client, CLIENT_IMAGE, required=False)
        out.append(Check("client image", "ok" if cimg is not None else "warn",
                         f"{CLIENT_IMAGE}: " + (f"present {cimg.id[:19]}" if cimg is not None
                                                else "missing"),
                         "" if cimg is not None else "run `make clients-image` (only the bench "
                         "and gsm8k checks, their A/Bs and the selftest's bench step need it)"))
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
    """Whether this process could listen on host:port now."""
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


def api_port(settings, client) -> list[Check]:
    """The single-node tail: the API port free, or held by this bundle's compose server."""
    port = check_port("API port", settings.bind_address, settings.port,
                      "stop what listens there (`make down`) or change K3_PORT")
    if port.status == "fail" and _our_server_on(client, settings.port):
        port = Check("API port", "ok", f"{settings.bind_address}:{settings.port} served by "
                     "the running compose server (`make up` keeps it)", "")
    return [port]


def run_checks(environ=None, dotenv: str = ".env",
               tail: Callable[..., list[Check]] | None = None) -> list[Check]:
    """Every check of this node, then ``tail(settings, client)`` (default :func:`api_port`)."""
    from k3rocm.serving.config import load_settings

    environ = dict(os.environ if environ is None else environ)
    # bad input: exit 2 before any check runs; the checkpoint itself is a line of the table
    settings, _ = load_settings(environ, dotenv, host_paths=True, check_model=False)
    client = docker_client(timeout=30, required=False)
    checks = [*check_rocm_devices(), check_gpu_arch(), check_hbm(settings, client),
              *check_groups(), check_numa(),
              check_disk("cache", Path(settings.cache_dir).expanduser(), CACHE_MIN_GB),
              check_disk("results", Path(settings.results_dir).expanduser(), RESULTS_MIN_GB),
              check_checkpoint(settings)]
    checks += check_docker(client, settings)
    built = any(c.name == "serving image" and c.status == "ok" for c in checks)
    checks.append(check_base(settings, environ, dotenv) if built or client is None else
                  Check("base facts", "skip", f"skipped: {settings.image} not built (the "
                        "serving image line says how)"))
    checks += (tail or api_port)(settings, client)
    return checks


def _our_server_on(client, port: int) -> bool:
    """Is the port served by this bundle's compose server (so `make up` may run again)?"""
    from k3rocm.deploy.provenance import find_server_container

    c = find_server_container(client, f"http://localhost:{port}") if client else None
    return c is not None and c.labels.get("com.docker.compose.service") == "server"


def format_table(checks: list[Check]) -> str:
    n = {k: sum(c.status == k for c in checks) for k in ("ok", "warn", "fail", "skip")}
    return (columns(["check", "stat", "found", "fix"],
                    [[c.name, c.status, c.have, c.fix] for c in checks], cap=60)
            + f"\n{n['ok']} ok, {n['warn']} warn, {n['fail']} fail"
            + (f", {n['skip']} skipped" if n["skip"] else ""))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    DeploymentFlags.add_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")


def report(checks: list[Check], as_json: bool) -> int:
    """Print the table (or JSON); exit 1 when any line fails."""
    if not checks:
        raise UsageError("no checks ran")
    if as_json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        print(format_table(checks))
    return 1 if any(c.status == "fail" for c in checks) else 0
