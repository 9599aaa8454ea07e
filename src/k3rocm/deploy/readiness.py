"""Is the server there and serving our model? One readiness loop for every command.

``wait_ready`` polls ``/health`` then ``/v1/models`` with progress lines; ``answers`` says
whether anything answers HTTP at a URL.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from urllib.parse import urlparse

from k3rocm.deploy.server_api import ServerAPI, Unreachable
from k3rocm.errors import ServerError, UsageError, tagged_log

_log = tagged_log("bench")


class StartFailed(ServerError):
    """The server's container failed before it became ready (``failed`` said why)."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(f"the server container {reason} before it became ready")


def url_port(url: str) -> int:
    p = urlparse(url)
    return p.port or (443 if p.scheme == "https" else 80)


def wait_ready(url: str, model: str, timeout: float, api_key: str | None = None,
               failed: Callable[[], str | None] | None = None, quiet: bool = False,
               status: Callable[[], str] | None = None, every: float = 15) -> float:
    """Wait until ``/health`` answers 200 and ``/v1/models`` lists ``model``.

    ``failed``: for a server that is starting, why its container has failed (exited,
    restarting, unhealthy, gone) or None while it lives; asked every second, it ends the wait
    with :class:`StartFailed` (exit 3). While it lives a refused connection is "not listening
    yet". Without it the server is expected to be running already: a refused connection ends
    the wait at once (exit 3, "nothing listening at URL"), since nothing will start there.

    ``status`` (optional) adds a word on what the server is doing to each progress line (e.g.
    its last log line), printed every ``every`` seconds.

    Raises UsageError (exit 3) when the server is unreachable/unhealthy after ``timeout``
    seconds or when it serves a different model. Returns the seconds it took.
    """
    api = ServerAPI(url, api_key)
    t0 = time.time()
    last_err = "no answer"
    next_note = 0.0
    while True:
        elapsed = time.time() - t0
        try:
            code = api.health(timeout=5)
            if code == 200:
                served = api.models()
                if model not in served:
                    raise UsageError(f"server at {url} does not serve model {model!r}; it serves "
                                     f"{', '.join(served) or 'nothing'}: set "
                                     f"--set model=<name>", 3)
                if not quiet:
                    _log(f"server {url} ready after {elapsed:.0f}s (model {model})")
                return elapsed
            last_err = f"/health answered HTTP {code}"
        except Unreachable as exc:
            if exc.refused and failed is None:
                raise
            last_err = "connection refused" if exc.refused else exc.reason
        if failed is not None:
            why = failed()
            if why is not None:
                raise StartFailed(why)
        if elapsed >= timeout:
            raise UsageError(f"server at {url} not healthy within {timeout:.0f}s ({last_err}): "
                             f"start it (make up) or raise --server-timeout", 3)
        if not quiet and elapsed >= next_note:
            extra = f" | {status()}" if status is not None else ""
            _log(f"waiting for {url}/health ... {elapsed:.0f}s of {timeout:.0f}s "
                 f"({last_err}){extra}")
            next_note = elapsed + every
        time.sleep(1 if timeout > 1 else 0.2)


def answers(url: str) -> bool:
    """Does anything answer HTTP at ``url``?"""
    try:
        ServerAPI(url, timeout=2).health()
        return True
    except Unreachable:
        return False
