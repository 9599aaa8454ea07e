"""Kubernetes (``make render-k8s``, ``make k8s-check``; no cluster): the rendered objects (server
Deployment, drain, router HA, scheduling on AMD's node labels, NetworkPolicies, Pod Security
variants, rollout deadlines), the proxy config in a real nginx, the strict schemas and kubectl
against a stand-in API server, and the node selection of preflight/status."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
from conftest import REPO, free_port, make_exit_code, need, run_cli
from fake_vllm import RouteServer
from test_scale_unit import cli  # noqa: F401 - k3rocm in-process

from k3rocm.deploy.scale import k8s
from k3rocm.deploy.scale import k8scheck as kc
from k3rocm.deploy.scale.render import plan
from k3rocm.errors import UsageError
from k3rocm.serving import config

DIGEST = "@sha256:" + "ab" * 32
IMAGES = {"K3_IMAGE": "registry.example.com/k3rocm/server:0.1" + DIGEST,
          "K3_SCALE_ROUTER_IMAGE": "registry.example.com/k3rocm/router:0.1.17" + DIGEST,
          "K3_SCALE_PROXY_IMAGE": "registry.example.com/nginx-unprivileged:1.27" + DIGEST}
TWO_K8S = {"K3_SCALE_MODE": "replicas", "K3_SCALE_NODES": "10.0.0.1:8000,10.0.0.2:8000",
           **IMAGES}


def _render(env):
    settings = config.load_settings(env, dotenv=None, check_model=False)[0]
    return k8s.render_k8s(plan(env, dotenv=None), settings)


@pytest.fixture(scope="module")
def objs():
    """TWO_K8S rendered once; read it only (a test that changes objects renders its own)."""
    return _render(TWO_K8S)


def _obj(objs, kind, name=None):
    return next(o for o in objs if o["kind"] == kind and name in (None, o["metadata"]["name"]))


def _router_pod(objs):
    return _obj(objs, "Deployment", k8s.ROUTER)["spec"]["template"]["spec"]


def _server_pod(objs):
    return _obj(objs, "Deployment", k8s.APP)["spec"]["template"]["spec"]


def _c(pod, name):
    return next(c for c in pod["containers"] if c["name"] == name)


def test_k8s_replicas_sized(objs):
    dep = _obj(objs, "Deployment", k8s.APP)
    assert dep["spec"]["replicas"] == 2
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"]["amd.com/gpu"] == 8
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["K3_TP"] == "8" and env["K3_MTP_K"] == "2"
    assert json.loads(dep["metadata"]["annotations"]["k3rocm.org/argv"]) == plan(
        TWO_K8S, dotenv=None).nodes[0].argv


@pytest.mark.parametrize("key, value", [
    ("K3_IMAGE", "k3rocm/server:latest"),  # the compose tag: no registry, no digest
    ("K3_IMAGE", "registry.example.com/k3rocm/server:latest"),  # a tag moves: no digest
    ("K3_SCALE_ROUTER_IMAGE", "k3rocm/router:0.1.17"),
    ("K3_SCALE_ROUTER_IMAGE", "k3rocm/router" + DIGEST),  # Docker Hub user, not a registry
    ("K3_SCALE_PROXY_IMAGE", ""),
])
def test_k8s_refuses_images_a_node_cannot_pull(key, value):
    with pytest.raises(UsageError) as exc:
        _render({**TWO_K8S, key: value})
    msg = str(exc.value)
    assert msg.startswith(f"{key}={value!r} is not an image a cluster can pull") and \
        "\n" not in msg


def test_k8s_router_admin_endpoints_not_exposed(objs):
    pod = _router_pod(objs)
    proxy, a = _c(pod, "proxy"), _c(pod, "router")["args"]
    # The Service reaches only the proxy's port; the router's port is no container port.
    svc = _obj(objs, "Service", k8s.ROUTER)
    target = svc["spec"]["ports"][0]["targetPort"]
    # The proxy's ports: the data port (the Service's) and the metrics-only port.
    assert [p["containerPort"] for p in proxy["ports"]] == [target, 29000]
    port = int(a[a.index("--port") + 1])
    assert all(p["containerPort"] != port for c in pod["containers"] for p in c.get("ports", []))
    conf = _obj(objs, "ConfigMap")["data"]["nginx.conf"]
    assert conf == k8s.proxy_conf(str(target), port, metrics_listen="29000",
                                  metrics_port=int(a[a.index("--prometheus-port") + 1]))


def test_k8s_router_rbac_and_namespace_agree(objs):
    role = _obj(objs, "Role", k8s.ROUTER)  # namespaced: the pods of its own namespace only
    assert not any(o["kind"].startswith("Cluster") for o in objs)
    assert all("namespace" not in o["metadata"] for o in objs)  # one namespace: kubectl -n
    assert {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]} in \
        role["rules"]
    binding = _obj(objs, "RoleBinding", k8s.ROUTER)
    pod = _router_pod(objs)
    assert binding["subjects"][0]["name"] == pod["serviceAccountName"]
    router = pod["containers"][0]
    a = router["args"]
    # Without --service-discovery-namespace the router watches ALL namespaces (its --help).
    assert a[a.index("--service-discovery-namespace") + 1] == "$(POD_NAMESPACE)"
    assert {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.namespace"}}} in router["env"]
    assert a[a.index("--selector") + 1] == f"{k8s.LABEL_KEY}={k8s.APP}"
    assert _obj(objs, "Deployment", k8s.APP)["spec"]["selector"]["matchLabels"] == {
        k8s.LABEL_KEY: k8s.APP}


FOUR_K8S = {**TWO_K8S, "K3_SCALE_NODES": ",".join(f"10.0.0.{i}:8000" for i in range(1, 5))}
VARIANTS = ("privileged", "baseline", "restricted")


@pytest.mark.parametrize("env", [  # TWO_K8S: test_make_k8s_check_offline
    FOUR_K8S,
    *({**TWO_K8S, "K3_SCALE_POD_SECURITY": v, "K3_SCALE_GPU_GROUPS": "44,110"}
      for v in VARIANTS[1:]),
    {**TWO_K8S, "K3_SCALE_ROUTER_REPLICAS": "1", "K3_SCALE_METRICS_NAMESPACE": "prom"}])
def test_every_rendering_passes_the_strict_schema(env):
    objs = _render(env)
    assert all(line.startswith("ok") for line in k8s.validate(objs))


def test_router_replicas_rollout_budget_and_spread(objs):
    dep = _obj(objs, "Deployment", k8s.ROUTER)
    assert dep["spec"]["replicas"] == 2  # K3_SCALE_ROUTER_REPLICAS default
    # A new router pod is up before an old one goes: never zero endpoints in a rollout.
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    pdb = _obj(objs, "PodDisruptionBudget", k8s.ROUTER)
    assert pdb["spec"] == {"minAvailable": 1, "selector": dep["spec"]["selector"]}
    anti = _router_pod(objs)["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert anti["labelSelector"]["matchLabels"] == dep["spec"]["template"]["metadata"]["labels"]
    # one router replica: no budget (it would block every node drain)
    objs = _render({**TWO_K8S, "K3_SCALE_ROUTER_REPLICAS": "1"})
    assert [o["metadata"]["name"] for o in objs if o["kind"] == "PodDisruptionBudget"] == [
        k8s.APP]


def test_router_stops_without_cutting_streams(objs):
    pod = _router_pod(objs)
    router, proxy = _c(pod, "router"), _c(pod, "proxy")
    a = router["args"]
    timeout = int(a[a.index("--request-timeout-secs") + 1])
    proxy_hook = proxy["lifecycle"]["preStop"]["exec"]["command"][-1]
    router_sleep = int(router["lifecycle"]["preStop"]["exec"]["command"][-1])
    proxy_sleep = int(proxy_hook.split(";")[0].split()[-1])
    # nginx quits gracefully (its SIGTERM is a fast shutdown) and the hook waits for it.
    assert "-s quit" in proxy_hook and "nginx.pid" in proxy_hook
    # The router (listener closed at SIGTERM) goes after nginx stopped accepting.
    assert router_sleep > proxy_sleep > 0
    # SIGKILL only after the longest request the router allows.
    assert pod["terminationGracePeriodSeconds"] >= router_sleep + timeout
    assert f"proxy_read_timeout {timeout}s" in _obj(objs, "ConfigMap")["data"][
        "nginx.conf"]


def test_router_liveness_reaches_the_router_itself(objs):
    pod = _router_pod(objs)
    router = _c(pod, "router")
    a = router["args"]
    cmd = router["livenessProbe"]["exec"]["command"]
    # The router listens on the pod's loopback: an httpGet from the kubelet cannot reach it.
    assert a[a.index("--host") + 1] == "127.0.0.1"
    assert cmd[0] == "/opt/router/bin/python3"  # the router image's venv (docker/router)
    assert f"http://127.0.0.1:{a[a.index('--port') + 1]}/liveness" in cmd[-1]
    assert "httpGet" not in router["livenessProbe"]
    # /health is 503 as soon as one of N workers is down: readiness asks /readiness
    assert _c(pod, "proxy")["readinessProbe"]["httpGet"]["path"] == "/readiness"


def test_default_node_affinity_matches_amd_labeller_labels(objs):
    pod = _server_pod(objs)
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    # Any term may match: the device id (the labeller writes it without 0x) or a product name.
    assert terms == [
        {"matchExpressions": [{"key": "amd.com/gpu.device-id", "operator": "In",
                               "values": ["75a3"]}]},
        {"matchExpressions": [{"key": "amd.com/gpu.product-name", "operator": "In",
                               "values": ["AMD_Instinct_MI355X", "AMD_Instinct_MI355X_OAM"]}]}]
    assert "nodeSelector" not in pod


def test_node_selector_alternatives_and_bad_values():
    pod = _server_pod(_render({**TWO_K8S, "K3_SCALE_NODE_SELECTOR":
                               "amd.com/gpu.device-id=75a3|75b3,pool=llm;gpu=mi355x"}))
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert [[(e["key"], e["values"]) for e in t["matchExpressions"]] for t in terms] == [
        [("amd.com/gpu.device-id", ["75a3", "75b3"]), ("pool", ["llm"])],
        [("gpu", ["mi355x"])]]
    for bad in ("amd.com/gpu.product-name=AMD Instinct MI355X", "=x", "a/b/c=1"):
        with pytest.raises(UsageError, match="is not key=value"):
            _render({**TWO_K8S, "K3_SCALE_NODE_SELECTOR": bad})


def test_network_policies_admit_the_router_and_the_scraper_only(objs):
    server_labels = _obj(objs, "Deployment", k8s.APP)["spec"]["template"]["metadata"]["labels"]
    router_labels = _obj(objs, "Deployment", k8s.ROUTER)["spec"]["template"]["metadata"][
        "labels"]
    scraper = {"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}
    srv = _obj(objs, "NetworkPolicy", k8s.APP)["spec"]
    assert srv["podSelector"]["matchLabels"] == server_labels
    assert srv["policyTypes"] == ["Ingress"]
    assert srv["ingress"] == [{"from": [{"podSelector": {"matchLabels": router_labels}},
                                        scraper],
                               "ports": [{"protocol": "TCP", "port": 8000}]}]
    rtr = _obj(objs, "NetworkPolicy", k8s.ROUTER)["spec"]
    assert rtr["podSelector"]["matchLabels"] == router_labels
    # The data port from anywhere (clients), the metrics port from the scraper only.
    assert rtr["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8080}]},
                              {"from": [scraper], "ports": [{"protocol": "TCP", "port": 29000}]}]
    # Applied before the pods they protect.
    kinds = [o["kind"] for o in objs]
    assert kinds.index("NetworkPolicy") < kinds.index("Deployment")


def test_scraper_namespace_and_metrics_port_follow_the_settings():
    objs = _render({**TWO_K8S, "K3_SCALE_METRICS_NAMESPACE": "prom",
                    "K3_SCALE_ROUTER_METRICS_PORT": "29100"})
    scraper = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "prom"}}}]
    assert _obj(objs, "NetworkPolicy", k8s.ROUTER)["spec"]["ingress"][1] == {
        "from": scraper, "ports": [{"protocol": "TCP", "port": 29100}]}
    assert _obj(objs, "NetworkPolicy", k8s.APP)["spec"]["ingress"][0]["from"][1:] == scraper
    # a token only where the API is called (the router's service discovery)
    assert _server_pod(objs)["automountServiceAccountToken"] is False
    assert _router_pod(objs)["automountServiceAccountToken"] is True


def _server(variant, **extra):
    env = {**TWO_K8S, "K3_SCALE_POD_SECURITY": variant, **extra}
    objs = _render(env)
    pod = _server_pod(objs)
    return pod, pod["containers"][0], {v["name"]: v for v in pod["volumes"]}, objs


def test_pod_security_privileged_is_the_compose_settings():
    pod, c, vols, objs = _server("privileged")
    assert c["securityContext"] == {"capabilities": {"add": ["SYS_PTRACE", "IPC_LOCK"]},
                                    "seccompProfile": {"type": "Unconfined"}}
    assert vols["models"]["hostPath"]["path"] == k8s.NODE_MODELS_DIR
    assert vols["cache"]["hostPath"]["path"] == k8s.NODE_CACHE_DIR
    assert _obj(objs, "Deployment", k8s.APP)["metadata"]["annotations"][
        "k3rocm.org/pod-security"] == "privileged"


def test_pod_security_baseline_no_host_paths_no_added_capabilities():
    pod, c, vols, _ = _server("baseline", K3_SCALE_MODELS_CLAIM="kimi-k3")
    assert not any("hostPath" in v for v in vols.values())
    assert c["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    assert vols["models"]["persistentVolumeClaim"] == {"claimName": "kimi-k3", "readOnly": True}
    assert next(m for m in c["volumeMounts"] if m["name"] == "models")["readOnly"] is True
    assert "emptyDir" in vols["cache"]
    assert "securityContext" not in pod and not pod.get("hostNetwork")


def test_pod_security_restricted_non_root_in_the_gpu_groups():
    pod, c, vols, _ = _server("restricted", K3_SCALE_GPU_GROUPS="44,110",
                              K3_SCALE_RUN_AS_USER="2000")
    assert c["securityContext"] == {
        "runAsNonRoot": True, "runAsUser": 2000, "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
    assert pod["securityContext"]["supplementalGroups"] == [44, 110]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert not any("hostPath" in v for v in vols.values())
    assert "supplementalGroups" not in _server("restricted")[0]["securityContext"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_router_and_proxy_are_restricted_in_every_variant(variant):
    pod = _router_pod(_server(variant)[3])
    assert pod["securityContext"] == {"runAsNonRoot": True,
                                      "seccompProfile": {"type": "RuntimeDefault"}}
    for c in pod["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["runAsNonRoot"] is True
        assert sc["capabilities"] == {"drop": ["ALL"]} and sc["runAsUser"] > 0
    assert {k for v in pod["volumes"] for k in v} == {"name", "configMap"}


def test_server_drain_prestop_pdb_and_rollout_deadline():
    objs = _render({**TWO_K8S, "K3_SCALE_DRAIN_TIMEOUT": "900"})
    dep = _obj(objs, "Deployment", k8s.APP)
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["args"][c["args"].index("--shutdown-timeout") + 1] == "900"
    sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    # SIGKILL only after preStop + the whole drain.
    assert pod["terminationGracePeriodSeconds"] >= sleep + 900
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    pdb = _obj(objs, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    probe = c["startupProbe"]
    startup = probe["periodSeconds"] * probe["failureThreshold"]
    assert startup >= 7200 and probe["httpGet"]["path"] == "/health"
    # Kubernetes' default 600 s made `kubectl rollout status` fail on a healthy rollout.
    assert dep["spec"]["progressDeadlineSeconds"] > startup + pod[
        "terminationGracePeriodSeconds"]


def test_scale_config_prints_the_new_settings(cli):  # noqa: F811
    rc, out, err = cli("scale", "config", env={**TWO_K8S, "K3_SCALE_GPU_GROUPS": "44,110",
                                               "K3_SCALE_POD_SECURITY": "restricted"})
    assert rc == 0, err
    assert "K3_SCALE_GPU_GROUPS=44,110" in out.splitlines()
    assert "K3_SCALE_POD_SECURITY=restricted" in out.splitlines()
    assert "K3_SCALE_ROUTER_REPLICAS=2" in out.splitlines()


def refuses(port: int) -> bool:
    """Nothing takes a new TCP connection on 127.0.0.1:``port`` (its listener is closed)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return False
    except OSError:
        return True


