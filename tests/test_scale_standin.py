"""Scale-out on the CPU stand-in, live: two real vLLM servers behind the real vllm-router.

Traffic goes only to 127.0.0.1. The first replica is the session's ``standin_server``; the test
starts one more (fixed host port, so a restarted container keeps its URL) and the router from
``k3rocm/router:0.1.17`` (``make router-image``) with ``k3rocm.deploy.scale.router.start_router``.
Then: requests reach both replicas (counted from each server's /metrics); one replica stopped
mid-load: every request ends (success or a clear error) within its timeout; the status function
behind ``make status`` says "degraded, 1 of 2"; the replica restarted rejoins (timed).
Last, a DP=2 deployment (head + --headless worker) starts from the rendered dp-ep argv.
Measured figures are printed as ``[scale] ...`` lines.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
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

from k3rocm.deploy.scale.render import plan
from k3rocm.deploy.scale.router import start_router, stop_router
from k3rocm.deploy.scale.settings import load_scale
from k3rocm.deploy.scale.status import format_status, scale_status
from k3rocm.errors import UsageError

ROUTER_IMAGE = os.environ.get("K3_TEST_ROUTER_IMAGE", "k3rocm/router:0.1.17")
REQUEST_TIMEOUT = 60.0  # per request; "hung" = no answer within this
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


def _served(url: str) -> float:
    """Requests this server finished successfully, from its Prometheus /metrics."""
    import requests

    text = requests.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^vllm:request_success_total\{[^}]*\}\s+([0-9.eE+]+)$", line)
        if m:
            total += float(m.group(1))
    return total


def _kill(container) -> None:
    """SIGKILL a replica. This sandboxed Docker 20.10 sometimes answers 500 "did not receive an
    exit event" while the container does die: then wait for it to be seen as exited."""
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
    try:
        second = start_server(docker_client, image=standin_server.image, host_port=port2,
                              name=f"k3rocm-test-replica2-{os.getpid()}")
    except ServerStartError as exc:
        pytest.fail(f"second replica did not start: {exc}", pytrace=False)
    env = {"K3_SCALE_MODE": "replicas",
           "K3_SCALE_NODES": f"127.0.0.1:{standin_server.port},127.0.0.1:{port2}",
           "K3_SCALE_ROUTER_PORT": str(free_port()), "K3_SCALE_ROUTER_POLICY": "round_robin",
           "K3_SCALE_HEALTH_INTERVAL": "1", "K3_SCALE_HEALTH_THRESHOLD": "2",
           "K3_SCALE_ROUTER_STARTUP_TIMEOUT": "600", "K3_SCALE_ROUTER_IMAGE": ROUTER_IMAGE}
    s = load_scale(env, dotenv=None)
    name = f"k3rocm-test-router-{os.getpid()}"
    try:
        start_router(docker_client, s, name=name, labels={"org.k3rocm.test": "router"})
        _wait(lambda: scale_status(s, docker_client)[1].summary == "ok, 2 of 2", 60,
              "router ok, 2 of 2")
        yield {"scale": s, "replicas": [standin_server, second], "router": name, "env": env}
    finally:
        stop_router(docker_client, name)
        second.stop()


def test_requests_reach_both_replicas(cluster):
    s = cluster["scale"]
    urls = [r.base_url for r in cluster["replicas"]]
    before = [_served(u) for u in urls]
    n = 20
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: _completion(s.router_url), range(n)))
    assert [o for o, _ in results] == ["ok"] * n, results
    per = [_served(u) - b for u, b in zip(urls, before, strict=True)]
    _say(f"requests per replica through the router (round_robin, {n} requests): "
         f"{per[0]:.0f} / {per[1]:.0f}")
    assert sum(per) == n and min(per) >= n // 4, per


def _e2e(url: str) -> tuple[float, float]:
    """(sum of seconds, count) of the server's own end-to-end request latency histogram."""
    import requests

    text = requests.get(f"{url}/metrics", timeout=10).text
    vals = {}
    for key in ("sum", "count"):
        m = re.search(rf"^vllm:e2e_request_latency_seconds_{key}\{{[^}}]*\}}\s+([0-9.eE+]+)$",
                      text, re.M)
        vals[key] = float(m.group(1)) if m else 0.0
    return vals["sum"], vals["count"]


