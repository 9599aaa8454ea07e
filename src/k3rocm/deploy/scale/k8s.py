"""Kubernetes rendering of the scale-out modes (``make render-k8s``): NOT validated on MI355X.

* ``replicas``: a Deployment of N unchanged servers (``amd.com/gpu: 8`` each), a Service, and the
  router (vllm-router) as a Deployment + Service that finds the servers by label
  (``--service-discovery``; it needs the Role that lets it list pods, rendered too).
* ``dp-ep``: a LeaderWorkerSet (leaderworkerset.x-k8s.io/v1; a CRD that must be installed): the
  leader is the DP head, each worker runs ``--headless`` with its start rank from
  ``LWS_WORKER_INDEX``.
* ``pd``: two Deployments (prefill, decode) with the MoRIIO connector and the router in P/D mode.

The server containers run the same image and entrypoint as compose, with the resolved K3_*
settings as environment (the entrypoint renders the same argv as on a compose node: see the
``k3rocm.org/argv`` annotation) and the scale additions as arguments.
Every object is checked against the Kubernetes JSON schemas with ``kubernetes-validate``
(bundled schemas, offline); the LeaderWorkerSet is a CRD, so only its pod templates are checked.
"""

from __future__ import annotations

import json
from typing import Any

from k3rocm.deploy.scale.render import NOT_VALIDATED, NodePlan, Plan
from k3rocm.errors import UsageError
from k3rocm.serving.config import ENV_NAME, SECRET_KEYS, Settings

K8S_VERSION = "1.33.0"  # schema version the renderings are checked against
APP = "k3rocm-server"
LABEL_KEY = "app.kubernetes.io/name"
SHM_SIZE = "64Gi"


def _settings_env(settings: Settings, port: int) -> list[dict[str, Any]]:
    """The resolved K3_* settings as container env (secrets from a Secret, never inline)."""
    out: list[dict[str, Any]] = []
    for name, env_name in ENV_NAME.items():
        value = getattr(settings, name)
        if env_name in SECRET_KEYS:
            if value:
                out.append({"name": env_name, "valueFrom": {"secretKeyRef": {
                    "name": "k3rocm-secrets", "key": env_name, "optional": False}}})
            continue
        if name == "port":
            value = port
        if value is None or value == "":
            continue
        if isinstance(value, bool):
            value = "1" if value else "0"
        out.append({"name": env_name, "value": str(value)})
    out.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": "k3rocm-secrets", "key": "HF_TOKEN", "optional": True}}})
    return out


def _container(plan: Plan, node: NodePlan, settings: Settings, startup_s: int,
               extra_env: list[dict[str, Any]] | None = None,
               args: list[str] | None = None, command: list[str] | None = None
               ) -> dict[str, Any]:
    port = int(node.env_overrides.get("K3_PORT", settings.port))
    env = _settings_env(settings, port)
    env += [{"name": k, "value": v} for k, v in node.env_overrides.items()
            if not k.startswith("K3_") and k != "VLLM_HOST_IP"]
    if node.host_network:
        env.append({"name": "VLLM_HOST_IP", "valueFrom": {"fieldRef": {
            "fieldPath": "status.podIP"}}})
    env += extra_env or []
    period = 10
    c: dict[str, Any] = {
        "name": "server", "image": settings.image, "imagePullPolicy": "IfNotPresent",
        "env": env,
        "ports": [{"name": "http", "containerPort": port}],
        "resources": {"limits": {"amd.com/gpu": 8}, "requests": {"amd.com/gpu": 8}},
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"},
                         {"name": "models", "mountPath": "/models", "readOnly": True},
                         {"name": "cache", "mountPath": "/cache"}],
        "securityContext": {"capabilities": {"add": ["SYS_PTRACE", "IPC_LOCK"]},
                            "seccompProfile": {"type": "Unconfined"}},
        # A 1.5 TB load and kernel compilation: give /health up to startup_s to answer.
        "startupProbe": {"httpGet": {"path": "/health", "port": port},
                         "periodSeconds": period, "timeoutSeconds": 5,
                         "failureThreshold": max(1, startup_s // period)},
        "readinessProbe": {"httpGet": {"path": "/health", "port": port},
                           "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {"httpGet": {"path": "/health", "port": port},
                          "periodSeconds": 30, "timeoutSeconds": 10, "failureThreshold": 5},
    }
    if command is not None:
        c["command"] = command
    if args:
        c["args"] = args
    elif node.command and command is None:
        c["args"] = list(node.command)
    if node.host_network:
        c["volumeMounts"].append({"name": "infiniband", "mountPath": "/dev/infiniband"})
        c["securityContext"]["privileged"] = True  # RDMA devices (memlock: IPC_LOCK)
    return c


def _pod_spec(containers: list[dict[str, Any]], host_network: bool,
              sa: str | None = None) -> dict[str, Any]:
    vols: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}},
        {"name": "models", "persistentVolumeClaim": {"claimName": "k3rocm-models",
                                                     "readOnly": True}},
        {"name": "cache", "persistentVolumeClaim": {"claimName": "k3rocm-cache"}},
    ]
    if host_network:
        vols.append({"name": "infiniband", "hostPath": {"path": "/dev/infiniband"}})
    spec: dict[str, Any] = {"containers": containers, "volumes": vols,
                            "terminationGracePeriodSeconds": 60}
    if host_network:
        spec["hostNetwork"] = True
        spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    if sa:
        spec["serviceAccountName"] = sa
    return spec


