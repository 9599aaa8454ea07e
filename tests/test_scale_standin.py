"""Scale-out on the CPU stand-in, live: two real vLLM servers (the session's ``standin_server``
and one more) behind the real vllm-router: routing, overhead, failover, the router image with the
Kubernetes args (while the killed replica restarts), rejoin, two routers with a draining
``router-down``, then a replica's graceful stop (last: it leaves it stopped).
Measured figures are printed as ``[scale] ...`` lines."""

from __future__ import annotations

import os
import shlex
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import _image_exists, free_port, need, run_cli
from server_fixture import (
    SMOKE_MODEL,
    ServerStartError,
    standin_server,  # noqa: F401 - the shared session fixture
    start_server,
)
from test_k8s_render import TWO_K8S, _obj, _render, refuses

from k3rocm.deploy.provenance import exec_text
from k3rocm.deploy.scale.overhead import format_figures, measure
from k3rocm.deploy.scale.render import compose_override, plan
from k3rocm.deploy.scale.router import instance, start_router, stop_router
from k3rocm.deploy.scale.settings import load_scale
from k3rocm.deploy.scale.status import format_status, scale_status
from k3rocm.deploy.server_api import metric_sum

pytestmark = pytest.mark.docker

ROUTER_IMAGE = os.environ.get("K3_TEST_ROUTER_IMAGE", "k3rocm/router:0.1.17")
REQUEST_TIMEOUT = 60.0  # per request; "hung" = no answer within this
READ_TIMEOUT = 60.0  # a stream with no byte for this long is "hung"
DRAIN_S = 120  # K3_SCALE_DRAIN_TIMEOUT of the second replica
PROMPT = "The capital of France is"


def _say(msg: str) -> None:
    stream = sys.__stderr__ or sys.stderr
    stream.write(f"[scale] {msg}\n")
    stream.flush()


def _completion(url: str, max_tokens: int = 4, timeout: float = REQUEST_TIMEOUT):
    """One completion; returns (outcome, seconds): outcome 'ok', 'http <code>' or the error."""
    import requests

    t0 = time.monotonic()
    try:
        r = requests.post(f"{url}/v1/completions", timeout=timeout,
                          json={"model": SMOKE_MODEL, "prompt": PROMPT,
                                "max_tokens": max_tokens, "ignore_eos": True,
                                "temperature": 0})
        outcome = "ok" if r.status_code == 200 and r.json()["choices"] else f"http {r.status_code}"
    except requests.Timeout:
        outcome = "timeout"
    except requests.RequestException as exc:
        outcome = f"error {exc.__class__.__name__}"
    return outcome, time.monotonic() - t0


def _stream(url: str, max_tokens: int = 64, first=None) -> str:
    """'ok' (max_tokens, finish "length", [DONE]), 'failed' (HTTP error, cut, or "abort") or
    'hung' (no byte for READ_TIMEOUT); ``first`` is set at the first token's chunk."""
    import json

    import requests

    try:
        with requests.post(f"{url}/v1/completions", stream=True, timeout=(10, READ_TIMEOUT),
                           json={"model": SMOKE_MODEL, "prompt": PROMPT, "stream": True,
                                 "stream_options": {"include_usage": True},
                                 "max_tokens": max_tokens, "ignore_eos": True,
                                 "temperature": 0}) as r:
            if r.status_code != 200:
                return "failed"
            finish, done, tokens = None, False, None
            for line in r.iter_lines():
                line = line.strip()
                if line == b"data: [DONE]":
                    done = True
                elif line.startswith(b"data: "):
                    chunk = json.loads(line[6:])
                    tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
                    for choice in chunk.get("choices") or []:
                        finish = choice.get("finish_reason") or finish
                        if first is not None:  # a chunk carries a token, its text may be ""
                            first.set()
            return "ok" if done and finish == "length" and tokens == max_tokens else "failed"
    except requests.RequestException as exc:
        return "hung" if "timed out" in repr(exc).lower() else "failed"


def _counts(outcomes: list[str]) -> dict[str, int]:
    return {k: outcomes.count(k) for k in ("ok", "failed", "hung")}