def test_proxy_with_real_nginx_forwards_only_data_paths_and_stops_gracefully(tmp_path):
    """The rendered proxy config in a real nginx before a stub upstream: only /v1/* and the
    health paths pass (metrics port: /metrics only); the rendered preStop stops accepting,
    lets a held stream finish and returns once nginx has exited."""
    import threading
    import time

    import requests

    nginx = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")
    need(nginx is not None, "nginx is not installed (apt-get install nginx-light)")
    release, held = threading.Event(), threading.Event()

    def stream(h):  # a first chunk, then held until released
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Content-Length", "32")
        h.end_headers()
        h.wfile.write(b"data: first\n\n")  # 13 bytes
        h.wfile.flush()
        held.set()
        release.wait(60)
        h.wfile.write(b"data: [DONE]\n\n\n\n\n\n\n")  # 19 bytes

    upstream = RouteServer({"/v1/completions": stream}, default=(200, "ok"))
    up = upstream.port
    port, mport = free_port(), free_port()
    conf = tmp_path / "nginx.conf"
    conf.write_text(k8s.proxy_conf(f"127.0.0.1:{port}", up, tmp=str(tmp_path),
                                   metrics_listen=f"127.0.0.1:{mport}", metrics_port=up))
    hook = k8s.proxy_stop_command(str(conf), sleep_s=0, tmp=str(tmp_path))
    proc = subprocess.Popen([nginx, "-g", "daemon off;", "-c", str(conf)],
                            stderr=subprocess.PIPE, text=True)
    url, stop = f"http://127.0.0.1:{port}", None
    try:
        t0 = time.monotonic()
        while not (tmp_path / "nginx.pid").exists():  # readiness poll
            assert proc.poll() is None and time.monotonic() - t0 < 30, "nginx did not start"
            time.sleep(0.05)
        codes = {p: requests.request(m, f"{url}{p}", timeout=5).status_code for m, p in [
            ("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/readiness"),
            ("GET", "/health"), ("POST", "/add_worker?url=http://evil:1"),
            ("POST", "/remove_worker?url=http://10.0.0.1:8000"), ("GET", "/list_workers"),
            ("POST", "/flush_cache"), ("GET", "/get_loads"), ("GET", "/metrics"),
            ("POST", "/v1/../add_worker?url=http://evil:1"),
            ("POST", "/v1/%2e%2e/add_worker?url=http://evil:1")]}
        assert [p for p, c in codes.items() if c == 200] == [
            "/v1/chat/completions", "/v1/models", "/readiness", "/health"], codes
        metrics = {p: requests.request(m, f"http://127.0.0.1:{mport}{p}", timeout=5).status_code
                   for m, p in [("GET", "/metrics"), ("GET", "/v1/models"),
                                ("POST", "/add_worker?url=http://e:1"), ("GET", "/liveness")]}
        assert [p for p, c in metrics.items() if c == 200] == ["/metrics"], metrics
        assert not any("worker" in p or "flush" in p for _, p, _ in upstream.seen), \
            upstream.seen

        resp = requests.post(f"{url}/v1/completions", json={}, stream=True, timeout=60,
                             headers={"Connection": "close"})
        body = resp.raw.read(13)
        assert body == b"data: first\n\n" and held.wait(30)
        stop = subprocess.Popen([hook[0], hook[1], hook[2].replace("nginx ", f"{nginx} ", 1)])
        while not refuses(port):  # nginx has begun its graceful quit
            assert time.monotonic() - t0 < 60, "nginx kept accepting after the hook's quit"
            time.sleep(0.05)
        assert stop.poll() is None  # the hook waits: the stream is still in flight
        release.set()
        body += resp.raw.read()
        assert stop.wait(timeout=30) == 0 and proc.wait(timeout=30) == 0
    finally:
        release.set()
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)
        if stop is not None and stop.poll() is None:
            stop.kill()
        upstream.stop()
    assert body.startswith(b"data: first\n\ndata: [DONE]")


