"""Kubernetes rendering of ``replicas`` (``make render-k8s``; not validated on MI355X):
a server Deployment (one 8-GPU pod per MI355X node), router pods (vllm-router on loopback behind
an nginx data-path proxy, service discovery by label), budgets and NetworkPolicies; images are
pinned pullable references. docs/scale.md describes every object.
"""

from __future__ import annotations

import json
from typing import Any

from k3rocm.deploy.scale.render import (
    ROUTER_REQUEST_TIMEOUT_S,
    STOP_MARGIN_S,
    NodePlan,
    Plan,
    drain_timeout,
)
from k3rocm.deploy.scale.settings import check_image_ref
from k3rocm.errors import UsageError
from k3rocm.serving.config import SECRET_KEYS
from k3rocm.serving.settings import ENV_NAME, Settings

K8S_VERSION = "1.33.0"  # schema version the renderings are checked against
APP = "k3rocm-server"
ROUTER = "k3rocm-router"
LABEL_KEY = "app.kubernetes.io/name"
SHM_SIZE = "64Gi"
NODE_MODELS_DIR = "/var/lib/k3rocm/models"
NODE_CACHE_DIR = "/var/lib/k3rocm/cache"
SERVER_REQUESTS = {"cpu": "32", "memory": "256Gi"}
ROUTER_REQUESTS = {"cpu": "2", "memory": "2Gi"}
PROXY_REQUESTS = {"cpu": "500m", "memory": "128Mi"}
PRESTOP_S = 15  # before SIGTERM: a terminating pod leaves discovery / the Service endpoints
ROUTER_INTERNAL_PORT = 30000  # vllm-router's own default port, on 127.0.0.1 in its pod
ROUTER_INTERNAL_METRICS_PORT = 30001  # its --prometheus-port, on 127.0.0.1 (proxy exposes it)
# vllm-router 0.1.17 drains on SIGTERM (src/server.rs graceful shutdown): it gets it after
# the proxy has stopped accepting (`nginx -s quit` at PRESTOP_S).
ROUTER_PRESTOP_S = PRESTOP_S + 5
ROUTER_PYTHON = "/opt/router/bin/python3"  # docker/router/Dockerfile: the venv of vllm-router
ROUTER_UID = 65534  # docker/router/Dockerfile: USER 65534:65534
PROXY_UID = 101  # nginx-unprivileged's nginx user (K3_SCALE_PROXY_IMAGE)
PROXY_CONF_DIR = "/etc/k3rocm"
STATELESS_POLICIES = ("random", "round_robin")
PULL_ALLOWANCE_S = 900  # a new server pod's image pull (tens of GB)
CACHE_SIZE = "200Gi"  # baseline/restricted: the HF/vLLM/Triton caches' emptyDir


def proxy_conf(listen: str, upstream_port: int,
               timeout_s: int = ROUTER_REQUEST_TIMEOUT_S, tmp: str = "/tmp",
               metrics_listen: str | None = None, metrics_port: int | None = None) -> str:
    """nginx config forwarding only ``/v1/*`` and the health paths (normalized ``$uri``:
    ``/v1/../add_worker`` is a 404), unbuffered; ``metrics_listen``: ``/metrics`` alone on a
    port of its own. Runs unprivileged (temp files and pid in ``tmp``)."""
    up = f"http://127.0.0.1:{upstream_port}$uri$is_args$args"
    fwd = (f"proxy_pass {up}; proxy_http_version 1.1; proxy_set_header Connection \"\"; "
           "proxy_buffering off; proxy_request_buffering off; "
           f"proxy_read_timeout {timeout_s}s; proxy_send_timeout {timeout_s}s;")
    return "\n".join([
        "# vllm-router data-port proxy (k3rocm): only /v1/* and health paths are forwarded.",
        "worker_processes 1;", f"pid {tmp}/nginx.pid;", "error_log stderr warn;",
        "events { worker_connections 4096; }",
        "http {",
        "  access_log off;",
        f"  client_body_temp_path {tmp}/nginx-body; proxy_temp_path {tmp}/nginx-proxy;",
        f"  fastcgi_temp_path {tmp}/nginx-fcgi; uwsgi_temp_path {tmp}/nginx-uwsgi;",
        f"  scgi_temp_path {tmp}/nginx-scgi;",
        "  client_max_body_size 64m;",
        "  server {",
        f"    listen {listen};",
        f"    location /v1/ {{ {fwd} }}",
        *(f"    location = {p} {{ {fwd} }}" for p in ("/health", "/readiness", "/liveness")),
        "    location / { return 404; }",
        "  }",
        *([f"  server {{ listen {metrics_listen}; location = /metrics {{ proxy_pass "
           f"http://127.0.0.1:{metrics_port}/metrics; }} location / {{ return 404; }} }}"]
          if metrics_listen else []),
        "}", ""])


