"""Per-node rendering of ``replicas``: every node's env and argv come from the one serving
renderer (:func:`k3rocm.serving.config.render`); the only additions are the node's port and the
drain flag (``--shutdown-timeout``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from k3rocm.deploy.scale.settings import ScaleSettings, load_scale
from k3rocm.errors import UsageError
from k3rocm.serving.config import load_settings, redact_env, render

STOP_MARGIN_S = 30  # teardown after the drain, before SIGKILL
# vllm-router --request-timeout-secs (its default): router flag, proxy timeouts, router grace
ROUTER_REQUEST_TIMEOUT_S = 1800


@dataclass
class NodePlan:
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
            "--request-timeout-secs", str(ROUTER_REQUEST_TIMEOUT_S),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(s.router_metrics_port)]
    return [*argv, "--worker-urls", *s.worker_urls]


def plan(environ: Mapping[str, str] | None = None, dotenv: str | os.PathLike | None = ".env",
         scale: ScaleSettings | None = None) -> Plan:
    """Validate the serving and scale settings and render every node (no Docker, no network)."""
    environ = dict(os.environ if environ is None else environ)
    settings, _ = load_settings(environ, dotenv, host_paths=True, check_model=False)
    s = scale or load_scale(environ, dotenv)
    if s.mode == "single":
        raise UsageError("K3_SCALE_MODE=single: there is nothing to scale out; set "
                         "K3_SCALE_MODE=replicas and K3_SCALE_NODES=host:port,host:port")
    nodes: list[NodePlan] = []
    for i, address in enumerate(s.nodes):
        overrides = {"K3_PORT": str(s.node_port(i))}
        command = ["--shutdown-timeout", str(s.drain_timeout)]
        rendered = render({**environ, **overrides}, dotenv, passthrough=command, host_paths=True,
                          check_model=False)
        nodes.append(NodePlan(index=i, address=address, env_overrides=overrides,
                              command=command, env=rendered.env, argv=rendered.argv))
    return Plan(scale=s, nodes=nodes, router_argv=router_argv(s))


def drain_timeout(node: NodePlan) -> int:
    """The node's --shutdown-timeout."""
    return int(node.command[node.command.index("--shutdown-timeout") + 1])


def compose_override(node: NodePlan) -> dict[str, Any]:
    """A compose override for one node: `docker compose -f compose.yaml -f <this> up -d`."""
    svc: dict[str, Any] = {"environment": [f"{k}={v}" for k, v in node.env_overrides.items()],
                           "command": list(node.command),
                           "stop_grace_period": f"{drain_timeout(node) + STOP_MARGIN_S}s"}
    return {"x-k3rocm": {"note": "replica: the unchanged server", "address": node.address,
                         "argv": node.argv},
            "services": {"server": svc}}