# --- strict schemas -------------------------------------------------------------------------

def test_schema_check_can_fail():  # passes on every minor: test_make_k8s_check_offline
    objs = _render(TWO_K8S)
    _obj(objs, "Deployment", k8s.APP)["spec"]["template"]["spec"]["containers"][0]["bogus"] = True
    lines, failed = kc.schema_lines(objs)
    assert failed and sum(ln.startswith("FAIL Deployment/k3rocm-server") for ln in lines) == 9


# --- end to end: make k8s-check, kubectl --------------------------------------------------

def _env(tmp_path, extra=None, kubeconfig=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("K3_", "KUBECONFIG"))}
    env.update(HOME=str(tmp_path), PYTHONPATH=str(REPO / "src"), **(extra or {}))
    if kubeconfig:
        env["KUBECONFIG"] = str(kubeconfig)
    return env


def test_make_k8s_check_offline(tmp_path):
    p = subprocess.run(["make", "-s", "-o", sys.executable, "k8s-check", f"PY={sys.executable}"],
                       cwd=REPO, capture_output=True, text=True, timeout=180,
                       env=_env(tmp_path, TWO_K8S))
    assert make_exit_code(p) == 0, p.stdout + p.stderr
    out = p.stdout
    assert "cluster: no kubeconfig (KUBECONFIG unset" in out and "offline checks only" in out
    ok = next(ln for ln in out.splitlines() if "against the strict schemas" in ln)
    assert "Kubernetes 1.29, 1.30" in ok and ok.endswith("1.37"), out
    assert out.strip().splitlines()[-1] == "k8s-check: ok"