def _served(url: str) -> float:
    """Requests this server finished successfully, from its Prometheus /metrics."""
    import requests

    return metric_sum(requests.get(f"{url}/metrics", timeout=10).text,
                      "vllm:request_success_total") or 0.0


def _kill(container) -> None:
    """SIGKILL; Docker 20.10 here may answer 500 while the container dies: then wait for it."""
    import docker

    try:
        container.kill()
    except docker.errors.APIError as exc:
        def exited():
            container.reload()
            return container.status in ("exited", "dead")

        try:
            _wait(exited, 30, "replica exited")
        except AssertionError:
            pytest.fail(f"could not kill the replica: {exc}", pytrace=False)


def _wait(cond, timeout: float, what: str, step: float = 0.5):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        v = cond()
        if v:
            return time.monotonic() - t0
        time.sleep(step)
    raise AssertionError(f"{what} not reached within {timeout:.0f} s")


@pytest.fixture(scope="module")
def cluster(docker_client, standin_server):  # noqa: F811
    need(_image_exists(docker_client, ROUTER_IMAGE),
         f"router image {ROUTER_IMAGE} is missing: `make router-image`")
    port2 = free_port()
    env = {"K3_SCALE_MODE": "replicas",
           "K3_SCALE_NODES": f"127.0.0.1:{standin_server.port},127.0.0.1:{port2}",
           "K3_SCALE_ROUTER_PORT": str(free_port()), "K3_SCALE_ROUTER_POLICY": "round_robin",
           "K3_SCALE_ROUTER_METRICS_PORT": str(free_port()),
           "K3_SCALE_HEALTH_INTERVAL": "1", "K3_SCALE_HEALTH_THRESHOLD": "2",
           "K3_SCALE_ROUTER_STARTUP_TIMEOUT": "600", "K3_SCALE_ROUTER_IMAGE": ROUTER_IMAGE,
           "K3_SCALE_DRAIN_TIMEOUT": str(DRAIN_S)}
    s = load_scale(env, dotenv=None)
    node2 = plan({**env, "K3_PROFILE": "cpu-smoke"}, dotenv=None).nodes[1]
    try:
        # The rendered node command (--shutdown-timeout) as passthrough args, like the
        # compose override does; the hold double lets a test freeze this replica's engine.
        second = start_server(docker_client, image=standin_server.image, host_port=port2,
                              name=f"k3rocm-test-replica2-{os.getpid()}", hold=True,
                              env={"K3_EXTRA_ARGS": shlex.join(node2.command)})
    except ServerStartError as exc:
        pytest.fail(f"second replica did not start: {exc}", pytrace=False)
    name = f"k3rocm-test-router-{os.getpid()}"
    try:
        start_router(docker_client, s, name=name, labels={"org.k3rocm.test": "router"})
        _wait(lambda: scale_status(s, docker_client)[1].summary == "ok, 2 of 2", 60,
              "router ok, 2 of 2")
        yield {"scale": s, "replicas": [standin_server, second], "router": name, "env": env,
               "node2": node2}
    finally:
        stop_router(docker_client, name)
        second.stop()


def test_requests_reach_both_replicas_and_router_overhead(cluster):
    s = cluster["scale"]
    urls = [r.base_url for r in cluster["replicas"]]
    before = [_served(u) for u in urls]
    n = 8  # round_robin is deterministic: 4 / 4
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: _completion(s.router_url), range(n)))
    assert [o for o, _ in results] == ["ok"] * n, results
    per = [_served(u) - b for u, b in zip(urls, before, strict=True)]
    _say(f"requests per replica through the router (round_robin, {n} requests): "
         f"{per[0]:.0f} / {per[1]:.0f}")
    assert sum(per) == n and min(per) >= n // 4, per
    # the router's added latency: printed, not asserted (a shared machine's times)
    f = measure(s.router_url, urls, SMOKE_MODEL, n=2, max_tokens=8)
    _say(format_figures(f))
    assert f["requests_per_path"] == 2 and f["direct_client_s"] > 0


