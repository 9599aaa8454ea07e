"""Kubernetes rendering of ``replicas`` (``make render-k8s``): NOT validated on MI355X.

A Deployment of N unchanged servers (``amd.com/gpu: 8`` each, one per MI355X
  node), a PodDisruptionBudget, and the router (vllm-router) as a Deployment + Service that finds
  the servers by label in its own namespace (``--service-discovery`` with
  ``--service-discovery-namespace`` = the pod's namespace, which is what the rendered Role allows).
  The router listens on 127.0.0.1 inside its pod: its admin endpoints (``/add_worker``,
  ``/remove_worker``, ...) share the data port, so an nginx sidecar (:func:`proxy_conf`) is the
  only thing the Service reaches, and it forwards only ``/v1/*`` and the health paths.
  Two or more router pods (surge 1, a PodDisruptionBudget, spread over nodes) that stop
  without cutting a stream; NetworkPolicies admit the servers' port only from the router and
  the metrics scraper. Server pods are placed by AMD's node labels (required node affinity).

Every image must be a pullable, pinned reference (registry/repo@sha256:...): a node cannot see a
local tag. K3_SCALE_POD_SECURITY picks the server pods' privileges and storage: ``privileged``
(node-local hostPath checkpoint, read-only, and caches, one 8-GPU pod per node, so no replica
waits for another's volume), ``baseline`` or ``restricted`` (a read-only claim and an emptyDir).
The server containers run the same image and entrypoint as compose, with the resolved K3_*
settings as environment (the entrypoint renders the same argv as on a compose node: see the
``k3rocm.org/argv`` annotation) and the drain flag as arguments.
Every object is checked against the Kubernetes JSON schemas with ``kubernetes-validate``
(bundled schemas, offline).
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
# Node-local storage on every MI355X node: the checkpoint staged once per node (read-only here),
# the HF/vLLM/Triton caches of the one server pod on that node.
NODE_MODELS_DIR = "/var/lib/k3rocm/models"
NODE_CACHE_DIR = "/var/lib/k3rocm/cache"
SERVER_REQUESTS = {"cpu": "32", "memory": "256Gi"}
ROUTER_REQUESTS = {"cpu": "2", "memory": "2Gi"}
PROXY_REQUESTS = {"cpu": "500m", "memory": "128Mi"}
# Before SIGTERM: time for the router to stop picking a terminating server pod
# (discovery/health), and for the Service to drop a terminating router pod from its endpoints.
PRESTOP_S = 15
ROUTER_INTERNAL_PORT = 30000  # vllm-router's own default port, on 127.0.0.1 in its pod
ROUTER_INTERNAL_METRICS_PORT = 30001  # its --prometheus-port, on 127.0.0.1 (proxy exposes it)
# The router's SIGTERM (vllm-router 0.1.17 src/server.rs "Received terminate signal, starting
# graceful shutdown"): it closes its listener at once and exits when its in-flight requests
# have finished. So it gets its SIGTERM after the proxy has stopped accepting (`nginx -s quit`
# at PRESTOP_S); nginx's own SIGTERM would be a fast shutdown that cuts every stream.
ROUTER_PRESTOP_S = PRESTOP_S + 5
ROUTER_PYTHON = "/opt/router/bin/python3"  # docker/router/Dockerfile: the venv of vllm-router
ROUTER_UID = 65534  # docker/router/Dockerfile: USER 65534:65534
PROXY_UID = 101  # nginx-unprivileged's nginx user (K3_SCALE_PROXY_IMAGE)
PROXY_CONF_DIR = "/etc/k3rocm"
# Policies that keep no per-router state: N routers behave like one (docs/scale.md).
STATELESS_POLICIES = ("random", "round_robin")
# A new server pod's image pull (tens of GB) before its startup probe starts counting.
PULL_ALLOWANCE_S = 900
CACHE_SIZE = "200Gi"  # baseline/restricted: the HF/vLLM/Triton caches' emptyDir


def proxy_conf(listen: str, upstream_port: int,
               timeout_s: int = ROUTER_REQUEST_TIMEOUT_S, tmp: str = "/tmp",
               metrics_listen: str | None = None, metrics_port: int | None = None) -> str:
    """nginx configuration that exposes only the router's data paths.

    ``/v1/*`` (completions, chat, models, responses) and the health paths reach the router;
    everything else (``/add_worker``, ``/remove_worker``, ``/list_workers``, ``/flush_cache``,
    ...) is 404. The path is forwarded normalized (``$uri``), so ``/v1/../add_worker`` is
    ``/add_worker`` to nginx too and never reaches the router. Streaming is not buffered.
    With ``metrics_listen``, a second server forwards only ``/metrics`` to the router's
    Prometheus port (``metrics_port`` on 127.0.0.1): a port of its own, so a NetworkPolicy
    can admit the scraper there and nobody else. Runs unprivileged (temp files and pid in
    ``tmp``).
    """
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
    """The proxy's preStop: wait while the Service drops the pod, then quit gracefully (every
    proxied stream finishes; nginx's SIGTERM would be a fast shutdown that cuts them) and
    return only when nginx has exited (its pid file, in ``tmp`` per :func:`proxy_conf`, is
    gone)."""
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
    """The server container's privileges and storage for K3_SCALE_POD_SECURITY (docs/scale.md).

    privileged: the compose settings. hostPath checkpoint and caches (node-local, staged once
    per node); IPC_LOCK (pinned host memory, RDMA registration: the only capability llm-d's AMD
    decode manifest gives vLLM); SYS_PTRACE (compose has it; cross-process checks of debuggers
    and profilers, and of IPC that asks for ptrace access between sibling workers: nothing
    here can show ROCm runs without it); seccomp Unconfined (ROCm's Docker guide: memory
    policy / NUMA mapping syscalls). baseline: none of these; the checkpoint from a
    read-only PersistentVolumeClaim, the caches in an emptyDir. restricted: baseline as a
    non-root user with every capability dropped, in the GPU device groups.
    """
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
        # A 1.5 TB load and kernel compilation: give /health up to startup_s to answer.
        "startupProbe": _probe("/health", port, 10, 5, max(1, -(-startup_s // 10))),
        "readinessProbe": _probe("/health", port, 10, 5, 3),
        "livenessProbe": _probe("/health", port, 30, 10, 5),
        # Out of the router's rotation before SIGTERM; then vLLM drains (--shutdown-timeout).
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_S)]}}},
    }
    c["args"] = list(node.command)
    vols: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}}]
    spec: dict[str, Any] = {
        "containers": [c], "volumes": vols,
        # The servers call no Kubernetes API: no token in the pod.
        "automountServiceAccountToken": False,
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": plan.scale.node_affinity_terms}}},
        "terminationGracePeriodSeconds": server_grace(node)}
    _pod_security(plan.scale.pod_security, plan.scale, c, spec, vols)
    return spec


def server_grace(node: NodePlan) -> int:
    """A server pod's terminationGracePeriodSeconds: preStop, the whole drain, teardown."""
    return PRESTOP_S + drain_timeout(node) + STOP_MARGIN_S


def _meta(name: str, labels: dict[str, str], annotations: dict[str, str] | None = None
          ) -> dict[str, Any]:
    return {"name": name, "labels": labels, **({"annotations": annotations} if annotations else {})}


def _annotations(node: NodePlan) -> dict[str, str]:
    return {"k3rocm.org/note":
            "replicas: the unchanged single-node server; manifests not validated on MI355X",
            "k3rocm.org/argv": json.dumps(node.argv)}


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
    """Ingress to ``pods`` only by these rules (egress is not restricted)."""
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
            # Metrics on loopback too: the proxy serves them on a port of their own.
            "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(ROUTER_INTERNAL_METRICS_PORT),
            "--service-discovery", "--selector", f"{LABEL_KEY}={APP}",
            "--service-discovery-port", str(server_port),
            # The Role below covers this namespace only: watch exactly it.
            "--service-discovery-namespace", "$(POD_NAMESPACE)"]
    router = {"name": "router", "image": router_image, "imagePullPolicy": "IfNotPresent",
              "args": args,
              "env": [{"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {
                  "fieldPath": "metadata.namespace"}}}],
              "resources": {"requests": ROUTER_REQUESTS},
              "securityContext": _restricted(ROUTER_UID),
              # The router itself answers /liveness (a hung router is restarted, not nginx):
              # it listens on 127.0.0.1 only, so the probe runs inside its container.
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
             # Ready = the router has a healthy worker (503 otherwise, 200 while one of N
             # restarts); live = nginx accepts (the router has its own probe).
             "readinessProbe": _probe("/readiness", s.router_port, 10, 5, 3),
             "livenessProbe": {"tcpSocket": {"port": s.router_port}, "periodSeconds": 10,
                               "timeoutSeconds": 5, "failureThreshold": 3},
             "lifecycle": {"preStop": {"exec": {"command": proxy_stop_command(conf)}}}}
    pod = {"containers": [router, proxy], "serviceAccountName": ROUTER,
           # The router's discovery reads pods through the API: it keeps its token.
           "automountServiceAccountToken": True,
           "securityContext": {"runAsNonRoot": True,
                               "seccompProfile": {"type": "RuntimeDefault"}},
           # Streams may last the router's request timeout: SIGKILL only after that.
           "terminationGracePeriodSeconds": router_grace(),
           # Replicas on different nodes where possible (one node drain, one router).
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
        # Router pods are cheap: a new one is ready before an old one stops.
        _deployment(ROUTER, labels, n, pod,
                    {"k3rocm.org/note": "router for the rendered servers; only the proxy's "
                     "data paths are reachable"}, _scrape(s.router_metrics_port), surge=1),
        # One router always up through drains and evictions (with one replica a budget of
        # one would block every node drain: none then).
        *([_pdb(ROUTER, labels, minAvailable=1)] if n >= 2 else []),
        # A stateful policy keeps its state per router: keep a client on one router.
        _service(ROUTER, labels, s.router_port,
                 **({} if s.router_policy in STATELESS_POLICIES or n == 1 else
                    {"sessionAffinity": "ClientIP"})),
    ]


def router_grace() -> int:
    """A router pod's terminationGracePeriodSeconds: preStop, the longest request, margin."""
    return ROUTER_PRESTOP_S + ROUTER_REQUEST_TIMEOUT_S + STOP_MARGIN_S


def render_k8s(plan: Plan, settings: Settings) -> list[dict[str, Any]]:
    """Kubernetes objects for ``plan`` (a list of dicts, in apply order)."""
    s = plan.scale
    image = check_image_ref("K3_IMAGE", settings.image)
    startup = max(s.router_startup_timeout, 600)
    node = plan.nodes[0]
    port = int(node.env_overrides["K3_PORT"])
    labels = {LABEL_KEY: APP}
    pod = _server_pod(node, plan, settings, image, startup)
    # maxSurge 0: one pod at a time in place, no spare 8-GPU node. A new pod exists only
    # after the old one's grace period, then pulls and starts: `kubectl rollout status`
    # must wait that long before it calls the rollout failed.
    deadline = server_grace(node) + PULL_ALLOWANCE_S + startup
    return [_network_policy(APP, labels, [
                {"from": [{"podSelector": {"matchLabels": {LABEL_KEY: ROUTER}}},
                          *_scraper(s)], "ports": _tcp(port)}]),
            _deployment(APP, labels, len(plan.nodes), pod,
                        {**_annotations(node), "k3rocm.org/pod-security": s.pod_security},
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