def test_router_added_latency(cluster):
    """Same sequential workload straight to the replicas and through the router (one run).

    The client-side time minus the servers' own end-to-end time (their /metrics histograms)
    is the transport overhead of each path; the router's share is the difference. This keeps
    the (noisy, shared 2-core) model compute out of the comparison.
    """
    s = cluster["scale"]
    urls = [r.base_url for r in cluster["replicas"]]
    n = 12
    for u in (*urls, s.router_url):
        _completion(u)  # warm every path

    def overhead(targets: list[str]) -> tuple[float, float]:
        before = [_e2e(u) for u in urls]
        results = [_completion(t, 8) for t in targets]
        assert all(o == "ok" for o, _ in results), results
        after = [_e2e(u) for u in urls]
        server = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
        count = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
        assert count == len(targets)
        client = sum(t for _, t in results)
        return (client - server) / len(targets), client / len(targets)

    direct_ovh, direct_mean = overhead([urls[i % 2] for i in range(n)])
    routed_ovh, routed_mean = overhead([s.router_url] * n)
    _say(f"router added latency: {1000 * (routed_ovh - direct_ovh):+.1f} ms per request "
         f"(client time minus server e2e time: direct {1000 * direct_ovh:.1f} ms, via router "
         f"{1000 * routed_ovh:.1f} ms; mean client time direct {1000 * direct_mean:.0f} ms, "
         f"via router {1000 * routed_mean:.0f} ms; {n} sequential requests of 8 tokens each)")


def test_failover_degraded_and_rejoin(cluster, docker_client):
    s = cluster["scale"]
    victim = cluster["replicas"][1]
    n, workers = 48, 4
    stop_after = 8
    done: list[tuple[str, float]] = []

    def one(i: int):
        out = _completion(s.router_url, max_tokens=128)  # long enough to be cut mid-flight
        done.append(out)
        return out

    t0 = time.monotonic()
    with ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(one, i) for i in range(n)]
        _wait(lambda: len(done) >= stop_after, 120, f"{stop_after} requests done", step=0.1)
        at = len(done)
        _kill(victim.container)  # SIGKILL: no draining, in-flight requests are cut
        _say(f"replica 2 killed after {at} of {n} requests had finished")
        results = [f.result(timeout=REQUEST_TIMEOUT + 30) for f in futures]
    wall = time.monotonic() - t0
    outcomes = [o for o, _ in results]
    hung = [o for o in outcomes if o == "timeout"]
    failed = [o for o in outcomes if o != "ok"]
    slowest = max(t for _, t in results)
    _say(f"failover: {n} requests, {len(failed)} failed ({sorted(set(failed)) or 'none'}), "
         f"{len(hung)} hung, slowest {slowest:.1f} s, wall {wall:.1f} s")
    assert not hung, outcomes
    assert slowest < REQUEST_TIMEOUT + 5
    assert all(o == "ok" or o.startswith(("http 5", "http 4", "error")) for o in outcomes)

    # The status function behind `make status` reports the router's view.
    t_deg = _wait(lambda: scale_status(s, docker_client)[1].summary == "degraded, 1 of 2",
                  30, "status 'degraded, 1 of 2'")
    replicas, router = scale_status(s, docker_client)
    _say("status while one replica is down:\n  " + "\n  ".join(format_status(replicas, router)))
    assert replicas[0].healthy and not replicas[1].healthy
    # The same through the command line `make status` runs.
    r = run_cli("scale", "status", env={k: str(v) for k, v in cluster["env"].items()})
    assert r.returncode == 1 and r.stdout.splitlines()[-1].endswith("degraded, 1 of 2"), \
        r.stdout + r.stderr
    after = [_completion(s.router_url)[0] for _ in range(6)]
    _say(f"after the failure was noticed ({t_deg:.1f} s): 6 requests -> {after}")
    assert after == ["ok"] * 6

    # Restart the same container (same published port): it rejoins the router by itself.
    t1 = time.monotonic()
    victim.container.start()
    rejoin = _wait(lambda: scale_status(s, docker_client)[1].summary == "ok, 2 of 2", 420,
                   "replica rejoined (ok, 2 of 2)", step=1.0)
    # Healthy again is not yet routed to again (the router's circuit breaker may still hold
    # it out after the failures): send requests until the restarted replica serves one.
    before = _served(victim.base_url)
    sent: list[str] = []

    def victim_served() -> bool:
        sent.append(_completion(s.router_url)[0])
        return _served(victim.base_url) > before

    traffic = _wait(victim_served, 180, "restarted replica receiving requests", step=0.5)
    _say(f"replica 2 rejoined: router 'ok, 2 of 2' {rejoin:.1f} s after its restart (vLLM "
         f"engine start included); first request served by it {rejoin + traffic:.1f} s after "
         f"the restart ({len(sent)} requests sent meanwhile, outcomes {sorted(set(sent))})")
    assert set(sent) == {"ok"}
    assert time.monotonic() - t1 < 620