def test_failover_degraded_then_restart(cluster, docker_client):
    s = cluster["scale"]
    victim = cluster["replicas"][1]
    # no stream starts between the kill and the router noticing it (that outcome is a race)
    n = workers = 4
    t0 = time.monotonic()
    with ThreadPoolExecutor(workers) as pool, victim.hold() as wait_held:
        # round robin: half are held in the frozen victim's engine when it is killed
        futures = [pool.submit(_stream, s.router_url) for _ in range(n)]
        held = wait_held()
        _kill(victim.container)  # SIGKILL: no draining, in-flight streams are cut
        _say(f"replica 2 killed with {held} request(s) held in its engine")
        outcomes = [f.result(timeout=READ_TIMEOUT + 60) for f in futures]
    wall = time.monotonic() - t0
    counts = _counts(outcomes)
    _say(f"failover with streaming requests ({n} at concurrency {workers}, replica 2 "
         f"SIGKILLed): ok {counts['ok']}, failed {counts['failed']}, hung {counts['hung']}; "
         f"wall {wall:.1f} s")
    assert sum(counts.values()) == n, outcomes  # every outcome is one of the three
    assert counts["hung"] == 0, outcomes  # a cut stream ends with an error, never a hang
    assert counts["failed"] <= n // 2 and counts["ok"] >= n - n // 2, counts

    t_deg = _wait(lambda: scale_status(s, docker_client)[1].summary == "degraded, 1 of 2",
                  30, "status 'degraded, 1 of 2'")
    replicas, router = scale_status(s, docker_client)
    _say("status while one replica is down:\n  " + "\n  ".join(format_status(replicas, router)))
    assert replicas[0].healthy and not replicas[1].healthy
    r = run_cli("scale", "status", env={k: str(v) for k, v in cluster["env"].items()})
    assert r.returncode == 3 and r.stdout.splitlines()[-1].endswith("degraded, 1 of 2"), \
        r.stdout + r.stderr
    after = [_completion(s.router_url)[0] for _ in range(6)]
    _say(f"after the failure was noticed ({t_deg:.1f} s): 6 requests -> {after}")
    assert after == ["ok"] * 6

    # restarted (same port); test_restarted_replica_rejoins waits for it, the Kubernetes args
    # test runs meanwhile (it needs no replica)
    victim.container.start()
    cluster["restarted"] = time.monotonic()


def test_router_image_accepts_the_rendered_kubernetes_args(docker_client):
    """The router image with the rendered Kubernetes args: every flag accepted, loopback only,
    /liveness and metrics answer, the rendered exec probe passes, SIGTERM exits 0."""
    from k3rocm.deploy.scale import k8s

    need(_image_exists(docker_client, ROUTER_IMAGE),
         f"router image {ROUTER_IMAGE} is missing: `make router-image`")
    dep = _obj(_render(TWO_K8S), "Deployment", k8s.ROUTER)
    router = dep["spec"]["template"]["spec"]["containers"][0]
    args = [a.replace("$(POD_NAMESPACE)", "k3rocm") for a in router["args"]]
    c = docker_client.containers.run(ROUTER_IMAGE, command=args, detach=True,
                                     labels={"org.k3rocm.test": "router-k8s-args"})
    probe = ("import sys, urllib.request as u; "
             "[u.urlopen(f'http://127.0.0.1:{p}', timeout=2) for p in sys.argv[1:]]")
    try:
        def answers():
            c.reload()
            assert c.status == "running", c.logs(tail=30).decode(errors="replace")
            return exec_text(c, ["python3", "-c", probe, f"{k8s.ROUTER_INTERNAL_PORT}/liveness",
                                 f"{k8s.ROUTER_INTERNAL_METRICS_PORT}/metrics"]) is not None

        _wait(answers, 60, "router from the Kubernetes args answering", step=0.5)
        log = c.logs().decode(errors="replace")
        assert f"Starting server on 127.0.0.1:{k8s.ROUTER_INTERNAL_PORT}" in log, log
        assert "usage:" not in log and "unrecognized" not in log, log
        assert "Failed to start service discovery" in log, log
        assert exec_text(c, router["livenessProbe"]["exec"]["command"]) is not None
        c.stop(timeout=30)  # SIGTERM, then SIGKILL only after 30 s
        c.reload()
        log = c.logs().decode(errors="replace")
        assert c.attrs["State"]["ExitCode"] == 0, log[-2000:]
        assert "starting graceful shutdown" in log, log[-2000:]
        _say("router image started with the rendered Kubernetes args: listening on "
             f"127.0.0.1:{k8s.ROUTER_INTERNAL_PORT}, /liveness and metrics answer, the "
             "rendered liveness exec passes, SIGTERM: graceful shutdown, exit 0")
    finally:
        c.remove(force=True)


