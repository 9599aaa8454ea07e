"""``k3rocm scale``: settings, per-node rendering, Kubernetes manifests, the router, status.
Exit codes: 0 ok, 1 a k8s-check failed, 2 bad settings, 3 degraded/down or no answer."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from k3rocm.deploy.scale.router import STOP_TIMEOUT_S as ROUTER_STOP_TIMEOUT_S
from k3rocm.errors import EXIT_SERVER, ServerError, UsageError
from k3rocm.rundir import write_text_atomic


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--env-file", default=".env", help="optional KEY=VALUE file")
    sub = parser.add_subparsers(dest="scale_cmd", metavar="SUBCOMMAND", required=True)

    def add(name: str, what: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=what, description=what)

    add("config", "print the resolved K3_SCALE_* settings")
    add("url", "print the router URL (for bench/gsm8k --url)")
    add("render", "per-node env and argv; with --out, one compose override per node (docker "
        "compose -f compose.yaml -f DIR/nodeN.yaml up -d)").add_argument(
        "--out", type=Path, help="directory for nodeN.yaml compose overrides")
    add("render-k8s", "Kubernetes manifests, checked against the Kubernetes schemas "
        "(kubernetes-validate, offline)").add_argument(
        "--out", type=Path, help="write the manifests (multi-document YAML) here")
    add("k8s-check", "the manifests against the strict Kubernetes 1.29-1.37 schemas and, with "
        "a kubeconfig and kubectl, `kubectl apply --dry-run=server` against that cluster. "
        "Exit 0 ok, 1 a check failed, 2 bad settings, 3 the cluster does not answer")
    add("proxy-conf", "print an nginx configuration that forwards only /v1/* and the health "
        "paths to the router").add_argument(
        "--listen", default="0.0.0.0:8443", help="address:port for clients (default %(default)s)")
    for name, what in (("router-up", "start vllm-router in front of K3_SCALE_NODES (host "
                        "network)"),
                       ("router-down", "drain (SIGTERM: in-flight requests finish, new "
                        "connections are refused), stop and remove the router container")):
        p = add(name, what)
        p.add_argument("--instance", default="1", metavar="N",
                       help="router instance N: container k3rocm-router-N on "
                       "K3_SCALE_ROUTER_PORT+N-1, metrics on K3_SCALE_ROUTER_METRICS_PORT+N-1")
        if name == "router-down":
            p.add_argument("--timeout", default=str(ROUTER_STOP_TIMEOUT_S), metavar="SECONDS",
                           help="seconds in-flight requests may take before SIGKILL "
                           "(default %(default)s)")
    add("status", "health, model, fusions and image per replica; the router's view (ok / "
        "degraded, k of N / down)").add_argument("--json", action="store_true")
    p = add("overhead", "interleaved requests straight to the nodes and through the router: "
            "the router's added milliseconds (vLLM's server time subtracted)")
    p.add_argument("-n", "--requests", type=int, default=24, help="per path (default 24)")
    p.add_argument("--max-tokens", type=int, default=8, help="per request (default 8)")
    p.add_argument("--json", action="store_true")


def _whole(what: str, raw: str, least: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < least:
        raise UsageError(f"{what}={raw!r} is not valid: give a whole number >= {least}")
    return value


def _yaml_dump(obj) -> str:
    import yaml

    return yaml.safe_dump(obj, sort_keys=False, width=100)


def run(args: argparse.Namespace) -> int:
    from k3rocm.deploy.scale.settings import SCALE_ENV, load_scale
    from k3rocm.serving.config import load_settings

    settings, _ = load_settings(dotenv=args.env_file, check_model=False)
    s = load_scale(dotenv=args.env_file)
    cmd = args.scale_cmd
    if cmd in ("url", "proxy-conf") and s.mode == "single":
        raise UsageError("K3_SCALE_MODE=single has no router: set K3_SCALE_MODE=replicas")
    if cmd == "config":
        for name, env in SCALE_ENV.items():
            v = getattr(s, name)
            text = ",".join(map(str, v)) if isinstance(v, tuple) else ("" if v is None else v)
            print(f"{env}={text}")
        return 0
    if cmd == "url":
        print(s.router_url)
        return 0
    if cmd == "status":
        from k3rocm.deploy.scale.status import format_status, scale_status, status_json

        if s.mode == "single":
            raise UsageError("K3_SCALE_MODE=single: `make status` reports scale-out replicas; "
                             "set K3_SCALE_MODE=replicas and K3_SCALE_NODES (single node: "
                             "docker compose ps)")
        from k3rocm.deploy.engine import docker_client
        from k3rocm.deploy.scale.k8scheck import cluster_nodes

        replicas, router = scale_status(s, docker_client(required=False))
        nodes = cluster_nodes(s, args.env_file)
        lines = format_status(replicas, router)  # the router's summary stays the last line
        lines.insert(-1, f"k8s nodes {nodes[0]}: {nodes[1]}")
        print(json.dumps({**status_json(replicas, router), "kubernetes_nodes": {
            "status": nodes[0], "found": nodes[1]}}, indent=2) if args.json else "\n".join(lines))
        return 0 if router.summary.startswith("ok") else EXIT_SERVER
    if cmd == "overhead":
        from k3rocm.deploy.deployment import load_deployment
        from k3rocm.deploy.scale.overhead import format_figures, measure
        from k3rocm.deploy.server_api import ServerAPI, Unreachable

        if s.mode != "replicas":
            raise UsageError("K3_SCALE_MODE=replicas is needed: the overhead compares the "
                             "router with direct requests to its nodes")
        if args.requests < 1 or args.max_tokens < 1:
            raise UsageError("--requests and --max-tokens must be >= 1")
        key = load_deployment().api_key
        try:
            served = ServerAPI(s.worker_urls[0], key).models()
        except Unreachable as exc:
            raise ServerError(f"{s.worker_urls[0]} does not serve /v1/models ({exc.reason}): "
                              "start the replicas first") from None
        if not served:
            raise ServerError(f"{s.worker_urls[0]} serves no model: start the replicas first")
        figures = measure(s.router_url, s.worker_urls, served[0], args.requests,
                          args.max_tokens, key)
        print(json.dumps(figures, indent=2) if args.json else format_figures(figures))
        return 0
    if cmd == "proxy-conf":
        from k3rocm.deploy.scale.k8s import proxy_conf

        print(proxy_conf(args.listen, s.router_port), end="")
        return 0
    if cmd in ("router-up", "router-down"):
        from k3rocm.deploy.engine import docker_client
        from k3rocm.deploy.scale.router import instance, start_router, stop_router

        name, si = instance(s, _whole("--instance (make ROUTER=)", args.instance, 1))
        if cmd == "router-down":
            timeout = _whole("--timeout (make ROUTER_TIMEOUT=)", args.timeout, 0)
            client = docker_client()
            metrics = f"http://127.0.0.1:{si.router_metrics_port}/metrics"
            print("router removed" if stop_router(client, name, timeout, metrics) else
                  f"no container named {name}")
            return 0
        from k3rocm.deploy.scale.render import plan

        plan(dotenv=args.env_file, scale=s)  # validate before starting
        client = docker_client()
        c = start_router(client, si, name=name)
        print(f"router {c.name} at {si.router_url} -> {', '.join(si.worker_urls)} "
              f"(policy {si.router_policy}); `make status` shows the replicas")
        return 0
    from k3rocm.deploy.scale.render import compose_override, plan

    p = plan(dotenv=args.env_file, scale=s)
    if cmd == "render":
        if args.out:
            for node in p.nodes:
                path = args.out / f"node{node.index}.yaml"
                write_text_atomic(path, "# replicas: the unchanged single-node server on this "
                                  f"node\n# replica {node.address}: docker compose -f "
                                  f"compose.yaml -f {path} up -d\n"
                                  + _yaml_dump(compose_override(node)))
                print(f"wrote {path}", file=sys.stderr)
        print(json.dumps(p.to_json(), indent=2))
        return 0
    if cmd == "k8s-check":
        from k3rocm.deploy.scale.k8s import render_k8s
        from k3rocm.deploy.scale.k8scheck import k8s_check

        objs = render_k8s(p, settings)
        return k8s_check(objs, "---\n".join(_yaml_dump(o) for o in objs))
    if cmd == "render-k8s":
        from k3rocm.deploy.scale.k8s import render_k8s, validate

        objs = render_k8s(p, settings)
        for line in validate(objs):
            print(line, file=sys.stderr)
        text = ("# replicas: rendered by k3rocm; manifests NOT validated on an MI355X cluster\n"
                + "---\n".join(_yaml_dump(o) for o in objs))
        if args.out:
            write_text_atomic(args.out, text)
            print(f"wrote {args.out}", file=sys.stderr)
        else:
            print(text)
    return 0
