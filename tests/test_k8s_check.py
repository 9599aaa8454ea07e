"""make k8s-check (strict schemas, kubectl dry-run) and the node selection of preflight/status.
No API server runs here: a stand-in HTTP server proves the kubectl command line and its errors."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import sys
import threading

import pytest
from conftest import REPO, free_port, make_exit_code, need, run_cli

from k3rocm.deploy.scale import k8s
from k3rocm.deploy.scale import k8scheck as kc
from k3rocm.deploy.scale.render import plan
from k3rocm.serving import config

DIGEST = "@sha256:" + "ab" * 32
IMAGES = {"K3_IMAGE": "registry.example.com/k3rocm/server:0.1" + DIGEST,
          "K3_SCALE_ROUTER_IMAGE": "registry.example.com/k3rocm/router:0.1.17" + DIGEST,
          "K3_SCALE_PROXY_IMAGE": "registry.example.com/nginx-unprivileged:1.27" + DIGEST}
REPLICAS = {"K3_SCALE_MODE": "replicas", "K3_SCALE_NODES": "10.0.0.1:8000,10.0.0.2:8000",
            **IMAGES}


def _render(env):
    settings = config.load_settings(env, dotenv=None, check_model=False)[0]
    return k8s.render_k8s(plan(env, dotenv=None), settings)


# --- strict schemas -------------------------------------------------------------------------

def test_schema_check_covers_1_29_to_1_37_and_can_fail():
    objs = _render(REPLICAS)
    lines, failed = kc.schema_lines(objs)
    assert not failed and "1.29, 1.30" in lines[0] and lines[0].endswith("1.37")
    server = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == k8s.APP)
    server["spec"]["template"]["spec"]["containers"][0]["bogus"] = True
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
                       env=_env(tmp_path, REPLICAS))
    assert make_exit_code(p) == 0, p.stdout + p.stderr
    out = p.stdout
    assert "cluster: no kubeconfig (KUBECONFIG unset" in out and "offline checks only" in out
    assert "against the strict schemas of Kubernetes 1.29" in out
    assert out.strip().splitlines()[-1] == "k8s-check: ok"


def test_k8s_check_bad_settings_exit_2(tmp_path):
    r = run_cli("scale", "--env-file", "/dev/null", "k8s-check",
                env={**REPLICAS, "K3_IMAGE": "k3rocm/server:latest"})
    assert r.returncode == 2 and "not an image a cluster can pull" in r.stderr
    assert "Traceback" not in r.stderr


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
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self):
            seen.append((self.command, self.path, self.headers.get("User-Agent", "")))
            body = DISCOVERY.get(self.path.split("?")[0])
            code = 200 if body is not None else 403
            body = body or {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                            "reason": "Forbidden", "code": 403,
                            "message": "stand-in API server: not a real cluster"}
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PATCH = do_PUT = _answer

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], seen
    server.shutdown()
    server.server_close()


def test_kubectl_dry_run_against_the_kubeconfigs_server(tmp_path, standin_apiserver):
    need(shutil.which("kubectl") is not None, "kubectl is not on PATH")
    port, seen = standin_apiserver
    r = run_cli("scale", "--env-file", "/dev/null", "k8s-check", timeout=180,
                env=_env(tmp_path, REPLICAS, _kubeconfig(tmp_path, port)))
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
                env=_env(tmp_path, REPLICAS, _kubeconfig(tmp_path, free_port())))
    assert r.returncode == 3, r.stdout + r.stderr
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1
    assert "does not answer" in r.stderr and "refused" in r.stderr


# --- node selection: make preflight / make status -------------------------------------------

def test_node_matching_reads_the_rendered_selector_and_affinity():
    server = kc.server_pod(_render(REPLICAS))
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
    env = _env(tmp_path, REPLICAS, _kubeconfig(tmp_path, port))
    s = plan(env, dotenv=None).scale
    status, found = kc.cluster_nodes(s, None, env)
    assert status == "ok", found
    assert found.startswith("2 of 4 nodes match")
    assert 'mi355x-a matches {"amd.com/gpu.device-id": "75a3"' in found
    assert "mi355x-b matches" in found and "AMD_Instinct_MI355X_OAM" in found
    assert "mi300x-c no" in found and "cpu-1 no" in found
    status, found = kc.cluster_nodes(s, None, _env(tmp_path, REPLICAS))
    assert status == "skip" and "no kubeconfig" in found


def test_preflight_and_status_say_skipped_without_a_kubeconfig(tmp_path):
    env = _env(tmp_path, {**REPLICAS, "K3_SCALE_NODES": f"127.0.0.1:{free_port()},"
                          f"127.0.0.1:{free_port()}",
                          "K3_SCALE_ROUTER_PORT": str(free_port())})
    r = run_cli("scale", "--env-file", "/dev/null", "status", env=env, timeout=120)
    assert "k8s nodes skip: skipped: no kubeconfig" in r.stdout, r.stdout + r.stderr
    r = run_cli("preflight", "--env-file", "/dev/null", "--json", timeout=120,
                env={**env, "DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"})
    line = next(c for c in json.loads(r.stdout) if c["name"] == "kubernetes nodes")
    assert line["status"] == "skip" and "no kubeconfig" in line["have"]