def test_restarted_replica_rejoins(cluster, docker_client):
    """The replica the failover test killed and restarted (same port) rejoins by itself."""
    s, victim = cluster["scale"], cluster["replicas"][1]
    t1 = cluster.get("restarted")
    assert t1 is not None, "the failover test did not restart its victim"
    _wait(lambda: scale_status(s, docker_client)[1].summary == "ok, 2 of 2", 420,
          "replica rejoined (ok, 2 of 2)", step=1.0)
    rejoin = time.monotonic() - t1
    # healthy is not yet routed to (circuit breaker): send until it serves one
    before = _served(victim.base_url)
    sent: list[str] = []

    def victim_served() -> bool:
        sent.append(_completion(s.router_url)[0])
        return _served(victim.base_url) > before

    traffic = _wait(victim_served, 180, "restarted replica receiving requests", step=0.5)
    _say(f"replica 2 rejoined: router 'ok, 2 of 2' {rejoin:.1f} s after its restart (vLLM "
         f"engine start included; the Kubernetes args test ran meanwhile); first request "
         f"served by it {traffic:.1f} s later ({len(sent)} requests sent meanwhile, outcomes "
         f"{sorted(set(sent))})")
    assert set(sent) == {"ok"}
    assert time.monotonic() - t1 < 620


def _free_ports(n: int) -> int:
    """The first of ``n`` consecutive free ports on 127.0.0.1 (router instance N: port + N-1)."""
    for _ in range(200):
        base = free_port()
        if base + n > 65536:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                sk = socket.socket()
                socks.append(sk)
                sk.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for sk in socks:
                sk.close()
    raise AssertionError(f"no {n} consecutive free ports")


HA_STREAMS = 6  # streams in flight through router 1 when it is stopped
HA_TOKENS = 32  # per stream: at HA_STEP_MS per engine step, ~8 s after the first token
HA_STEP_MS = 250