def proxy_stop_command(conf: str, sleep_s: int = PRESTOP_S, tmp: str = "/tmp") -> list[str]:
    """The proxy's preStop: wait, ``nginx -s quit`` (graceful; SIGTERM would cut streams),
    return when nginx has exited (its pid file is gone)."""
    return ["/bin/sh", "-c", f"sleep {sleep_s}; nginx -c {conf} -s quit; "
            f"while [ -e {tmp}/nginx.pid ]; do sleep 1; done"]


def _probe(path: str, port: int, period: int, timeout: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period,
            "timeoutSeconds": timeout, "failureThreshold": failures}


def _restricted(uid: int) -> dict[str, Any]:
    """A container securityContext that passes Pod Security "restricted"."""
    return {"runAsNonRoot": True, "runAsUser": uid, "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


def _pod_security(level: str, s: Any, c: dict[str, Any], spec: dict[str, Any],
                  vols: list[dict[str, Any]]) -> None:
    """The server container's privileges and storage for K3_SCALE_POD_SECURITY: privileged =
    compose's (hostPaths, IPC_LOCK, SYS_PTRACE, seccomp Unconfined per ROCm's Docker guide);
    baseline: a read-only claim + emptyDir caches; restricted: baseline, non-root."""
    if level == "privileged":
        c["securityContext"] = {"capabilities": {"add": ["SYS_PTRACE", "IPC_LOCK"]},
                                "seccompProfile": {"type": "Unconfined"}}
        vols += [{"name": "models", "hostPath": {"path": NODE_MODELS_DIR, "type": "Directory"}},
                 {"name": "cache", "hostPath": {"path": NODE_CACHE_DIR,
                                                "type": "DirectoryOrCreate"}}]
        return
    vols += [{"name": "models", "persistentVolumeClaim": {"claimName": s.models_claim,
                                                          "readOnly": True}},
             {"name": "cache", "emptyDir": {"sizeLimit": CACHE_SIZE}}]
    if level == "baseline":
        c["securityContext"] = {"seccompProfile": {"type": "RuntimeDefault"}}
        return
    c["securityContext"] = _restricted(s.run_as_user)
    c["env"].append({"name": "HOME", "value": "/cache"})  # the image's HOME is root's
    spec["securityContext"] = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"},
                               **({"supplementalGroups": list(s.gpu_groups)}
                                  if s.gpu_groups else {})}


def _settings_env(settings: Settings, port: int) -> list[dict[str, Any]]:
    """The resolved K3_* settings as container env (secrets from a Secret, never inline)."""
    out: list[dict[str, Any]] = []
    for name, env_name in ENV_NAME.items():
        value = port if name == "port" else getattr(settings, name)
        if env_name in SECRET_KEYS:
            if value:
                out.append({"name": env_name, "valueFrom": {"secretKeyRef": {
                    "name": "k3rocm-secrets", "key": env_name, "optional": False}}})
            continue
        if value is None or value == "":
            continue
        if isinstance(value, bool):
            value = "1" if value else "0"
        out.append({"name": env_name, "value": str(value)})
    out.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": "k3rocm-secrets", "key": "HF_TOKEN", "optional": True}}})
    return out


def _server_pod(node: NodePlan, plan: Plan, settings: Settings, image: str, startup_s: int
                ) -> dict[str, Any]:
    """The pod spec of one server: its container and volumes, on an MI355X node."""
    port = int(node.env_overrides.get("K3_PORT", settings.port))
    c: dict[str, Any] = {
        "name": "server", "image": image, "imagePullPolicy": "IfNotPresent",
        "env": _settings_env(settings, port),
        "ports": [{"name": "http", "containerPort": port}],
        "resources": {"limits": {"amd.com/gpu": 8},
                      "requests": {"amd.com/gpu": 8, **SERVER_REQUESTS}},
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"},
                         {"name": "models", "mountPath": "/models", "readOnly": True},
                         {"name": "cache", "mountPath": "/cache"}],
        "startupProbe": _probe("/health", port, 10, 5, max(1, -(-startup_s // 10))),
        "readinessProbe": _probe("/health", port, 10, 5, 3),
        "livenessProbe": _probe("/health", port, 30, 10, 5),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_S)]}}},
    }
    c["args"] = list(node.command)
    vols: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}}]
    spec: dict[str, Any] = {
        "containers": [c], "volumes": vols,
        "automountServiceAccountToken": False,
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": plan.scale.node_affinity_terms}}},
        "terminationGracePeriodSeconds": server_grace(node)}
    _pod_security(plan.scale.pod_security, plan.scale, c, spec, vols)
    return spec