def _meta(name: str, labels: dict[str, str], annotations: dict[str, str] | None = None
          ) -> dict[str, Any]:
    m: dict[str, Any] = {"name": name, "labels": labels}
    if annotations:
        m["annotations"] = annotations
    return m


def _annotations(node: NodePlan, experimental: bool) -> dict[str, str]:
    return {"k3rocm.org/note": NOT_VALIDATED if experimental else
            "replicas: the unchanged single-node server; manifests not validated on MI355X",
            "k3rocm.org/argv": json.dumps(node.argv)}


def _deployment(name: str, labels: dict[str, str], replicas: int, pod: dict[str, Any],
                annotations: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": _meta(name, labels, annotations),
            "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels}, "spec": pod}}}


def _service(name: str, labels: dict[str, str], port: int) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(name, labels),
            "spec": {"selector": labels, "ports": [{"name": "http", "port": port,
                                                    "targetPort": port}]}}


def _router(plan: Plan, selector: list[str], extra: list[str]) -> list[dict[str, Any]]:
    s = plan.scale
    labels = {LABEL_KEY: "k3rocm-router"}
    args = ["--host", "0.0.0.0", "--port", str(s.router_port), "--policy", s.router_policy,
            "--worker-startup-timeout-secs", str(s.router_startup_timeout),
            "--health-check-interval-secs", str(s.health_interval),
            "--health-failure-threshold", str(s.health_threshold),
            "--service-discovery", "--service-discovery-port",
            str(plan.nodes[0].env_overrides["K3_PORT"]), *selector, *extra]
    container = {"name": "router", "image": s.router_image, "imagePullPolicy": "IfNotPresent",
                 "args": args, "ports": [{"name": "http", "containerPort": s.router_port}],
                 "readinessProbe": {"httpGet": {"path": "/health", "port": s.router_port},
                                    "periodSeconds": 10}}
    rbac_labels = {LABEL_KEY: "k3rocm-router"}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": _meta("k3rocm-router", rbac_labels)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": _meta("k3rocm-router", rbac_labels),
         "rules": [{"apiGroups": [""], "resources": ["pods"],
                    "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": _meta("k3rocm-router", rbac_labels),
         "subjects": [{"kind": "ServiceAccount", "name": "k3rocm-router"}],
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                     "name": "k3rocm-router"}},
        _deployment("k3rocm-router", labels, 1,
                    {"containers": [container], "serviceAccountName": "k3rocm-router"},
                    {"k3rocm.org/note": "router for the rendered servers"}),
        _service("k3rocm-router", labels, s.router_port),
    ]


