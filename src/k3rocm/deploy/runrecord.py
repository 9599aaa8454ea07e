"""One run record: the ``provenance.json`` every measure writes into its run directory, by one
writer. Keys (always present; what could not be read says so): ``schema``, ``command``,
``deployment`` (redacted), ``server`` (:func:`k3rocm.deploy.provenance.collect_provenance`),
``checkpoint``, ``tools``, ``topology``, ``host`` (CPU governor, NUMA balancing, amd-smi or
rocm-smi GPU state), ``upstream_comparison`` (with a ``measure``), then the command's own keys.
"""

from __future__ import annotations

import glob
import os
import platform
import shlex
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from k3rocm import __version__
from k3rocm.rundir import write_json_atomic

SCHEMA = "k3rocm.runrecord/1"
FILENAME = "provenance.json"


def command_block() -> dict[str, Any]:
    argv = [Path(sys.argv[0]).name, *sys.argv[1:]] if sys.argv else []
    return {"argv": list(sys.argv), "line": shlex.join(argv), "cwd": os.getcwd(),
            "k3rocm_version": __version__, "python": platform.python_version(),
            "platform": platform.platform(), "host": platform.node(),
            "started_utc": datetime.now(timezone.utc).isoformat()}


# AMD SMI CLI (rocm.docs.amd.com/projects/amdsmi): `metric` power, clock, temperature;
# `static --partition` partitions; rocm-smi the older tool.
GPU_TOOLS = {
    "amd-smi": [["amd-smi", "metric", "--power", "--clock", "--temperature", "--json"],
                ["amd-smi", "static", "--partition", "--json"]],
    "rocm-smi": [["rocm-smi", "--showclocks", "--showpower", "--showtemp",
                  "--showcomputepartition", "--showmemorypartition", "--json"]],
}


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def host_state(which=shutil.which, run=subprocess.run, root: str = "") -> dict[str, Any]:
    """CPU governor, NUMA balancing and the GPUs' clocks/power/temperature/partitions;
    best effort, never raising.
    """
    govs = sorted({g for g in (_read(p) for p in glob.glob(
        f"{root}/sys/devices/system/cpu/cpu*/cpufreq/scaling_governor")) if g})
    numa = _read(f"{root}/proc/sys/kernel/numa_balancing")
    out: dict[str, Any] = {
        "cpu_governor": govs or "not available (no cpufreq in /sys: VM or container)",
        "numa_balancing": numa if numa is not None else "not available",
    }
    gpu: dict[str, Any] = {}
    for tool, cmds in GPU_TOOLS.items():
        if not which(tool):
            continue
        for cmd in cmds:
            try:
                p = run(cmd, capture_output=True, text=True, timeout=60)
                gpu[" ".join(cmd)] = (p.stdout.strip() if p.returncode == 0 else
                                      f"exit {p.returncode}: {(p.stderr or p.stdout)[-300:]}")
            except Exception as exc:  # noqa: BLE001 - the record must never lose a result
                gpu[" ".join(cmd)] = f"{exc.__class__.__name__}: {exc}"[:300]
        break
    out["gpu"] = gpu or "no amd-smi or rocm-smi on this host: GPU clocks, power, temperature " \
                        "and partition modes not recorded"
    return out


def checkpoint(deployment) -> dict[str, Any] | None:
    """The checkpoint's identity where the model dir is on this host; None for a Hub id."""
    host_dir = getattr(deployment, "model_host_dir", None)
    if host_dir is None:
        return None
    from k3rocm.deploy.checkpoint import identity

    try:
        return identity(host_dir)
    except Exception as exc:  # noqa: BLE001 - the record must never lose a finished result
        return {"path": str(host_dir), "error": f"{exc.__class__.__name__}: {exc}"[:300]}


def server(client, url: str, api_key: str | None, container=None,
           container_name: str | None = None) -> dict[str, Any]:
    """The server side, best effort: never raises (a finished result must not be lost)."""
    from k3rocm.deploy.provenance import collect_provenance

    if container is None and container_name and client is not None:
        try:
            container = client.containers.get(container_name)
        except Exception as exc:  # noqa: BLE001 - docker.errors.NotFound
            return {"url": url, "container": None,
                    "note": f"server container {container_name}: {exc.__class__.__name__}"}
    try:
        return collect_provenance(url, api_key, client=client, container=container)
    except Exception as exc:  # noqa: BLE001
        return {"url": url, "error": f"{exc.__class__.__name__}: {exc}"[:500]}


def upstream_comparison(measure: str, *, server: dict | None = None, deployment=None,
                        workload: Any = None) -> dict[str, Any]:
    """Which upstream figure the result is comparable with, judged on the server's
    rendered env (else its container's, else the deployment's settings). Never raises.
    """
    from k3rocm.deploy.provenance import served_as
    from k3rocm.deploy.upstream_ref import comparable_with

    served = served_as(server)
    env = served.env
    try:
        if env:
            return comparable_with(measure, env, env=env if served.rendered else None,
                                   workload=workload)
        if deployment is not None:
            return comparable_with(measure, deployment.settings, env=deployment.rendered.env,
                                   workload=workload)
    except Exception as exc:  # noqa: BLE001 - the record must never lose a finished result
        return {"comparable": False, "figure": None,
                "text": f"upstream comparison failed: {exc.__class__.__name__}: {exc}"[:300]}
    return {"comparable": False, "figure": None,
            "text": "not comparable with any upstream figure: the server's settings are unknown"}


def single_node(url: str) -> dict[str, Any]:
    """The ``topology`` block of a server on one node (a scale-out's caller passes its own)."""
    p = urlparse(url)
    return {"mode": "single", "url": url, "via_router": False, "nodes": [f"{p.hostname}:{p.port}"]}


def build(*, deployment=None, server: dict | None = None, url: str | None = None,
          tools: dict[str, Any] | None = None, measure: str | None = None,
          workload: Any = None, topology: dict[str, Any] | None = None,
          **extra: Any) -> dict[str, Any]:
    """The run record of one run; ``extra`` holds the command's own keys. With ``measure``
    (bench, census, ...) it says which upstream figure the result is comparable with."""
    record: dict[str, Any] = {
        "schema": SCHEMA,
        "command": command_block(),
        "deployment": deployment.to_json() if deployment is not None else None,
        "server": server,
        "checkpoint": checkpoint(deployment),
        "tools": {"k3rocm": __version__, **(tools or {})},
        "topology": topology or (single_node(url) if url else None),
        "host": host_state(),
    }
    if measure is not None:
        record["upstream_comparison"] = upstream_comparison(
            measure, server=server, deployment=deployment, workload=workload)
    record.update(extra)
    return record


def write(run_dir: str | os.PathLike, record: dict[str, Any]) -> Path:
    return write_json_atomic(Path(run_dir) / FILENAME, record)