def test_k8s_check_bad_settings_exit_2(cli):  # noqa: F811
    rc, _, err = cli("scale", "k8s-check", env={**TWO_K8S, "K3_IMAGE": "k3rocm/server:latest"})
    assert rc == 2 and "not an image a cluster can pull" in err


def _kubeconfig(tmp_path, port):
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "users": [{"name": "u", "user": {"token": "t"}}]}))
    return path


NODES = {"kind": "NodeList", "apiVersion": "v1", "items": [
    {"metadata": {"name": "mi355x-a", "labels": {
        "amd.com/gpu.product-name": "AMD_Instinct_MI355X", "amd.com/gpu.device-id": "75a3"}}},
    {"metadata": {"name": "mi355x-b", "labels": {
        "amd.com/gpu.product-name": "AMD_Instinct_MI355X_OAM", "amd.com/gpu.device-id": "75a3"}}},
    {"metadata": {"name": "mi300x-c", "labels": {
        "amd.com/gpu.product-name": "AMD_Instinct_MI300X_OAM", "amd.com/gpu.device-id": "74a1"}}},
    {"metadata": {"name": "cpu-1", "labels": {"kubernetes.io/os": "linux"}}}]}
DISCOVERY = {
    "/api": {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []},
    "/apis": {"kind": "APIGroupList", "apiVersion": "v1", "groups": []},
    "/api/v1": {"kind": "APIResourceList", "groupVersion": "v1", "resources": [
        {"name": "nodes", "singularName": "node", "namespaced": False, "kind": "Node",
         "verbs": ["get", "list"]}]},
    "/api/v1/nodes": NODES,
    "/version": {"major": "1", "minor": "33", "gitVersion": "v1.33.0"},
}


