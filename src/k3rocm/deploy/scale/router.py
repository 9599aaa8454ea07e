"""Start and stop vLLM's router (vllm-router 0.1.17, image from docker/router) with docker-py.

The router runs on the host network (it reaches the nodes' API addresses as given in
K3_SCALE_NODES and listens on K3_SCALE_ROUTER_HOST:K3_SCALE_ROUTER_PORT); its argv is
:func:`k3rocm.deploy.scale.render.router_argv` of the same settings.
"""

from __future__ import annotations

import contextlib
import time

from k3rocm.deploy.scale.render import router_argv
from k3rocm.deploy.scale.settings import ScaleSettings
from k3rocm.errors import ServerError, UsageError, tagged_log

DEFAULT_NAME = "k3rocm-router"
LABEL = "org.k3rocm.router"


_log = tagged_log("router")


def start_router(client, s: ScaleSettings, name: str = DEFAULT_NAME,
                 labels: dict[str, str] | None = None, wait: float = 60.0):
    """Start the router container and wait until it answers HTTP; return the container."""
    import docker
    from k3rocm.deploy.readiness import answers

    if s.mode not in ("replicas", "dp-ep"):
        raise UsageError(f"K3_SCALE_MODE={s.mode}: the router fronts scale-out modes; set "
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


def stop_router(client, name: str = DEFAULT_NAME) -> bool:
    import docker

    try:
        c = client.containers.get(name)
    except docker.errors.NotFound:
        return False
    with contextlib.suppress(Exception):
        c.stop(timeout=5)
    c.remove(force=True)
    return True
