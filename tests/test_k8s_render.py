"""Kubernetes rendering (``make render-k8s``): router HA, scheduling on AMD's node labels,
NetworkPolicies, Pod Security variants, rollout deadlines (no cluster)."""

from __future__ import annotations

import pytest
from conftest import run_cli
from test_scale_unit import TWO_K8S, _obj, _render, _router_pod, _server_pod

from k3rocm.deploy.scale import k8s
from k3rocm.errors import UsageError

FOUR_K8S = {**TWO_K8S, "K3_SCALE_NODES": ",".join(f"10.0.0.{i}:8000" for i in range(1, 5))}
VARIANTS = ("privileged", "baseline", "restricted")


def _c(pod, name):
    return next(c for c in pod["containers"] if c["name"] == name)


@pytest.mark.parametrize("env", [
    TWO_K8S, FOUR_K8S,
    *({**TWO_K8S, "K3_SCALE_POD_SECURITY": v, "K3_SCALE_GPU_GROUPS": "44,110"}
      for v in VARIANTS[1:]),
    {**TWO_K8S, "K3_SCALE_ROUTER_REPLICAS": "1", "K3_SCALE_METRICS_NAMESPACE": "prom"}])
def test_every_rendering_passes_the_strict_schema(env):
    objs = _render(env)
    assert all(line.startswith("ok") for line in k8s.validate(objs))


def test_router_replicas_rollout_budget_and_spread():
    objs = _render(TWO_K8S)
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


def test_router_stops_without_cutting_streams():
    pod = _router_pod(_render(TWO_K8S))
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
    assert f"proxy_read_timeout {timeout}s" in _obj(_render(TWO_K8S), "ConfigMap")["data"][
        "nginx.conf"]


def test_router_liveness_reaches_the_router_itself():
    pod = _router_pod(_render(TWO_K8S))
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


def test_default_node_affinity_matches_amd_labeller_labels():
    pod = _server_pod(_render(TWO_K8S))
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


def test_network_policies_admit_the_router_and_the_scraper_only():
    objs = _render(TWO_K8S)
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
    with pytest.raises(UsageError, match="K3_SCALE_METRICS_NAMESPACE='Monitoring' is not valid"):
        _render({**TWO_K8S, "K3_SCALE_METRICS_NAMESPACE": "Monitoring"})
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
    with pytest.raises(UsageError, match="K3_SCALE_GPU_GROUPS='video' is not valid: give "
                       "numeric group ids"):
        _server("restricted", K3_SCALE_GPU_GROUPS="video")


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


def test_rollout_deadline_covers_grace_pull_and_startup():
    objs = _render({**TWO_K8S, "K3_SCALE_DRAIN_TIMEOUT": "900"})
    dep = _obj(objs, "Deployment", k8s.APP)
    pod = dep["spec"]["template"]["spec"]
    probe = pod["containers"][0]["startupProbe"]
    startup = probe["periodSeconds"] * probe["failureThreshold"]
    assert startup >= 7200
    # Kubernetes' default 600 s made `kubectl rollout status` fail on a healthy rollout.
    assert dep["spec"]["progressDeadlineSeconds"] > startup + pod[
        "terminationGracePeriodSeconds"]


def test_scale_config_prints_the_new_settings():
    r = run_cli("scale", "config", env={**TWO_K8S, "K3_SCALE_GPU_GROUPS": "44,110",
                                        "K3_SCALE_POD_SECURITY": "restricted"})
    assert r.returncode == 0, r.stderr
    assert "K3_SCALE_GPU_GROUPS=44,110" in r.stdout.splitlines()
    assert "K3_SCALE_POD_SECURITY=restricted" in r.stdout.splitlines()
    assert "K3_SCALE_ROUTER_REPLICAS=2" in r.stdout.splitlines()


def test_proxy_with_real_nginx_forwards_only_data_paths_and_stops_gracefully(tmp_path):
    """The rendered proxy config in a real nginx before a stub upstream: only /v1/* and the
    health paths pass (metrics port: /metrics only); the rendered preStop stops accepting,
    lets a held stream finish and returns once nginx has exited."""
    import http.server
    import shutil
    import socket
    import subprocess
    import threading
    import time

    import requests
    from conftest import free_port, need

    nginx = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")
    need(nginx is not None, "nginx is not installed (apt-get install nginx-light)")
    release, held, seen = threading.Event(), threading.Event(), []

    class Upstream(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            seen.append(self.path)
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path != "/v1/completions":
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", "32")
            self.end_headers()
            self.wfile.write(b"data: first\n\n")  # 13 bytes
            self.wfile.flush()
            held.set()
            release.wait(60)
            self.wfile.write(b"data: [DONE]\n\n\n\n\n\n\n")  # 19 bytes

        do_POST = do_GET

        def log_message(self, *a):
            pass

    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    upstream.daemon_threads = True
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    up = upstream.server_address[1]
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
        assert not any("worker" in p or "flush" in p for p in seen), seen

        resp = requests.post(f"{url}/v1/completions", json={}, stream=True, timeout=60)
        body = resp.raw.read(13)
        assert body == b"data: first\n\n" and held.wait(30)
        stop = subprocess.Popen([hook[0], hook[1], hook[2].replace("nginx ", f"{nginx} ", 1)])

        def refused():
            try:
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
                return False
            except OSError:
                return True

        while not refused():  # nginx has begun its graceful quit
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
        upstream.shutdown()
    assert body.startswith(b"data: first\n\ndata: [DONE]")