@pytest.fixture
def standin_apiserver():
    """Answers /version, discovery and a NodeList; 403 Status for everything else; records
    every request (method, path, user agent)."""
    with RouteServer({path: (200, body) for path, body in DISCOVERY.items()}, default=(403, {
            "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden",
            "code": 403, "message": "stand-in API server: not a real cluster"})) as api:
        yield api.port, api.seen


def test_kubectl_dry_run_against_the_kubeconfigs_server(tmp_path, standin_apiserver):
    need(shutil.which("kubectl") is not None, "kubectl is not on PATH")
    port, seen = standin_apiserver
    r = run_cli("scale", "--env-file", "/dev/null", "k8s-check", timeout=180,
                env=_env(tmp_path, TWO_K8S, _kubeconfig(tmp_path, port)))
    # the stand-in refuses what a real server would check: a failed check, not a crash
    assert r.returncode == 1, r.stdout + r.stderr
    assert ("kubectl apply --dry-run=server --validate=strict --request-timeout=60s -f -"
            in r.stdout)
    assert "  FAIL " in r.stdout.split("cluster (KUBECONFIG=")[1]
    assert any(p.startswith("/version") for _, p, _ in seen)
    assert any(p.startswith("/openapi/") and "kubectl" in ua for _, p, ua in seen), seen
    assert "against the strict schemas of Kubernetes 1.29" in r.stdout  # offline ran too


