"""Start and stop vllm-router 0.1.17 (docker/router) on the host network with docker-py; its
argv is :func:`k3rocm.deploy.scale.render.router_argv`. Instance N is ``k3rocm-router-N`` on
port + N - 1. Stopping drains: on SIGTERM vllm-router stops accepting and returns when its open
requests finish (axum graceful shutdown, src/server.rs of the 0.1.17 sdist)."""

from __future__ import annotations

import contextlib
import threading
import time

from k3rocm.deploy.scale.render import ROUTER_REQUEST_TIMEOUT_S, STOP_MARGIN_S, router_argv
from k3rocm.deploy.scale.settings import ScaleSettings
from k3rocm.errors import ServerError, UsageError, tagged_log

DEFAULT_NAME = "k3rocm-router"
LABEL = "org.k3rocm.router"
MAX_INSTANCES = 16
STOP_TIMEOUT_S = ROUTER_REQUEST_TIMEOUT_S + STOP_MARGIN_S
PROGRESS_EVERY_S = 10.0


_log = tagged_log("router")


def instance(s: ScaleSettings, n: int) -> tuple[str, ScaleSettings]:
    """Router instance ``n`` (1-based): its container name and settings (ports + n - 1)."""
    if not 1 <= n <= MAX_INSTANCES:
        raise UsageError(f"router instance {n} is out of range: use 1..{MAX_INSTANCES} "
                         "(e.g. `make router-up ROUTER=2`)")
    if n == 1:
        return DEFAULT_NAME, s
    port, metrics = s.router_port + n - 1, s.router_metrics_port + n - 1
    if max(port, metrics) > 65535:
        raise UsageError(f"router instance {n} would listen on port {max(port, metrics)} "
                         "(> 65535): lower K3_SCALE_ROUTER_PORT / K3_SCALE_ROUTER_METRICS_PORT")
    if abs(s.router_port - s.router_metrics_port) < n:
        raise UsageError(f"router instances 1..{n} need ports K3_SCALE_ROUTER_PORT.."
                         f"+{n - 1} ({s.router_port}..{port}) and K3_SCALE_ROUTER_METRICS_PORT"
                         f"..+{n - 1} ({s.router_metrics_port}..{metrics}); they overlap: set "
                         "the two ports further apart")
    return (f"{DEFAULT_NAME}-{n}",
            s.model_copy(update={"router_port": port, "router_metrics_port": metrics}))


def start_router(client, s: ScaleSettings, name: str = DEFAULT_NAME,
                 labels: dict[str, str] | None = None, wait: float = 60.0):
    """Start the router container and wait until it answers HTTP; return the container."""
    import docker
    from k3rocm.deploy.server_api import answers

    if s.mode != "replicas":
        raise UsageError(f"K3_SCALE_MODE={s.mode}: the router fronts replicas; set "
                         "K3_SCALE_MODE=replicas and K3_SCALE_NODES")
    try:
        client.images.get(s.router_image)
    except docker.errors.ImageNotFound:
        raise UsageError(f"router image {s.router_image} does not exist: build it with "
                         "`make router-image`") from None
    with contextlib.suppress(docker.errors.NotFound):
        old = client.containers.get(name)
        raise UsageError(f"a container named {name} already exists ({old.status}): "
                         "`make router-down` first")
    argv = router_argv(s)
    _log(" ".join(argv))
    container = client.containers.run(
        s.router_image, entrypoint=[argv[0]], command=argv[1:], name=name, detach=True,
        network_mode="host", labels={LABEL: "router", **(labels or {})},
        restart_policy={"Name": "unless-stopped"} if not labels else None)
    t0 = time.monotonic()
    while True:
        container.reload()
        exited = container.status in ("exited", "dead")
        if not exited and answers(s.router_url):
            _log(f"router answering at {s.router_url} after {time.monotonic() - t0:.1f} s")
            return container
        if exited or time.monotonic() - t0 > wait:
            tail = container.logs(tail=20).decode(errors="replace")
            if exited:
                with contextlib.suppress(Exception):
                    container.remove(force=True)
            raise ServerError(("router exited at start" if exited else f"router not answering "
                               f"at {s.router_url} after {wait:.0f} s") + f"; log tail:\n{tail}")
        time.sleep(0.2)


def running_requests(metrics_url: str | None) -> int | None:
    """``vllm_router_running_requests`` summed, or None (no answer; round_robin/random)."""
    if not metrics_url:
        return None
    import requests

    from k3rocm.deploy.server_api import metric_sum

    try:
        n = metric_sum(requests.get(metrics_url, timeout=2).text, "vllm_router_running_requests")
    except requests.RequestException:
        return None
    return None if n is None else int(n)


def stop_router(client, name: str = DEFAULT_NAME, timeout: float = STOP_TIMEOUT_S,
                metrics_url: str | None = None, every: float = PROGRESS_EVERY_S) -> bool:
    """Drain (``docker stop``: SIGTERM, SIGKILL after ``timeout``) and remove the router
    container, logging progress every ``every`` s; False when there is none."""
    import docker

    try:
        c = client.containers.get(name)
    except docker.errors.NotFound:
        return False
    if c.status == "running":
        errors: list[Exception] = []

        def stop() -> None:
            try:
                c.stop(timeout=int(timeout))
            except Exception as exc:  # noqa: BLE001 - reported below, the removal still runs
                errors.append(exc)

        t0 = time.monotonic()
        _log(f"{name}: SIGTERM; draining the requests in flight (at most {timeout:.0f} s, "
             "then SIGKILL)")
        stopper = threading.Thread(target=stop, name=f"stop-{name}", daemon=True)
        stopper.start()
        while True:
            stopper.join(every)
            if not stopper.is_alive():
                break
            n = running_requests(metrics_url)
            _log(f"{name}: draining for {time.monotonic() - t0:.0f} s"
                 + ("" if n is None else f", {n} request(s) in flight"))
        with contextlib.suppress(Exception):
            c.reload()
        code = c.attrs.get("State", {}).get("ExitCode")
        took = time.monotonic() - t0
        if errors:
            _log(f"{name}: docker stop failed ({errors[0].__class__.__name__}: {errors[0]}); "
                 "removing it")
        elif code == 137:
            _log(f"{name}: still open after {timeout:.0f} s: SIGKILLed, the streams still in "
                 "flight were cut")
        else:
            _log(f"{name}: drained in {took:.1f} s (exit code {code})")
    c.remove(force=True)
    return True
