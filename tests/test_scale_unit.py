"""Scale-out settings, per-node rendering, router argv, compose/K8s renderings (no servers)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from conftest import REPO, need, run_cli

from k3rocm.deploy.scale import k8s
from k3rocm.deploy.scale.render import compose_override, plan, router_argv
from k3rocm.deploy.scale.settings import SCALE_FIELD_BY_ENV, load_scale
from k3rocm.deploy.scale.status import parse_decisions, summarize_decisions, topology
from k3rocm.errors import UsageError
from k3rocm.serving import config

TWO = {"K3_SCALE_MODE": "replicas", "K3_SCALE_NODES": "10.0.0.1:8000,10.0.0.2:8000"}
DPEP = {"K3_SCALE_MODE": "dp-ep", "K3_SCALE_NODES": "10.0.0.1:8000,10.0.0.2:8000",
        "K3_SCALE_IFNAME": "eth0"}


def test_defaults_single():
    s = load_scale({}, dotenv=None)
    assert (s.mode, s.nodes, s.router_policy, s.router_startup_timeout) == \
        ("single", (), "round_robin", 7200)


def test_every_scale_variable_is_registered_in_config():
    # config.py's typo guard must know exactly the scale settings (no more, no fewer).
    assert set(config.SCALE_SETTINGS) == set(SCALE_FIELD_BY_ENV)
    config.load_settings({"K3_SCALE_MODE": "replicas"}, dotenv=None,
                         check_model=False)  # not flagged


@pytest.mark.parametrize("env, needle", [
    ({"K3_SCALE_MODE": "copies"}, "K3_SCALE_MODE='copies' is not valid: use one of single"),
    ({**TWO, "K3_SCALE_NODES": "10.0.0.1"}, "'10.0.0.1' is not host:port"),
    ({**TWO, "K3_SCALE_NODES": "a:1,a:1"}, "lists a node twice"),
    ({**TWO, "K3_SCALE_NODES": "a:1"}, "needs K3_SCALE_NODES with at least 2"),
    ({**TWO, "K3_SCALE_ROUTER_POLICY": "fastest"}, "use one of random, round_robin"),
    ({**TWO, "K3_SCALE_ROUTER_PORT": "0"}, "K3_SCALE_ROUTER_PORT='0' is not valid: use an "
     "integer >= 1"),
    ({**TWO, "K3_SCALE_HEALTH_THRESHOLD": "x"}, "K3_SCALE_HEALTH_THRESHOLD='x'"),
    ({**TWO, "K3_SCALE_ROUTER_STARTUP_TIMEOUT": "300"}, "shorter than "
     "VLLM_ENGINE_READY_TIMEOUT_S=600"),
    ({**TWO, "VLLM_ENGINE_READY_TIMEOUT_S": "9000"}, "K3_SCALE_ROUTER_STARTUP_TIMEOUT=7200 is "
     "shorter than VLLM_ENGINE_READY_TIMEOUT_S=9000"),
    ({**DPEP, "K3_SCALE_IFNAME": ""}, "needs K3_SCALE_IFNAME"),
    ({"K3_SCALE_NODS": "a:1"}, "K3_SCALE_NODS is not a known setting"),
])
def test_bad_scale_settings_one_line(env, needle):
    with pytest.raises(UsageError) as exc:
        load_scale(env, dotenv=None, tp=8)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_dotenv_is_read_and_environment_wins(tmp_path):
    dotenv = tmp_path / ".env"
    dotenv.write_text("K3_SCALE_MODE=replicas\nK3_SCALE_NODES=a:1,b:2\nK3_SCALE_ROUTER_PORT=9000\n")
    s = load_scale({"K3_SCALE_ROUTER_PORT": "9100"}, dotenv=dotenv)
    assert s.nodes == ("a:1", "b:2") and s.router_port == 9100


def test_cli_bad_value_exit_2_no_traceback():
    r = run_cli("scale", "render", env={"K3_SCALE_MODE": "replicas", "K3_SCALE_NODES": "x"})
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "K3_SCALE_NODES='x' is not valid" in r.stderr


def test_replicas_nodes_run_the_unchanged_server():
    p = plan(TWO, dotenv=None)
    single = config.render(TWO, dotenv=None, check_model=False)
    for node in p.nodes:
        assert node.role == "replica" and node.command == []
        # Same renderer, same settings: the argv of a single-node server (TP 8, MTP k=2).
        assert node.argv == single.argv and node.env == single.env
    assert node.argv[node.argv.index("--tensor-parallel-size") + 1] == "8"
    assert json.loads(node.argv[node.argv.index("--speculative-config") + 1])[
        "num_speculative_tokens"] == 2


def test_replicas_node_port_comes_from_nodes():
    p = plan({**TWO, "K3_SCALE_NODES": "10.0.0.1:8001,10.0.0.2:8002"}, dotenv=None)
    assert [n.argv[n.argv.index("--port") + 1] for n in p.nodes] == ["8001", "8002"]


def test_router_argv():
    s = load_scale({**TWO, "K3_SCALE_ROUTER_PORT": "9000", "K3_SCALE_HEALTH_INTERVAL": "2",
                    "K3_SCALE_HEALTH_THRESHOLD": "2"}, dotenv=None)
    assert router_argv(s) == [
        "vllm-router", "--host", "127.0.0.1", "--port", "9000", "--policy", "round_robin",
        "--worker-startup-timeout-secs", "7200", "--health-check-interval-secs", "2",
        "--health-failure-threshold", "2",
        "--worker-urls", "http://10.0.0.1:8000", "http://10.0.0.2:8000"]


def test_dp_ep_head_and_headless_workers():
    env = {**DPEP, "K3_TP": "4", "K3_SCALE_DP_LOCAL": "2", "K3_SCALE_IB_HCA": "rdma0,rdma1",
           "K3_SCALE_NODES": "10.0.0.1:8000,10.0.0.2:8000,10.0.0.3:8000"}
    head, w1, w2 = plan(env, dotenv=None).nodes
    for n, rank in ((w1, "2"), (w2, "4")):
        a = n.argv
        assert a[a.index("--data-parallel-start-rank") + 1] == rank and "--headless" in a
    a = head.argv
    assert "--headless" not in a and "--data-parallel-start-rank" not in a
    assert a[a.index("--data-parallel-size") + 1] == "6"
    assert a[a.index("--data-parallel-size-local") + 1] == "2"
    assert a[a.index("--data-parallel-address") + 1] == "10.0.0.1"
    assert a[a.index("--data-parallel-rpc-port") + 1] == "13345"
    assert a[a.index("--all2all-backend") + 1] == "mori_low_latency"
    assert "--enable-expert-parallel" in a
    assert a[a.index("--tensor-parallel-size") + 1] == "4"
    # The serving renderer's argv first, the scale additions after it.
    assert a[:len(a) - len(head.command)] == config.render({**env, "K3_PORT": "8000"},
                                                           dotenv=None, check_model=False).argv
    assert w2.env["GLOO_SOCKET_IFNAME"] == w2.env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert w2.env["NCCL_IB_HCA"] == "rdma0,rdma1" and w2.env["VLLM_HOST_IP"] == "10.0.0.3"
    assert w2.host_network and w2.devices == ["/dev/infiniband"] and w2.experimental
    with pytest.raises(UsageError, match="needs 16 GPUs per node"):
        plan({**env, "K3_SCALE_DP_LOCAL": "4"}, dotenv=None)


def test_pd_refused_with_speculative_decoding_then_rendered():
    env = {**DPEP, "K3_SCALE_MODE": "pd"}
    with pytest.raises(UsageError, match="K3_MTP_K=2"):
        plan(env, dotenv=None)
    p = plan({**env, "K3_MTP_K": "0"}, dotenv=None)
    roles = [json.loads(n.argv[n.argv.index("--kv-transfer-config") + 1]) for n in p.nodes]
    assert [r["kv_connector"] for r in roles] == ["MoRIIOConnector"] * 2
    assert [r["kv_role"] for r in roles] == ["kv_producer", "kv_consumer"]
    a = p.router_argv
    assert a[a.index("--prefill") + 1] == "http://10.0.0.1:8000"
    assert a[a.index("--decode") + 1] == "http://10.0.0.2:8000"
    assert "--vllm-pd-disaggregation" in a


def test_single_mode_has_nothing_to_render():
    with pytest.raises(UsageError, match="nothing to scale out"):
        plan({}, dotenv=None)


def test_compose_override_validates_with_docker_compose(tmp_path):
    need(shutil.which("docker") is not None, "no docker CLI")
    r = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
    need(r.returncode == 0, "docker compose v2 is not installed (.ci/install-compose.sh)")
    from k3rocm.deploy.scale.cli import _compose_yaml

    node = plan(DPEP, dotenv=None).nodes[1]
    f = tmp_path / "node1.yaml"
    f.write_text(_compose_yaml(compose_override(node)))
    r = subprocess.run(["docker", "compose", "-f", str(REPO / "compose.yaml"), "-f", str(f),
                        "config", "--format", "json"], capture_output=True, text=True,
                       cwd=REPO, env={"PATH": "/usr/bin:/bin:/usr/local/bin"})
    assert r.returncode == 0, r.stderr
    svc = json.loads(r.stdout)["services"]["server"]
    assert svc["network_mode"] == "host" and not svc.get("ports")
    assert svc["command"] == node.command
    assert any(d["source"] == "/dev/infiniband" if isinstance(d, dict) else
               d.startswith("/dev/infiniband") for d in svc["devices"])
    assert svc["environment"]["GLOO_SOCKET_IFNAME"] == "eth0"


def _settings(env):
    return config.load_settings(env, dotenv=None, check_model=False)[0]


def test_k8s_replicas_schema_valid_and_sized():
    p = plan(TWO, dotenv=None)
    objs = k8s.render_k8s(p, _settings(TWO))
    lines = k8s.validate(objs)
    assert len(lines) == len(objs) and all(ln.startswith("ok") for ln in lines)
    dep = next(o for o in objs if o["kind"] == "Deployment" and
               o["metadata"]["name"] == k8s.APP)
    assert dep["spec"]["replicas"] == 2
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"]["amd.com/gpu"] == 8
    probe = c["startupProbe"]
    assert probe["httpGet"]["path"] == "/health"
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 7200
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["K3_TP"] == "8" and env["K3_MTP_K"] == "2"
    assert json.loads(dep["metadata"]["annotations"]["k3rocm.org/argv"]) == p.nodes[0].argv


def test_k8s_schema_check_can_fail():
    objs = k8s.render_k8s(plan(TWO, dotenv=None), _settings(TWO))
    objs[0]["spec"]["replicas"] = "two"
    with pytest.raises(UsageError, match="fails the Kubernetes"):
        k8s.validate(objs)


def test_k8s_dp_ep_leaderworkerset():
    p = plan(DPEP, dotenv=None)
    objs = k8s.render_k8s(p, _settings(DPEP))
    assert all(ln.startswith("ok") for ln in k8s.validate(objs))
    lws = objs[0]
    assert lws["kind"] == "LeaderWorkerSet" and "not validated on MI355X" in \
        lws["metadata"]["annotations"]["k3rocm.org/note"]
    tpl = lws["spec"]["leaderWorkerTemplate"]
    assert tpl["size"] == 2
    worker = tpl["workerTemplate"]["spec"]["containers"][0]
    assert "--headless" in worker["args"][0] and "$(LWS_LEADER_ADDRESS)" in worker["args"][0]
    assert "$((LWS_WORKER_INDEX * 1))" in worker["args"][0]
    assert tpl["leaderTemplate"]["spec"]["hostNetwork"] is True


def test_cli_render_k8s_writes_banner(tmp_path):
    out = tmp_path / "k8s.yaml"
    r = run_cli("scale", "render-k8s", "--out", str(out), env=DPEP, timeout=120)
    assert r.returncode == 0, r.stderr
    assert out.read_text().startswith("# EXPERIMENTAL (dp-ep)")
    assert "NOT validated on MI355X" in out.read_text().splitlines()[0]


# Record shape from the overlay's decision interface (docs/overlay.md, DECISIONS.md):
# a vLLM log prefix, the marker, one JSON object; the last record per (pid, layer_kind) wins.
DECISION_LOG = "\n".join([
    '(EngineCore_DP0 pid=123) INFO 12-03 13:00:00 [mla.py:88] K3ROCM-DECISION '
    + json.dumps({"schema": "k3rocm.overlay.decision/1", "pid": 123, "layer_kind": "target",
                  "phase": "construct", "fusions": {
                      "qk_norm": {"state": "on", "reason": "x"},
                      "decode_qprep": {"state": "needs-model", "reason": "y"}}}),
    "unrelated line",
    '(EngineCore_DP0 pid=123) INFO 12-03 13:00:09 [mla.py:88] K3ROCM-DECISION '
    + json.dumps({"schema": "k3rocm.overlay.decision/1", "pid": 123, "layer_kind": "target",
                  "phase": "load", "fusions": {
                      "qk_norm": {"state": "on", "reason": "x"},
                      "decode_qprep": {"state": "off", "reason": "kv not fp8"}}}),
])


def test_decision_lines_summarized():
    recs = parse_decisions(DECISION_LOG)
    assert len(recs) == 1
    assert summarize_decisions(recs) == "target: decode_qprep=off qk_norm=on"
    assert "no K3ROCM-DECISION" in summarize_decisions(parse_decisions("nothing here"))


def test_topology_block():
    env = {**TWO, "K3_SCALE_ROUTER_PORT": "9000"}
    t = topology("http://127.0.0.1:9000", env)
    assert t["mode"] == "replicas" and t["via_router"] and t["target"] == "router"
    assert t["nodes"] == ["10.0.0.1:8000", "10.0.0.2:8000"]
    t = topology("http://10.0.0.2:8000", env)
    assert not t["via_router"] and t["target"] == "one node"
    assert topology("http://127.0.0.1:8000", {})["mode"] == "single"
