"""Per-node rendering of ``replicas``, on top of the one serving renderer.

Every node's vLLM env and argv come from :func:`k3rocm.serving.config.render` (the function the
image's entrypoint runs), given the node's K3_* environment plus the scale addition as passthrough
arguments. Nothing here writes a second ``vllm serve`` command line by hand: the only scale
addition is the drain flag (``--shutdown-timeout``) and the node's port.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from k3rocm.deploy.scale.settings import ScaleSettings, load_scale
from k3rocm.errors import UsageError
from k3rocm.serving.config import load_settings, redact_env, render

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
    address: str  # host:port of the node's API server (from K3_SCALE_NODES)
    env_overrides: dict[str, str]  # K3_* variables set on this node
    command: list[str]  # passthrough args given to the entrypoint (compose `command:`)
    env: dict[str, str] = field(default_factory=dict)  # rendered vLLM env (config.render)
    argv: list[str] = field(default_factory=list)  # rendered vLLM argv (config.render)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "env": redact_env(self.env)}


@dataclass
class Plan:
    scale: ScaleSettings
    nodes: list[NodePlan]
    router_argv: list[str]

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.scale.mode,
                "note": "replicas: every node runs the unchanged single-node server",
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
    return [*argv, "--worker-urls", *s.worker_urls]


def plan(environ: Mapping[str, str] | None = None, dotenv: str | os.PathLike | None = ".env",
         scale: ScaleSettings | None = None) -> Plan:
    """Validate the serving and scale settings and render every node (no Docker, no network)."""
    environ = dict(os.environ if environ is None else environ)
    # The checkpoint lives on every node, not necessarily here: `make preflight` checks it.
    settings, _ = load_settings(environ, dotenv, host_paths=True, check_model=False)
    s = scale or load_scale(environ, dotenv)
    if s.mode == "single":
        raise UsageError("K3_SCALE_MODE=single: there is nothing to scale out; set "
                         "K3_SCALE_MODE=replicas and K3_SCALE_NODES=host:port,host:port")
    nodes: list[NodePlan] = []
    for i, address in enumerate(s.nodes):
        overrides = {"K3_PORT": str(s.node_port(i))}
        # Drain on stop: vLLM's default (0) aborts every in-flight request at SIGTERM.
        command = ["--shutdown-timeout", str(s.drain_timeout)]
        rendered = render({**environ, **overrides}, dotenv, passthrough=command, host_paths=True,
                          check_model=False)
        nodes.append(NodePlan(index=i, address=address, env_overrides=overrides,
                              command=command, env=rendered.env, argv=rendered.argv))
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
    return {"x-k3rocm": {"note": "replica: the unchanged server", "address": node.address,
                         "argv": node.argv},
            "services": {"server": svc}}
