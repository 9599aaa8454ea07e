"""Scale-out settings, per-node rendering, router argv and instances, the compose rendering,
status and router failures (no servers; Kubernetes: test_k8s_render.py; live:
test_scale_standin.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
from types import SimpleNamespace

import pytest
from conftest import REPO, need, run_cli

from k3rocm.deploy.scale.render import compose_override, plan, router_argv
from k3rocm.deploy.scale.router import STOP_TIMEOUT_S, instance, stop_router
from k3rocm.deploy.scale.settings import SCALE_FIELD_BY_ENV, load_scale
from k3rocm.deploy.scale.status import parse_decisions, summarize_decisions, topology
from k3rocm.errors import UsageError
from k3rocm.serving import config

TWO = {"K3_SCALE_MODE": "replicas", "K3_SCALE_NODES": "10.0.0.1:8000,10.0.0.2:8000"}


@pytest.fixture
def cli(k3):
    """``cli(*args, env=...)``: ``k3`` (conftest) with no .env; the real `python -m k3rocm
    scale`: test_cli_bad_value_exit_2_no_traceback."""
    return lambda *args, env: k3(args[0], "--env-file", "/dev/null", *args[1:], env=env)


def test_the_docs_table_is_every_scale_setting_with_its_default():
    import re

    from k3rocm.deploy.scale.settings import SCALE_ENV, ScaleSettings

    rows = re.findall(r"^\| `(K3_SCALE_\w+)` \| (`[^`]*`|—) \|",
                      (REPO / "docs" / "scale.md").read_text(), re.M)
    assert [r[0] for r in rows] == list(SCALE_ENV.values())
    default = ScaleSettings()
    for env, doc in rows:
        doc = doc.replace("\\|", "|")  # a | in a Markdown table cell is written \|
        value = getattr(default, SCALE_FIELD_BY_ENV[env])
        assert doc == (f"`{value}`" if value not in (None, "", ()) else "—"), env


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
    ({"K3_SCALE_NODS": "a:1"}, "K3_SCALE_NODS is not a known setting"),
    ({**TWO, "K3_SCALE_ROUTER_HOST": "0.0.0.0"}, "K3_SCALE_ROUTER_HOST='0.0.0.0' is not valid: "
     "the router's /add_worker and /remove_worker answer anyone"),
    ({**TWO, "K3_SCALE_ROUTER_HOST": "10.0.0.9"}, "expose only the data paths through the proxy"),
    ({**TWO, "K3_SCALE_MODE": "dp-ep"}, "K3_SCALE_MODE=dp-ep (from env) is not offered: the "
     "data-parallel + expert-parallel rendering was removed"),
    ({**TWO, "K3_SCALE_EXPERIMENTAL": "1"}, "K3_SCALE_EXPERIMENTAL is not a known setting"),
    ({**TWO, "K3_SCALE_DRAIN_TIMEOUT": "-1"}, "K3_SCALE_DRAIN_TIMEOUT='-1' is not valid"),
    ({**TWO, "K3_SCALE_METRICS_NAMESPACE": "Monitoring"}, "='Monitoring' is not valid: use a "
     "Kubernetes name"),
    ({**TWO, "K3_SCALE_GPU_GROUPS": "video"}, "='video' is not valid: give numeric group ids"),
])
def test_bad_scale_settings_one_line(env, needle):
    with pytest.raises(UsageError) as exc:
        load_scale(env, dotenv=None)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_dotenv_is_read_and_environment_wins(tmp_path):
    dotenv = tmp_path / ".env"
    dotenv.write_text("K3_SCALE_MODE=pd\nK3_SCALE_NODES=a:1,b:2\nK3_SCALE_ROUTER_PORT=9000\n")
    with pytest.raises(UsageError, match=r"K3_SCALE_MODE=pd \(from .env\) is not offered"):
        load_scale({}, dotenv=dotenv)
    s = load_scale({"K3_SCALE_MODE": "replicas", "K3_SCALE_ROUTER_PORT": "9100"}, dotenv=dotenv)
    assert s.nodes == ("a:1", "b:2") and s.router_port == 9100 and s.mode == "replicas"


def test_cli_bad_value_exit_2_no_traceback():
    r = run_cli("scale", "render", env={"K3_SCALE_MODE": "replicas", "K3_SCALE_NODES": "x"})
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "K3_SCALE_NODES='x' is not valid" in r.stderr


def test_replicas_nodes_run_the_unchanged_server_and_drain():
    p = plan(TWO, dotenv=None)
    single = config.render(TWO, dotenv=None, check_model=False)
    for node in p.nodes:
        # vLLM's --shutdown-timeout defaults to 0: SIGTERM aborts every in-flight request.
        assert node.command == ["--shutdown-timeout", "300"]
        # Same renderer, same settings: the argv of a single-node server (TP 8, MTP k=2).
        assert node.argv == single.argv + node.command and node.env == single.env
    assert node.argv[node.argv.index("--tensor-parallel-size") + 1] == "8"
    assert json.loads(node.argv[node.argv.index("--speculative-config") + 1])[
        "num_speculative_tokens"] == 2


def test_router_argv():
    s = load_scale({**TWO, "K3_SCALE_ROUTER_PORT": "9000", "K3_SCALE_HEALTH_INTERVAL": "2",
                    "K3_SCALE_HEALTH_THRESHOLD": "2"}, dotenv=None)
    assert router_argv(s) == [
        "vllm-router", "--host", "127.0.0.1", "--port", "9000", "--policy", "cache_aware",
        "--worker-startup-timeout-secs", "7200", "--health-check-interval-secs", "2",
        "--health-failure-threshold", "2", "--request-timeout-secs", "1800",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", "29000",
        "--worker-urls", "http://10.0.0.1:8000", "http://10.0.0.2:8000"]


def test_compose_override_validates_with_docker_compose(tmp_path):
    need(shutil.which("docker") is not None, "no docker CLI")
    r = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
    need(r.returncode == 0, "docker compose v2 is not installed (.ci/install-compose.sh)")
    from k3rocm.deploy.scale.cli import _yaml_dump

    node = plan({**TWO, "K3_SCALE_NODES": "10.0.0.1:8000,10.0.0.2:8001"}, dotenv=None).nodes[1]
    f = tmp_path / "node1.yaml"
    f.write_text(_yaml_dump(compose_override(node)))
    r = subprocess.run(["docker", "compose", "-f", str(REPO / "compose.yaml"), "-f", str(f),
                        "config", "--format", "json"], capture_output=True, text=True,
                       cwd=REPO, env={"PATH": "/usr/bin:/bin:/usr/local/bin"})
    assert r.returncode == 0, r.stderr
    svc = json.loads(r.stdout)["services"]["server"]
    assert svc["command"] == node.command and "--shutdown-timeout" in svc["command"]
    # compose stop/down waits longer than vLLM drains (compose's own default is 10 s).
    assert svc["stop_grace_period"] in ("5m30s", "330s"), svc["stop_grace_period"]
    assert svc["environment"]["K3_PORT"] == "8001"


def test_decision_lines_summarized():  # which record is final: test_decisions_unit.py
    log = ("(EngineCore_DP0 pid=123) INFO 12-03 13:00:09 [mla.py:88] K3ROCM-DECISION "
           + json.dumps({"schema": "k3rocm.overlay.decision/1", "pid": 123, "phase": "load",
                         "layer_kind": "target", "fusions": {
                             "qk_norm": {"state": "on", "reason": "x"},
                             "decode_qprep": {"state": "off", "reason": "kv not fp8"}}}))
    assert summarize_decisions(parse_decisions(log)) == "target: decode_qprep=off qk_norm=on"
    assert "no K3ROCM-DECISION" in summarize_decisions(parse_decisions("nothing here"))


def test_topology_block():
    env = {**TWO, "K3_SCALE_ROUTER_PORT": "9000"}
    t = topology("http://127.0.0.1:9000", env)
    assert t["mode"] == "replicas" and t["via_router"] and t["target"] == "router"
    assert t["nodes"] == ["10.0.0.1:8000", "10.0.0.2:8000"]
    t = topology("http://10.0.0.2:8000", env)
    assert not t["via_router"] and t["target"] == "one node"
    assert topology("http://127.0.0.1:8000", {})["mode"] == "single"


# vLLM 0.32.0 /metrics shape for the prefix cache (vllm/v1/metrics/loggers.py: counters
# vllm:prefix_cache_queries / vllm:prefix_cache_hits, in tokens, one sample per engine).
METRICS = """# HELP vllm:prefix_cache_queries_total Prefix cache queries (tokens).
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="k3-smoke"} 300.0
vllm:prefix_cache_queries_total{engine="1",model_name="k3-smoke"} 100.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="k3-smoke"} 96.0
vllm:prefix_cache_hits_total{engine="1",model_name="k3-smoke"} 4.0
vllm:prefix_cache_hits_created{engine="0",model_name="k3-smoke"} 1.7e9
"""


def test_no_prefix_cache_queries_is_no_hit_rate():  # the rate itself: test_status_ok_*
    from k3rocm.deploy.scale.status import prefix_cache_hit_rate

    assert prefix_cache_hit_rate("vllm:prefix_cache_queries_total 0\n") is None
    assert prefix_cache_hit_rate("") is None


def test_metric_sum_adds_a_metrics_samples_and_nothing_else():
    from k3rocm.deploy.server_api import metric_sum

    router = ('vllm_router_running_requests{worker="http://a:8000"} 3\n'
              'vllm_router_running_requests{worker="http://b:8000"} 2 1700000000000\n'
              "vllm_router_running_requests_total 40\n")
    assert metric_sum(router, "vllm_router_running_requests") == 5
    assert metric_sum("vllm:e2e_request_latency_seconds_sum 1.5\n",
                      "vllm:e2e_request_latency_seconds_sum") == 1.5
    assert metric_sum(METRICS, "vllm:prefix_cache_hits") is None  # not the _created sample
    assert metric_sum("# TYPE vllm_router_running_requests gauge\n",
                      "vllm_router_running_requests") is None


@pytest.fixture
def servers(fake_vllm):
    """Two fake vLLM servers and a router, as `make status` reads them."""
    return [fake_vllm(metrics=METRICS) for _ in range(3)]


def _status(router, *ports: int):
    from k3rocm.deploy.scale import status

    nodes = ",".join(f"127.0.0.1:{p}" for p in ports)
    return status.scale_status(load_scale({**TWO, "K3_SCALE_NODES": nodes, "K3_SCALE_ROUTER_PORT":
                                           str(router.port)}, dotenv=None), api_key="")


def test_status_ok_reads_every_replica(servers):
    from k3rocm.deploy.scale.status import format_status

    one, two, router = servers
    replicas, r = _status(router, one.port, two.port)
    assert r.summary == "ok, 2 of 2"
    assert [x.prefix_cache_hit_rate for x in replicas] == [pytest.approx(0.25)] * 2
    assert "prefix-cache hits 25.0%" in format_status(replicas, r)[0]


def test_status_degraded_even_when_router_says_ok(servers):
    one, _, router = servers
    assert _status(router, one.port, 1)[1].summary == "degraded, 1 of 2"
    router.health = 503
    assert _status(router, one.port, 1)[1].summary == "degraded, 1 of 2"


# --- router failures are server problems: exit 3 (k3rocm.errors), never 1 (a failed check) ---

@pytest.fixture
def dead_ports():
    """Three local ports that refuse connections: bound, never listening, held for the test."""
    import socket

    socks = [socket.socket() for _ in range(3)]
    for so in socks:
        so.bind(("127.0.0.1", 0))
    yield [so.getsockname()[1] for so in socks]
    for so in socks:
        so.close()


def _no_router_env(ports):
    return {"K3_SCALE_MODE": "replicas",
            "K3_SCALE_NODES": f"127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}",
            "K3_SCALE_ROUTER_HOST": "127.0.0.1", "K3_SCALE_ROUTER_PORT": str(ports[2])}


@pytest.mark.parametrize(("sub", "fragment"), [("status", "router unreachable"),
                                               ("overhead", "start the replicas first")])
def test_the_router_or_replicas_down_exits_3(cli, dead_ports, sub, fragment):
    rc, out, err = cli("scale", sub, env=_no_router_env(dead_ports))
    assert rc == 3, out + err
    # status: the table's last line says it; overhead: one line on stderr
    last = out.splitlines()[-1] if sub == "status" else err.strip()
    assert fragment in last and "\n" not in last, out + err


def _engine(found=None, started=None):
    """The docker-py surface the router functions use: ``containers.get`` finds ``found``
    (None: NotFound), ``containers.run`` starts ``started``, every image exists."""
    import docker

    def get(name):
        if found is None:
            raise docker.errors.NotFound(name)
        return found

    return SimpleNamespace(images=SimpleNamespace(get=lambda ref: object()), containers=
                           SimpleNamespace(get=get, run=lambda *a, **kw: started))


def test_a_router_that_exits_at_start_is_a_server_problem(dead_ports):
    from k3rocm.deploy.scale.router import start_router

    exited = SimpleNamespace(status="exited", reload=lambda: None, remove=lambda force: None,
                             logs=lambda tail=None: b"error: unknown flag --bogus\n")
    with pytest.raises(UsageError) as e:
        start_router(_engine(started=exited), load_scale(_no_router_env(dead_ports), dotenv=None))
    assert e.value.exit_code == 3 and "router exited at start" in str(e.value)
    assert "\n" not in str(e.value)


def _arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_instance_two_has_its_own_name_and_ports():
    s = load_scale(TWO, dotenv=None)
    assert instance(s, 1) == ("k3rocm-router", s)  # today's router, unchanged
    name, s2 = instance(s, 2)
    assert name == "k3rocm-router-2"
    argv = router_argv(s2)
    assert (_arg(argv, "--port"), _arg(argv, "--prometheus-port")) == ("8081", "29001")
    assert s2.router_url == "http://127.0.0.1:8081"
    assert argv[argv.index("--worker-urls"):] == router_argv(s)[argv.index("--worker-urls"):]


@pytest.mark.parametrize(("env", "n", "fragment"), [
    ({}, 0, "use 1..16"),
    ({"K3_SCALE_ROUTER_PORT": "65535"}, 2, "> 65535"),
    ({"K3_SCALE_ROUTER_PORT": "9000", "K3_SCALE_ROUTER_METRICS_PORT": "9001"}, 2, "overlap"),
])
def test_instance_refusals(env, n, fragment):
    s = load_scale({**TWO, **env}, dotenv=None)
    with pytest.raises(UsageError, match=fragment):
        instance(s, n)


def _running():
    calls = []
    return calls, SimpleNamespace(status="running", attrs={"State": {"ExitCode": 0}},
                                  reload=lambda: None,
                                  stop=lambda timeout: calls.append(("stop", timeout)),
                                  remove=lambda force: calls.append(("remove", force)))


def test_stop_router_waits_for_the_request_timeout_by_default():
    from k3rocm.deploy.scale.render import ROUTER_REQUEST_TIMEOUT_S

    assert STOP_TIMEOUT_S > ROUTER_REQUEST_TIMEOUT_S
    calls, c = _running()
    assert stop_router(_engine(c), "r") is True
    assert calls == [("stop", STOP_TIMEOUT_S), ("remove", True)]
    calls, c = _running()
    stop_router(_engine(c), "r", timeout=60)
    assert calls[0] == ("stop", 60)
    assert stop_router(_engine(), "r") is False


@pytest.mark.parametrize(("args", "fragment"), [
    (["router-down", "--instance", "two"], "--instance (make ROUTER=)='two' is not valid"),
    (["router-up", "--instance", "17"], "router instance 17 is out of range"),
    (["router-down", "--timeout", "1h"], "--timeout (make ROUTER_TIMEOUT=)='1h' is not valid"),
    (["overhead", "-n", "0"], "--requests 0 is out of range; use x >= 1"),
])
def test_cli_refuses_bad_instance_and_timeout(cli, args, fragment):
    rc, out, err = cli("scale", *args, env={**TWO, "DOCKER_HOST": "unix:///nonexistent.sock"})
    assert rc == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], err


@pytest.mark.parametrize("sub", ["render", "url", "proxy-conf", "status", "overhead"])
def test_single_mode_refuses_what_needs_replicas(cli, sub):
    rc, out, err = cli("scale", sub, env={"K3_SCALE_MODE": "single"})
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "K3_SCALE_MODE=replicas" in err, err