def test_router_down_drains_streams_while_router_2_serves(cluster, docker_client):
    """Router 1 stopped with `make router-down`'s defaults while streams run through it:
    it refuses new connections, every stream completes, router 2 serves meanwhile."""
    replicas = cluster["replicas"]  # both running: the victim rejoined
    base = _free_ports(4)  # router ports base, base+1; metrics base+2, base+3: no overlap
    env = {**cluster["env"], "K3_SCALE_ROUTER_PORT": str(base),
           "K3_SCALE_ROUTER_METRICS_PORT": str(base + 2)}
    (n1, s1), (n2, s2) = (instance(load_scale(env, dotenv=None), i) for i in (1, 2))
    name1, name2 = (f"{n}-test-{os.getpid()}" for n in (n1, n2))
    labels = {"org.k3rocm.test": "router-ha"}
    try:
        r1 = start_router(docker_client, s1, name=name1, labels=labels)
        start_router(docker_client, s2, name=name2, labels=labels)
        for si in (s1, s2):
            _wait(lambda si=si: scale_status(si, docker_client)[1].summary == "ok, 2 of 2", 420,
                  f"router at {si.router_url} ok, 2 of 2 (a restarted replica included)")
        firsts = [threading.Event() for _ in range(HA_STREAMS)]
        with replicas[0].slowed(HA_STEP_MS), replicas[1].slowed(HA_STEP_MS), \
                ThreadPoolExecutor(HA_STREAMS + 5) as pool:
            # warm both engines at this concurrency first
            warm = [pool.submit(_completion, s1.router_url, 8) for _ in range(HA_STREAMS)]
            assert [f.result()[0] for f in warm] == ["ok"] * HA_STREAMS
            streams = [pool.submit(_stream, s1.router_url, HA_TOKENS, ev) for ev in firsts]
            # stop once two streams have a token (others may wait in the engine: still open)
            _wait(lambda: sum(ev.is_set() for ev in firsts) >= 2
                  or any(f.done() for f in streams), 180, "first tokens of two streams",
                  step=0.1)
            assert not any(f.done() for f in streams), [f.result() for f in streams]
            started = sum(ev.is_set() for ev in firsts)
            t0 = time.monotonic()
            stopper = pool.submit(stop_router, docker_client, name1)  # router-down's defaults
            _wait(lambda: refuses(s1.router_port), 60, "router 1 refusing new connections",
                  step=0.1)
            refused_after = time.monotonic() - t0
            during = [f.result()[0] for f in
                      [pool.submit(_completion, s2.router_url, 4) for _ in range(4)]]
            draining = not stopper.done()
            outcomes = [f.result(timeout=READ_TIMEOUT + 120) for f in streams]
            assert stopper.result(timeout=120) is True
            drained = time.monotonic() - t0
        after = [_completion(s2.router_url, 4)[0] for _ in range(4)]
        lost = HA_STREAMS - outcomes.count("ok")
        _say(f"streams lost: {lost} of {HA_STREAMS} (router 1 stopped by stop_router with "
             f"{HA_STREAMS} {HA_TOKENS}-token streams open, {started} past their first token; "
             f"refusing new connections {refused_after:.1f} s after the stop, gone after "
             f"{drained:.1f} s; outcomes {_counts(outcomes)}); router 2 during the drain: "
             f"{during} (router 1 still draining: {draining}), after: {after}")
        assert lost == 0, outcomes
        assert during == ["ok"] * 4 and draining, (during, draining)
        assert after == ["ok"] * 4, after
        with pytest.raises(Exception):  # noqa: B017 - removed: docker-py's NotFound
            r1.reload()
    finally:
        for name in (name1, name2):
            stop_router(docker_client, name, timeout=5)


def _log_has(container, needle: str) -> bool:
    return needle in container.logs().decode(errors="replace")


def test_graceful_stop_drains_in_flight_stream(cluster):
    """SIGTERM while a stream is held in the replica's engine: with the rendered
    --shutdown-timeout it completes; streams through the router meanwhile do not hang."""
    s = cluster["scale"]
    victim = cluster["replicas"][1]
    node2 = cluster["node2"]
    grace = int(compose_override(node2)["services"]["server"]["stop_grace_period"][:-1])
    assert grace > DRAIN_S  # compose waits for the drain before SIGKILL
    with ThreadPoolExecutor(5) as pool:
        with victim.hold() as wait_held:
            direct = pool.submit(_stream, victim.base_url, 32)
            wait_held()
            stopper = threading.Thread(target=victim.container.stop,
                                       kwargs={"timeout": grace}, daemon=True)
            stopper.start()
            # vLLM logs the mode when SIGTERM reaches the API server (launcher.py, 0.32.0):
            # mode=drain with a --shutdown-timeout, mode=abort with vLLM's default 0.
            _wait(lambda: _log_has(victim.container, "stopping engine client mode="), 60,
                  "SIGTERM seen by the API server")
            assert _log_has(victim.container, "mode=drain"), victim.logs(20)
            routed = [pool.submit(_stream, s.router_url, 16) for _ in range(8)]
        result = direct.result(timeout=READ_TIMEOUT + 30)
        routed_counts = _counts([f.result(timeout=READ_TIMEOUT + 60) for f in routed])
    stopper.join(timeout=grace + 30)
    victim.container.reload()
    _say(f"graceful stop (--shutdown-timeout {DRAIN_S}): the stream held in the stopping "
         f"replica -> {result}; 8 streams through the router during the drain -> "
         f"{routed_counts}; replica {victim.container.status} "
         f"(exit {victim.container.attrs['State']['ExitCode']})")
    assert result == "ok"
    assert routed_counts["hung"] == 0, routed_counts
    # SIGTERM reached vLLM (the entrypoint execs it as PID 1): a clean exit, not SIGKILL
    assert victim.container.status == "exited"
    assert victim.container.attrs["State"]["ExitCode"] in (0, 143), victim.logs(20)