def render_k8s(plan: Plan, settings: Settings) -> list[dict[str, Any]]:
    """Kubernetes objects for ``plan`` (a list of dicts, in apply order)."""
    s = plan.scale
    startup = max(s.router_startup_timeout, 600)
    port = int(plan.nodes[0].env_overrides["K3_PORT"])
    if s.mode == "replicas":
        node = plan.nodes[0]
        labels = {LABEL_KEY: APP}
        pod = _pod_spec([_container(plan, node, settings, startup)], False)
        return [_deployment(APP, labels, len(plan.nodes), pod, _annotations(node, False)),
                _service(APP, labels, port),
                *_router(plan, ["--selector", f"{LABEL_KEY}={APP}"], [])]
    if s.mode == "pd":
        out: list[dict[str, Any]] = []
        for role in ("prefill", "decode"):
            members = [n for n in plan.nodes if n.role == role]
            labels = {LABEL_KEY: APP, "k3rocm.org/role": role}
            pod = _pod_spec([_container(plan, members[0], settings, startup)], True)
            out.append(_deployment(f"{APP}-{role}", labels, len(members), pod,
                                   _annotations(members[0], True)))
        out += _router(plan, ["--prefill-selector", "k3rocm.org/role=prefill",
                              "--decode-selector", "k3rocm.org/role=decode"],
                       ["--vllm-pd-disaggregation", "--kv-connector", "moriio"])
        return out
    if s.mode == "dp-ep":
        head, worker = plan.nodes[0], plan.nodes[1]
        # The head address and each worker's start rank are only known at run time in
        # Kubernetes: substitute them in the rendered flags (same flags, same order).
        head_args = _swap(head.command, "--data-parallel-address", "$(LWS_LEADER_ADDRESS)")
        worker_args = _swap(worker.command, "--data-parallel-address", "$(LWS_LEADER_ADDRESS)")
        worker_args = _swap(worker_args, "--data-parallel-start-rank",
                            f"$((LWS_WORKER_INDEX * {s.dp_local}))")
        shell = ["/bin/sh", "-c"]
        worker_cmd = "exec /opt/k3rocm/entrypoint.sh " + " ".join(
            a if a.startswith("$") else _sh_quote(a) for a in worker_args)
        labels = {LABEL_KEY: APP}
        leader = _pod_spec([_container(plan, head, settings, startup, args=head_args)], True)
        workerpod = _pod_spec([_container(plan, worker, settings, startup, command=shell,
                                          args=[worker_cmd])], True)
        # Headless workers serve no API: no HTTP probes on them.
        for key in ("startupProbe", "readinessProbe", "livenessProbe", "ports"):
            workerpod["containers"][0].pop(key)
        lws = {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
               "metadata": _meta(APP, labels, _annotations(head, True)),
               "spec": {"replicas": 1, "leaderWorkerTemplate": {
                   "size": len(plan.nodes), "restartPolicy": "RecreateGroupOnPodRestart",
                   "leaderTemplate": {"metadata": {"labels": {**labels, "role": "leader"}},
                                      "spec": leader},
                   "workerTemplate": {"metadata": {"labels": {**labels, "role": "worker"}},
                                      "spec": workerpod}}}}
        svc = _service(APP, {**labels, "role": "leader"}, port)
        return [lws, svc]
    raise UsageError(f"K3_SCALE_MODE={s.mode}: nothing to render for Kubernetes")


def _swap(args: list[str], flag: str, value: str) -> list[str]:
    out = list(args)
    out[out.index(flag) + 1] = value
    return out


def _sh_quote(a: str) -> str:
    import shlex

    return shlex.quote(a)


def validate(objs: list[dict[str, Any]], version: str = K8S_VERSION) -> list[str]:
    """Check every object against the Kubernetes schemas; return one line per object."""
    try:
        import kubernetes_validate
    except ImportError:
        raise UsageError("kubernetes-validate is not installed: `make venv` (host extras)"
                         ) from None
    lines = []
    for obj in objs:
        targets = [obj]
        what = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] == "LeaderWorkerSet":  # a CRD: check its pod templates as Pods
            tpl = obj["spec"]["leaderWorkerTemplate"]
            targets = [{"apiVersion": "v1", "kind": "Pod",
                        "metadata": {**tpl[k]["metadata"], "name": f"{obj['metadata']['name']}"
                                     f"-{k.removesuffix('Template')}"},
                        "spec": tpl[k]["spec"]} for k in ("leaderTemplate", "workerTemplate")]
            what += " (CRD: pod templates checked as Pods)"
        try:
            for t in targets:
                kubernetes_validate.validate(t, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise UsageError(f"{what} fails the Kubernetes {version} schema: "
                             f"{exc.message} at {'/'.join(map(str, exc.path))}") from None
        lines.append(f"ok  {what} (Kubernetes {version} schema)")
    return lines