def server_grace(node: NodePlan) -> int:  # preStop, the whole drain, teardown
    return PRESTOP_S + drain_timeout(node) + STOP_MARGIN_S


def _meta(name: str, labels: dict[str, str], annotations: dict[str, str] | None = None
          ) -> dict[str, Any]:
    return {"name": name, "labels": labels, **({"annotations": annotations} if annotations else {})}


def _scrape(port: int) -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
            "prometheus.io/path": "/metrics"}


def _deployment(name: str, labels: dict[str, str], replicas: int, pod: dict[str, Any],
                annotations: dict[str, str], pod_annotations: dict[str, str],
                surge: int, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": _meta(name, labels, annotations),
            "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                     "strategy": {"type": "RollingUpdate", "rollingUpdate": {
                         "maxSurge": surge, "maxUnavailable": 1 - surge}},
                     **spec,
                     "template": {"metadata": {"labels": labels,
                                               "annotations": pod_annotations},
                                  "spec": pod}}}


def _pdb(name: str, labels: dict[str, str], **budget: int) -> dict[str, Any]:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _meta(name, labels),
            "spec": {**budget, "selector": {"matchLabels": labels}}}


def _service(name: str, selector: dict[str, str], port: int, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(name, {LABEL_KEY: name}),
            "spec": {"selector": selector, "ports": [{"name": "http", "port": port,
                                                      "targetPort": port}], **spec}}


def _scraper(s: Any) -> list[dict[str, Any]]:
    """The NetworkPolicy peer of the metrics scraper: every pod of its namespace."""
    return [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": s.metrics_namespace}}}]


def _network_policy(name: str, pods: dict[str, str], ingress: list[dict[str, Any]]
                    ) -> dict[str, Any]:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(name, pods),
            "spec": {"podSelector": {"matchLabels": pods}, "policyTypes": ["Ingress"],
                     "ingress": ingress}}


