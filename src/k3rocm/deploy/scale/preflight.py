"""``k3rocm preflight``: the one runner and table of :mod:`k3rocm.deploy.preflight`, whose
single-node checks end with the API port (K3_SCALE_MODE=single) or, for replicas, with
:func:`check_scale`'s rows. Here, not there: single-node deploy imports nothing of scale-out."""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess

from k3rocm.deploy import preflight
from k3rocm.deploy.engine import image_id
from k3rocm.deploy.preflight import Check, check_port
from k3rocm.deploy.scale.k8scheck import cluster_nodes
from k3rocm.deploy.scale.settings import load_scale
from k3rocm.deploy.server_api import ServerAPI, Unreachable

add_arguments = preflight.add_arguments


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


def check_scale(s, settings, client, environ=None, dotenv=".env") -> list[Check]:
    """Every node reachable, one serving image on all, the router port free, and the cluster
    nodes the server pod may use."""
    out = [check_node(node) for node in s.nodes]
    local = {"127.0.0.1", "localhost", "::1", socket.gethostname()}
    with contextlib.suppress(OSError):
        local.update(i[4][0] for i in socket.getaddrinfo(socket.gethostname(), None))
    here = image_id(client, settings.image, required=False) if client else None
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
    status, have = cluster_nodes(s, dotenv, environ)
    out.append(Check("kubernetes nodes", status, have, "" if status != "fail" else
                     "label the MI355X nodes (AMD node labeller) or set "
                     "K3_SCALE_NODE_SELECTOR to labels they have"))
    return out


def run(args: argparse.Namespace) -> int:
    environ = dict(os.environ)
    s = load_scale(environ, args.env_file)  # bad input: exit 2 before any check runs
    tail = None if s.mode == "single" else (
        lambda settings, client: check_scale(s, settings, client, environ, args.env_file))
    return preflight.report(preflight.run_checks(environ, args.env_file, tail), args.json)