def test_unreachable_cluster_is_one_line_exit_3(tmp_path):
    need(shutil.which("kubectl") is not None, "kubectl is not on PATH")
    r = run_cli("scale", "--env-file", "/dev/null", "k8s-check", timeout=120,
                env=_env(tmp_path, TWO_K8S, _kubeconfig(tmp_path, free_port())))
    assert r.returncode == 3, r.stdout + r.stderr
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1
    assert "does not answer" in r.stderr and "refused" in r.stderr


# --- node selection: make preflight / make status -------------------------------------------

def test_node_matching_reads_the_rendered_selector_and_affinity(objs):
    server = kc.server_pod(objs)
    a, b, mi300x, cpu = NODES["items"]
    # AMD's labeller names an OAM part with the suffix: the default selection takes both
    assert kc.node_matches(server, a) and kc.node_matches(server, b)
    assert not kc.node_matches(server, mi300x) and not kc.node_matches(server, cpu)
    spec = {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "amd.com/gpu.product-name", "operator": "In",
             "values": ["AMD_Instinct_MI355X", "AMD_Instinct_MI355X_OAM"]}]},
            {"matchExpressions": [{"key": "amd.com/gpu.device-id", "operator": "Exists"}]}]}}}}
    assert kc.node_matches(spec, a) and kc.node_matches(spec, b)
    assert not kc.node_matches(spec, cpu)