def test_dp_ep_rendering_launches_dense_dp2(docker_client, standin_server):  # noqa: F811
    """Head + --headless worker from the rendered dp-ep env/argv (tiny model, no MoE layer)."""
    models = standin_server.tokenizer_path.parent.resolve()
    environ = {"K3_PROFILE": "cpu-smoke", "K3_MODEL": f"/models/{SMOKE_MODEL}",
               "K3_SERVED_MODEL_NAME": SMOKE_MODEL, "K3_MODELS_DIR": str(models),
               "K3_SCALE_MODE": "dp-ep", "K3_SCALE_NODES": "127.0.0.1:8000,127.0.0.1:8001",
               "K3_SCALE_IFNAME": "lo", "K3_SCALE_ALL2ALL": "allgather_reducescatter",
               "K3_SCALE_DP_RPC_PORT": "13345"}
    # The head runs one API server process instead of one per DP rank (2 CPU cores here):
    # K3_EXTRA_ARGS is appended last by the same renderer; headless workers refuse the flag.
    head_extra = {"K3_EXTRA_ARGS": "--api-server-count 1"}
    try:
        p = plan(environ, dotenv=None)
    except UsageError as exc:  # pragma: no cover - a rendering bug
        pytest.fail(str(exc))
    head, worker = p.nodes
    assert head.env_overrides["GLOO_SOCKET_IFNAME"] == "lo"
    assert head.env_overrides["VLLM_HOST_IP"] == "127.0.0.1"
    assert "--headless" in worker.command and "--headless" not in head.command
    base_env = {k: v for k, v in environ.items() if not k.startswith("K3_SCALE_")}
    vols = {str(models): {"bind": "/models", "mode": "ro"}}
    tag = f"{os.getpid()}-{int(time.time()) % 10**6}"
    labels = {"org.k3rocm.test": "dp-ep"}
    t0 = time.monotonic()
    hc = docker_client.containers.run(
        standin_server.image, detach=True, name=f"k3rocm-test-dphead-{tag}",
        environment={**base_env, **head.env_overrides, **head_extra}, command=head.command,
        volumes=vols,
        ports={"8000/tcp": ("127.0.0.1", None)}, shm_size="2g", labels=labels)
    wc = None
    try:
        wc = docker_client.containers.run(
            standin_server.image, detach=True, name=f"k3rocm-test-dpworker-{tag}",
            environment={**base_env, **worker.env_overrides}, command=worker.command,
            volumes=vols, network_mode=f"container:{hc.id}", shm_size="2g", labels=labels)
        hc.reload()
        url = f"http://127.0.0.1:{hc.attrs['NetworkSettings']['Ports']['8000/tcp'][0]['HostPort']}"

        def healthy():
            import requests

            for c in (hc, wc):
                c.reload()
                if c.status in ("exited", "dead"):
                    raise AssertionError(f"{c.name} exited:\n{c.logs(tail=30).decode()}")
            try:
                return requests.get(f"{url}/health", timeout=2).status_code == 200
            except requests.RequestException:
                return False

        _wait(healthy, 420, "DP=2 head healthy", step=1.0)
        ready = time.monotonic() - t0
        with ThreadPoolExecutor(3) as pool:
            outcomes = list(pool.map(lambda _: _completion(url, 8)[0], range(6)))
        assert outcomes == ["ok"] * 6, outcomes
        import requests

        metrics = requests.get(f"{url}/metrics", timeout=10).text
        per_engine: dict[str, float] = {}  # summed over finished_reason labels
        for m in re.finditer(
                r'^vllm:request_success_total\{[^}]*engine="(\d+)"[^}]*\}\s+([0-9.eE+]+)$',
                metrics, re.M):
            per_engine[m.group(1)] = per_engine.get(m.group(1), 0.0) + float(m.group(2))
        # Both DP ranks (the head's engine 0, the headless worker's engine 1) report, and the
        # 6 requests are all counted between them.
        assert {"0", "1"} <= set(per_engine) and sum(per_engine.values()) == 6, per_engine
        for c, argv in ((hc, head.argv + ["--api-server-count", "1"]), (wc, worker.argv)):
            log = c.logs().decode(errors="replace")
            line = next(ln for ln in log.splitlines() if ln.startswith("k3rocm: exec "))
            assert shlex.split(line.removeprefix("k3rocm: exec ")) == argv, line
        _say(f"dp-ep rendering: DP=2 (head + headless worker) healthy after {ready:.0f} s; "
             f"6 requests ok (per DP rank: {per_engine}); both containers exec'd exactly the "
             "rendered argv (the head + --api-server-count 1)")
    finally:
        for c in (wc, hc):
            if c is not None:
                c.remove(force=True)
