"""``k3rocm scale``: settings, per-node rendering, Kubernetes manifests, the router, status; one
:func:`subcommand` each. Exit codes: 0 ok, 1 a k8s-check failed, 2 bad settings, 3 degraded/down
or no answer."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from k3rocm.deploy.scale.router import STOP_TIMEOUT_S as ROUTER_STOP_TIMEOUT_S
from k3rocm.errors import EXIT_SERVER, ServerError, UsageError
from k3rocm.options import DeploymentFlags, Options, like, option
from k3rocm.rundir import write_text_atomic


class ScaleFlags(Options):
    """Every flag of ``k3rocm scale``, declared once; a subcommand takes those its row names."""

    env_file: str = like(DeploymentFlags, "env_file")
    out: Path | None = option(None, "render: directory for nodeN.yaml compose overrides; "
                              "render-k8s: write the manifests (multi-document YAML) here")
    listen: str = option("0.0.0.0:8443", "address:port for clients (default %(default)s)")
    # text, not int: a bad make ROUTER= is one line naming it (_whole), not argparse's usage
    instance: str = option("1", "router instance N: container k3rocm-router-N on "
                           "K3_SCALE_ROUTER_PORT+N-1, metrics on K3_SCALE_ROUTER_METRICS_PORT+N-1",
                           metavar="N")
    timeout: str = option(str(ROUTER_STOP_TIMEOUT_S), "seconds in-flight requests may take "
                          "before SIGKILL (default %(default)s)", metavar="SECONDS")
    requests: int = option(24, "per path", aliases=("-n",), ge=1)
    max_tokens: int = option(8, "per request", ge=1)


# name -> (help, fn(args, scale, settings) -> exit code, its ScaleFlags fields, the line that
# refuses K3_SCALE_MODE=single or None, --json: not a field, a pydantic model has .json)
SUBCOMMANDS: dict[str, tuple[str, Callable[..., int], tuple[str, ...], str | None, bool]] = {}
NO_ROUTER = "K3_SCALE_MODE=single has no router: set K3_SCALE_MODE=replicas"


def subcommand(name: str, help: str, *flags: str, single: str | None = None,
               json: bool = False) -> Callable:
    return lambda fn: SUBCOMMANDS.setdefault(name, (help, fn, flags, single, json))[1]


def _whole(what: str, raw: str, least: int) -> int:
    if not raw.isdecimal() or int(raw) < least:
        raise UsageError(f"{what}={raw!r} is not valid: give a whole number >= {least}")
    return int(raw)


def _yaml_dump(obj) -> str:
    import yaml

    return yaml.safe_dump(obj, sort_keys=False, width=100)


@subcommand("config", "print the resolved K3_SCALE_* settings")
def _config(args, s, settings) -> int:
    from k3rocm.deploy.scale.settings import SCALE_ENV

    for name, env in SCALE_ENV.items():
        v = getattr(s, name)
        text = ",".join(map(str, v)) if isinstance(v, tuple) else ("" if v is None else v)
        print(f"{env}={text}")
    return 0


@subcommand("url", "print the router URL (for bench/gsm8k --url)", single=NO_ROUTER)
def _url(args, s, settings) -> int:
    print(s.router_url)
    return 0


@subcommand("render", "per-node env and argv; with --out, one compose override per node "
            "(docker compose -f compose.yaml -f DIR/nodeN.yaml up -d)", "out")
def _render(args, s, settings) -> int:
    from k3rocm.deploy.scale.render import compose_override, plan

    p = plan(dotenv=args.env_file, scale=s)
    for node in p.nodes if args.out else ():
        path = args.out / f"node{node.index}.yaml"
        write_text_atomic(path, "# replicas: the unchanged single-node server on this node\n"
                          f"# replica {node.address}: docker compose -f compose.yaml -f {path} "
                          "up -d\n" + _yaml_dump(compose_override(node)))
        print(f"wrote {path}", file=sys.stderr)
    print(json.dumps(p.to_json(), indent=2))
    return 0


# stacked rows register bottom-up: the lower one is listed first
@subcommand("k8s-check", "the manifests against the strict Kubernetes 1.29-1.37 schemas and, "
            "with a kubeconfig and kubectl, `kubectl apply --dry-run=server` against that "
            "cluster. Exit 0 ok, 1 a check failed, 2 bad settings, 3 the cluster does not answer")
@subcommand("render-k8s", "Kubernetes manifests, checked against the Kubernetes schemas "
            "(kubernetes-validate, offline)", "out")
def _k8s(args, s, settings) -> int:
    from k3rocm.deploy.scale.k8s import render_k8s, validate
    from k3rocm.deploy.scale.k8scheck import k8s_check
    from k3rocm.deploy.scale.render import plan

    objs = render_k8s(plan(dotenv=args.env_file, scale=s), settings)
    text = "---\n".join(_yaml_dump(o) for o in objs)
    if args.scale_cmd == "k8s-check":
        return k8s_check(objs, text)
    for line in validate(objs):
        print(line, file=sys.stderr)
    text = "# replicas: rendered by k3rocm; manifests NOT validated on an MI355X cluster\n" + text
    if args.out:
        write_text_atomic(args.out, text)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        print(text)
    return 0


@subcommand("proxy-conf", "print an nginx configuration that forwards only /v1/* and the "
            "health paths to the router", "listen", single=NO_ROUTER)
def _proxy_conf(args, s, settings) -> int:
    from k3rocm.deploy.scale.k8s import proxy_conf

    print(proxy_conf(args.listen, s.router_port), end="")
    return 0


@subcommand("router-down", "drain (SIGTERM: in-flight requests finish, new connections are "
            "refused), stop and remove the router container", "instance", "timeout")
@subcommand("router-up", "start vllm-router in front of K3_SCALE_NODES (host network)",
            "instance")
def _router(args, s, settings) -> int:
    from k3rocm.deploy.engine import docker_client
    from k3rocm.deploy.scale.render import plan
    from k3rocm.deploy.scale.router import instance, start_router, stop_router

    name, si = instance(s, _whole("--instance (make ROUTER=)", args.instance, 1))
    if args.scale_cmd == "router-down":
        timeout = _whole("--timeout (make ROUTER_TIMEOUT=)", args.timeout, 0)
        metrics = f"http://127.0.0.1:{si.router_metrics_port}/metrics"
        print("router removed" if stop_router(docker_client(), name, timeout, metrics) else
              f"no container named {name}")
        return 0
    plan(dotenv=args.env_file, scale=s)  # validate before starting
    c = start_router(docker_client(), si, name=name)
    print(f"router {c.name} at {si.router_url} -> {', '.join(si.worker_urls)} "
          f"(policy {si.router_policy}); `make status` shows the replicas")
    return 0


@subcommand("status", "health, model, fusions and image per replica; the router's view (ok / "
            "degraded, k of N / down)", json=True, single="K3_SCALE_MODE=single: `make status` "
            "reports scale-out replicas; set K3_SCALE_MODE=replicas and K3_SCALE_NODES (single "
            "node: docker compose ps)")
def _status(args, s, settings) -> int:
    from k3rocm.deploy.engine import docker_client
    from k3rocm.deploy.scale.k8scheck import cluster_nodes
    from k3rocm.deploy.scale.status import format_status, scale_status, status_json

    replicas, router = scale_status(s, docker_client(required=False), settings.api_key or "")
    nodes = cluster_nodes(s, args.env_file)
    lines = format_status(replicas, router)  # the router's summary stays the last line
    lines.insert(-1, f"k8s nodes {nodes[0]}: {nodes[1]}")
    print(json.dumps({**status_json(replicas, router), "kubernetes_nodes": {
        "status": nodes[0], "found": nodes[1]}}, indent=2) if args.json else "\n".join(lines))
    return 0 if router.summary.startswith("ok") else EXIT_SERVER


@subcommand("overhead", "interleaved requests straight to the nodes and through the router: "
            "the router's added milliseconds (vLLM's server time subtracted)", "requests",
            "max_tokens", json=True, single="K3_SCALE_MODE=replicas is needed: the overhead "
            "compares the router with direct requests to its nodes")
def _overhead(args, s, settings) -> int:
    from k3rocm.deploy.scale.overhead import format_figures, measure
    from k3rocm.deploy.server_api import ServerAPI, Unreachable

    key = settings.api_key
    try:
        served = ServerAPI(s.worker_urls[0], key).models()
    except Unreachable as exc:
        raise ServerError(f"{s.worker_urls[0]} does not serve /v1/models ({exc.reason}): "
                          "start the replicas first") from None
    if not served:
        raise ServerError(f"{s.worker_urls[0]} serves no model: start the replicas first")
    figures = measure(s.router_url, s.worker_urls, served[0], args.requests, args.max_tokens, key)
    print(json.dumps(figures, indent=2) if args.json else format_figures(figures))
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    everything = tuple(ScaleFlags.flags())
    ScaleFlags.add_arguments(parser, skip=everything[1:])  # --env-file before the subcommand
    sub = parser.add_subparsers(dest="scale_cmd", metavar="SUBCOMMAND", required=True)
    for name, (what, _, flags, _, json_flag) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=what, description=what)
        ScaleFlags.add_arguments(p, skip=tuple(f for f in everything if f not in flags))
        if json_flag:
            p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from k3rocm.deploy.scale.settings import load_scale
    from k3rocm.serving.config import load_settings

    ScaleFlags.from_args(args)  # a flag out of range: one line, exit 2
    settings, _ = load_settings(dotenv=args.env_file, check_model=False)
    s = load_scale(dotenv=args.env_file)
    _, fn, _, single, _ = SUBCOMMANDS[args.scale_cmd]
    if single and s.mode == "single":
        raise UsageError(single)
    return fn(args, s, settings)
