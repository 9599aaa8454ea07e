"""Per-node rendering for the scale-out modes, on top of the one serving renderer.

Every node's vLLM env and argv come from :func:`k3rocm.serving.config.render` (the function the
image's entrypoint runs), given the node's K3_* environment plus the scale additions as passthrough
arguments. Nothing here writes a second ``vllm serve`` command line by hand: the scale additions are
only the drain flag (``--shutdown-timeout``), the data-parallel / expert-parallel flags and the
network environment.

``replicas`` is the supported mode. ``dp-ep`` is EXPERIMENTAL: rendered and tested as a rendering
(a dense tiny model at DP=2 starts from the rendered dp-ep argv on the CPU stand-in),
NOT validated on MI355X.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from k3rocm.deploy.scale.settings import ScaleSettings, load_scale
from k3rocm.errors import UsageError
from k3rocm.serving.config import load_settings, redact_env, render

NOT_VALIDATED = ("EXPERIMENTAL: rendered by k3rocm, not validated on MI355X; review before use")
# A stopped server gets this long beyond its drain (--shutdown-timeout) before SIGKILL:
# engine and worker teardown after the last request.
STOP_MARGIN_S = 30
# vllm-router --request-timeout-secs (its default too): the longest a request through the router
# lasts. One value for the router flag, the Kubernetes proxy's timeouts, the router pods' grace
# period and compose router-down's drain.
ROUTER_REQUEST_TIMEOUT_S = 1800


@dataclass
class NodePlan:
    """What one node runs: the compose inputs (env_overrides + command) and the result."""

    index: int
    role: str  # replica | head | worker
    address: str  # host:port of the node's API server (from K3_SCALE_NODES)
    env_overrides: dict[str, str]  # K3_* and network variables set on this node
    command: list[str]  # passthrough args given to the entrypoint (compose `command:`)
    env: dict[str, str] = field(default_factory=dict)  # rendered vLLM env (config.render)
    argv: list[str] = field(default_factory=list)  # rendered vLLM argv (config.render)
    host_network: bool = False
    devices: list[str] = field(default_factory=list)
    experimental: bool = False

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "env": redact_env(self.env)}


@dataclass
class Plan:
    scale: ScaleSettings
    nodes: list[NodePlan]
    router_argv: list[str]

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.scale.mode,
                "note": NOT_VALIDATED if self.scale.mode == "dp-ep" else
                "replicas: every node runs the unchanged single-node server",
                "nodes": [n.to_json() for n in self.nodes],
                "router": {"url": self.scale.router_url, "argv": self.router_argv,
                           "image": self.scale.router_image}}


def router_argv(s: ScaleSettings) -> list[str]:
    """vllm-router 0.1.17 arguments from the scale settings."""
    argv = ["vllm-router", "--host", s.router_host, "--port", str(s.router_port),
            *s.routing_flags,
            # Explicit (vllm-router's default too): router-down waits this long to drain.
            "--request-timeout-secs", str(ROUTER_REQUEST_TIMEOUT_S),
            # Explicit: two routers on one host network must not share the default 29000.
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(s.router_metrics_port)]
    # dp-ep: only the head serves the API
    return [*argv, "--worker-urls", *(s.worker_urls[:1] if s.mode == "dp-ep" else s.worker_urls)]


def _network_env(s: ScaleSettings, host: str) -> dict[str, str]:
    env = {"GLOO_SOCKET_IFNAME": s.ifname, "NCCL_SOCKET_IFNAME": s.ifname, "VLLM_HOST_IP": host,
           "NCCL_IB_HCA": s.ib_hca}
    return {k: v for k, v in env.items() if v}


def _dp_args(s: ScaleSettings, index: int) -> list[str]:
    size = len(s.nodes) * s.dp_local
    args = ["--data-parallel-size", str(size), "--data-parallel-size-local", str(s.dp_local),
            "--data-parallel-address", s.node_host(0),
            "--data-parallel-rpc-port", str(s.dp_rpc_port),
            "--enable-expert-parallel", "--all2all-backend", s.all2all]
    if index > 0:
        args += ["--headless", "--data-parallel-start-rank", str(index * s.dp_local)]
    return args


def plan(environ: Mapping[str, str] | None = None, dotenv: str | os.PathLike | None = ".env",
         scale: ScaleSettings | None = None) -> Plan:
    """Validate the serving and scale settings and render every node (no Docker, no network)."""
    environ = dict(os.environ if environ is None else environ)
    # The checkpoint lives on every node, not necessarily here: `make preflight` checks it.
    settings, _ = load_settings(environ, dotenv, host_paths=True, check_model=False)
    s = scale or load_scale(environ, dotenv, tp=settings.tp)
    if s.mode == "single":
        raise UsageError("K3_SCALE_MODE=single: there is nothing to scale out; set "
                         "K3_SCALE_MODE=replicas and K3_SCALE_NODES=host:port,host:port")
    nodes: list[NodePlan] = []
    for i, address in enumerate(s.nodes):
        host, port = s.node_host(i), s.node_port(i)
        dpep = s.mode == "dp-ep"
        # dp-ep: the network variables (GLOO/NCCL interface, RDMA devices, host IP).
        network = _network_env(s, host) if dpep else {}
        overrides = {"K3_PORT": str(port), **network}
        # Drain on stop: vLLM's default (0) aborts every in-flight request at SIGTERM.
        command = ["--shutdown-timeout", str(s.drain_timeout), *(_dp_args(s, i) if dpep else [])]
        rendered = render({**environ, **overrides}, dotenv, passthrough=command, host_paths=True,
                          check_model=False)
        nodes.append(NodePlan(index=i, role=("worker" if i else "head") if dpep else "replica",
                              address=address, env_overrides=overrides, command=command,
                              env={**rendered.env, **network}, argv=rendered.argv,
                              host_network=dpep, devices=["/dev/infiniband"] if dpep else [],
                              experimental=dpep))
    return Plan(scale=s, nodes=nodes, router_argv=router_argv(s))


def drain_timeout(node: NodePlan) -> int:
    """The node's --shutdown-timeout (seconds in-flight requests may finish after SIGTERM)."""
    return int(node.command[node.command.index("--shutdown-timeout") + 1])


def compose_override(node: NodePlan) -> dict[str, Any]:
    """A compose override for one node: `docker compose -f compose.yaml -f <this> up -d`."""
    svc: dict[str, Any] = {"environment": [f"{k}={v}" for k, v in node.env_overrides.items()],
                           "command": list(node.command),
                           # `docker compose stop/down` waits this long before SIGKILL.
                           "stop_grace_period": f"{drain_timeout(node) + STOP_MARGIN_S}s"}
    if node.host_network:
        # host network: the port is the host's own (no published ports)
        svc.update(network_mode="host", ports=[], devices=["/dev/kfd", "/dev/dri", *node.devices],
                   ulimits={"memlock": -1, "stack": 67108864})
    return {"x-k3rocm": {"note": NOT_VALIDATED if node.experimental else
                         "replica: the unchanged server", "role": node.role,
                         "address": node.address, "argv": node.argv},
            "services": {"server": svc}}