def test_cluster_nodes_lists_matches_and_gpu_labels(tmp_path, standin_apiserver):
    need(shutil.which("kubectl") is not None, "kubectl is not on PATH")
    port, _ = standin_apiserver
    env = _env(tmp_path, TWO_K8S, _kubeconfig(tmp_path, port))
    s = plan(env, dotenv=None).scale
    status, found = kc.cluster_nodes(s, None, env)
    assert status == "ok", found
    assert found.startswith("2 of 4 nodes match")
    assert 'mi355x-a matches {"amd.com/gpu.device-id": "75a3"' in found
    assert "mi355x-b matches" in found and "AMD_Instinct_MI355X_OAM" in found
    assert "mi300x-c no" in found and "cpu-1 no" in found


def test_preflight_and_status_say_skipped_without_a_kubeconfig(tmp_path, cli):  # noqa: F811
    env = {**TWO_K8S, "K3_SCALE_NODES": f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}",
           "K3_SCALE_ROUTER_PORT": str(free_port()), "HOME": str(tmp_path), "KUBECONFIG": None}
    _, out, err = cli("scale", "status", env=env)
    assert "k8s nodes skip: skipped: no kubeconfig" in out, out + err
    _, out, _ = cli("preflight", "--json",
                    env={**env, "DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"})
    line = next(c for c in json.loads(out) if c["name"] == "kubernetes nodes")
    assert line["status"] == "skip" and "no kubeconfig" in line["have"]