def _tcp(port: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": port}]


def _router(plan: Plan, server_port: int) -> list[dict[str, Any]]:
    s = plan.scale
    router_image = check_image_ref("K3_SCALE_ROUTER_IMAGE", s.router_image)
    proxy_image = check_image_ref("K3_SCALE_PROXY_IMAGE", s.proxy_image)
    labels = {LABEL_KEY: ROUTER}
    args = ["--host", "127.0.0.1", "--port", str(ROUTER_INTERNAL_PORT), *s.routing_flags,
            "--request-timeout-secs", str(ROUTER_REQUEST_TIMEOUT_S),
            "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(ROUTER_INTERNAL_METRICS_PORT),
            "--service-discovery", "--selector", f"{LABEL_KEY}={APP}",
            "--service-discovery-port", str(server_port),
            "--service-discovery-namespace", "$(POD_NAMESPACE)"]
    router = {"name": "router", "image": router_image, "imagePullPolicy": "IfNotPresent",
              "args": args,
              "env": [{"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {
                  "fieldPath": "metadata.namespace"}}}],
              "resources": {"requests": ROUTER_REQUESTS},
              "securityContext": _restricted(ROUTER_UID),
              # /liveness of the router itself, from inside its container (loopback only)
              "livenessProbe": {"exec": {"command": [
                  ROUTER_PYTHON, "-c", "import urllib.request; urllib.request.urlopen("
                  f"'http://127.0.0.1:{ROUTER_INTERNAL_PORT}/liveness', timeout=4)"]},
                  "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3},
              "lifecycle": {"preStop": {"exec": {"command": ["sleep",
                                                             str(ROUTER_PRESTOP_S)]}}}}
    conf = f"{PROXY_CONF_DIR}/nginx.conf"
    proxy = {"name": "proxy", "image": proxy_image, "imagePullPolicy": "IfNotPresent",
             "args": ["nginx", "-g", "daemon off;", "-c", conf],
             "ports": [{"name": "http", "containerPort": s.router_port},
                       {"name": "metrics", "containerPort": s.router_metrics_port}],
             "volumeMounts": [{"name": "proxy-conf", "mountPath": PROXY_CONF_DIR,
                               "readOnly": True}],
             "resources": {"requests": PROXY_REQUESTS},
             "securityContext": _restricted(PROXY_UID),
             "readinessProbe": _probe("/readiness", s.router_port, 10, 5, 3),
             "livenessProbe": {"tcpSocket": {"port": s.router_port}, "periodSeconds": 10,
                               "timeoutSeconds": 5, "failureThreshold": 3},
             "lifecycle": {"preStop": {"exec": {"command": proxy_stop_command(conf)}}}}
    pod = {"containers": [router, proxy], "serviceAccountName": ROUTER,
           "automountServiceAccountToken": True,
           "securityContext": {"runAsNonRoot": True,
                               "seccompProfile": {"type": "RuntimeDefault"}},
           # preStop, the longest request, margin
           "terminationGracePeriodSeconds": (ROUTER_PRESTOP_S + ROUTER_REQUEST_TIMEOUT_S
                                             + STOP_MARGIN_S),
           "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
               {"weight": 100, "podAffinityTerm": {"labelSelector": {"matchLabels": labels},
                                                   "topologyKey": "kubernetes.io/hostname"}}]}},
           "volumes": [{"name": "proxy-conf", "configMap": {"name": f"{ROUTER}-proxy"}}]}
    n = s.router_replicas
    return [
        _network_policy(ROUTER, labels, [
            {"ports": _tcp(s.router_port)},  # the data paths: from anywhere
            {"from": _scraper(s), "ports": _tcp(s.router_metrics_port)}]),
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(ROUTER, labels)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": _meta(ROUTER, labels),
         "rules": [{"apiGroups": [""], "resources": ["pods"],
                    "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": _meta(ROUTER, labels),
         "subjects": [{"kind": "ServiceAccount", "name": ROUTER}],
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": ROUTER}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(f"{ROUTER}-proxy", labels),
         "data": {"nginx.conf": proxy_conf(
             str(s.router_port), ROUTER_INTERNAL_PORT, metrics_listen=str(s.router_metrics_port),
             metrics_port=ROUTER_INTERNAL_METRICS_PORT)}},
        _deployment(ROUTER, labels, n, pod,
                    {"k3rocm.org/note": "router for the rendered servers; only the proxy's "
                     "data paths are reachable"}, _scrape(s.router_metrics_port), surge=1),
        # with one replica a budget would block every node drain
        *([_pdb(ROUTER, labels, minAvailable=1)] if n >= 2 else []),
        _service(ROUTER, labels, s.router_port,
                 **({} if s.router_policy in STATELESS_POLICIES or n == 1 else
                    {"sessionAffinity": "ClientIP"})),
    ]


def render_k8s(plan: Plan, settings: Settings) -> list[dict[str, Any]]:
    """Kubernetes objects for ``plan`` (a list of dicts, in apply order)."""
    s = plan.scale
    image = check_image_ref("K3_IMAGE", settings.image)
    startup = max(s.router_startup_timeout, 600)
    node = plan.nodes[0]
    port = int(node.env_overrides["K3_PORT"])
    labels = {LABEL_KEY: APP}
    pod = _server_pod(node, plan, settings, image, startup)
    # maxSurge 0 (no spare 8-GPU node): a new pod waits for the old one's grace, pulls, starts
    deadline = server_grace(node) + PULL_ALLOWANCE_S + startup
    return [_network_policy(APP, labels, [
                {"from": [{"podSelector": {"matchLabels": {LABEL_KEY: ROUTER}}},
                          *_scraper(s)], "ports": _tcp(port)}]),
            _deployment(APP, labels, len(plan.nodes), pod,
                        {"k3rocm.org/note": "replicas: the unchanged single-node server; "
                         "manifests not validated on MI355X", "k3rocm.org/argv":
                         json.dumps(node.argv), "k3rocm.org/pod-security": s.pod_security},
                        _scrape(port), surge=0, progressDeadlineSeconds=deadline),
            _pdb(APP, labels, maxUnavailable=1),
            *_router(plan, port)]


def validate(objs: list[dict[str, Any]], version: str = K8S_VERSION) -> list[str]:
    """Check every object against the Kubernetes schemas; return one line per object."""
    try:
        import kubernetes_validate
    except ImportError:
        raise UsageError("kubernetes-validate is not installed: `make venv` (host extras)"
                         ) from None
    lines = []
    for obj in objs:
        what = f"{obj['kind']}/{obj['metadata']['name']}"
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise UsageError(f"{what} fails the Kubernetes {version} schema: "
                             f"{exc.message} at {'/'.join(map(str, exc.path))}") from None
        lines.append(f"ok  {what} (Kubernetes {version} schema)")
    return lines
