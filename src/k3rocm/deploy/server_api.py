"""One HTTP client for the vLLM OpenAI server: the API key rule, /health, /v1/models, /metrics,
the profiler endpoints, streaming chat completions (:class:`ChatStream`), and readiness
(:func:`wait_ready`, one loop for every command).

vLLM checks ``Authorization: Bearer`` only under /v1 (vllm@0.27.1:vllm/entrypoints/serve/utils/
server_utils.py AuthenticationMiddleware), so the header is sent on every request; the profiler
endpoints exist only on a server started with a profiler (else 404). No answer raises
:class:`Unreachable`, a wrong answer :class:`ServerError` (exit 3). A refused connection means
nothing listens yet (vLLM listens only after loading the model,
vllm@0.32.0:vllm/entrypoints/launchers/launcher.py:378).
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

from k3rocm.errors import ServerError, UsageError, tagged_log

NO_KEY = (None, "", "EMPTY")  # "EMPTY": the OpenAI clients' spelling of "no key"
PROFILE_START_TIMEOUT = 300.0
PROFILE_STOP_TIMEOUT = 1800.0  # stop_profile returns once every rank wrote its trace
STREAM_TIMEOUT = 600.0  # seconds without a byte from a streaming completion

_log = tagged_log("bench")


class Unreachable(ServerError):
    """No HTTP answer; ``refused``: nothing listening at the URL."""

    def __init__(self, url: str, exc: Exception):
        self.reason = exc.__class__.__name__
        self.refused = refused(exc)
        super().__init__(f"nothing listening at {url} (connection refused): start the server "
                         "(`make up`; one still starting: `make wait`) or pass --url"
                         if self.refused else
                         f"server not reachable at {url} ({self.reason}); start it "
                         "(`make up`) or pass --url")


def refused(exc: BaseException) -> bool:
    """Whether ``exc`` comes from a refused TCP connection (requests wraps it in urllib3's
    NewConnectionError inside MaxRetryError inside its ConnectionError: walk them all).
    """
    seen: set[int] = set()
    todo: list[object] = [exc]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        if isinstance(e, ConnectionRefusedError):
            return True
        seen.add(id(e))
        todo += [e.__cause__, e.__context__, getattr(e, "reason", None), *e.args]
    return False


def _requests():
    import requests

    return requests


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The one rule: a bearer header unless the key is unset, empty or ``EMPTY``."""
    return {} if api_key in NO_KEY else {"Authorization": f"Bearer {api_key}"}


class ServerAPI:
    """One vLLM server at ``url``: one ``requests.Session`` carrying the auth header."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 10.0):
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self.session = _requests().Session()
        self.session.headers.update(auth_headers(api_key))

    def request(self, method: str, path: str, timeout: float | None = None, **kwargs: Any):
        try:
            return self.session.request(method, self.url + path,
                                        timeout=self.timeout if timeout is None else timeout,
                                        **kwargs)
        except _requests().RequestException as exc:
            raise Unreachable(self.url, exc) from None

    def get(self, path: str, timeout: float | None = None, **kwargs: Any):
        return self.request("GET", path, timeout, **kwargs)

    def post(self, path: str, timeout: float | None = None, **kwargs: Any):
        return self.request("POST", path, timeout, **kwargs)

    def health(self, timeout: float | None = None) -> int:
        return self.get("/health", timeout).status_code

    def model_list(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """``/v1/models``' ``data``: one dict per served model."""
        r = self.get("/v1/models", timeout)
        if r.status_code in (401, 403):
            raise ServerError(f"server at {self.url} refused /v1/models (HTTP {r.status_code}); "
                              "set K3_API_KEY to the server's key")
        if r.status_code != 200:
            raise ServerError(f"server at {self.url} answered /v1/models with HTTP "
                              f"{r.status_code}; is it a vLLM OpenAI server and healthy?")
        try:
            data = r.json()["data"]
            if not all(isinstance(m, dict) and "id" in m for m in data):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            raise ServerError(f"server at {self.url}: /v1/models is not an OpenAI model "
                              "list") from None
        return data

    def models(self, timeout: float | None = None) -> list[str]:
        return [str(m["id"]) for m in self.model_list(timeout)]

    def metrics_text(self, timeout: float | None = None) -> str:
        r = self.get("/metrics", timeout)
        if r.status_code != 200:
            raise ServerError(f"server at {self.url} answered /metrics with HTTP "
                              f"{r.status_code}")
        return r.text

    def start_profile(self, timeout: float = PROFILE_START_TIMEOUT) -> None:
        self._profile("/start_profile", timeout)

    def stop_profile(self, timeout: float = PROFILE_STOP_TIMEOUT) -> None:
        self._profile("/stop_profile", timeout)

    def stream_chat(self, body: dict[str, Any], st: ChatStream | None = None,
                    on_text: Callable[[str], None] | None = None) -> ChatStream:
        """Stream the chat completion ``body`` into ``st`` (``on_text``: each chunk's content)
        until the server ends it or ``st.hang_up()``; never raises: a failure is ``st.error``."""
        st = st or ChatStream()
        try:
            with self.post("/v1/chat/completions", (10, STREAM_TIMEOUT),
                           json={**body, "stream": True}, stream=True) as r:
                st.response, st.status = r, r.status_code
                if st.stop.is_set():  # hung up before the response was there to close
                    return st
                if r.status_code != 200:
                    st.error = f"HTTP {r.status_code}: {r.text[:200]}"
                    return st
                for line in r.iter_lines():
                    if st.stop.is_set() or line == b"data: [DONE]":
                        break  # closing the connection aborts the request server-side
                    if line.startswith(b"data: "):
                        with contextlib.suppress(ValueError):
                            st._read(json.loads(line[6:]), on_text)
        except Exception as exc:  # noqa: BLE001 - the stream's error, unless it was hung up
            if not st.stop.is_set():
                st.error = str(exc) if isinstance(exc, ServerError) else \
                    f"{exc.__class__.__name__}: {exc}"[:300]
        finally:
            st.done = True
        return st

    def _profile(self, path: str, timeout: float) -> None:
        r = self.post(path, timeout)
        if r.status_code == 404:
            raise ServerError(f"POST {self.url}{path} answered 404: the server was started "
                              "without a profiler; set K3_PROFILER_DIR (it renders "
                              "--profiler-config) and restart it")
        if r.status_code != 200:
            raise ServerError(f"POST {self.url}{path} answered HTTP {r.status_code}: "
                              f"{r.text[:200]}")


class ChatStream:
    """One streaming chat completion (:meth:`ServerAPI.stream_chat`), read by other threads
    while it runs: ``tokens`` so far (vLLM's continuous usage count, else one per chunk that
    carries a token), the last ``usage`` sent, ``first``/``last`` (``perf_counter`` of the first
    and last token), the HTTP ``status``, ``error`` (why it ended early: a one-line reason, never
    for a hang-up) and ``done``."""

    def __init__(self) -> None:
        self.tokens, self.usage, self.status, self.error, self.done = 0, None, None, None, False
        self.first: float | None = None
        self.last: float | None = None
        self.stop = threading.Event()
        self.response: Any = None

    def hang_up(self) -> None:
        """Close the connection now (the server aborts the request)."""
        self.stop.set()
        raw = getattr(self.response, "raw", None)
        sock = getattr(getattr(raw, "connection", None), "sock", None)
        if sock is None:  # `Connection: close`: http.client handed the socket to the response
            sock = getattr(getattr(getattr(getattr(raw, "_fp", None), "fp", None), "raw", None),
                           "_sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _read(self, chunk: dict[str, Any], on_text: Callable[[str], None] | None) -> None:
        self.usage = chunk.get("usage") or self.usage
        deltas = [c.get("delta") or {} for c in chunk.get("choices") or []]
        n = sum(bool(d.get("content") or d.get("reasoning_content") or d.get("reasoning"))
                for d in deltas)
        counted = (chunk.get("usage") or {}).get("completion_tokens")
        self.tokens = counted if counted is not None else self.tokens + n
        if n:
            self.last = time.perf_counter()
            self.first = self.first or self.last
            text = "".join(d.get("content") or "" for d in deltas)
            if text and on_text is not None:
                on_text(text)


def metric_sum(metrics_text: str, name: str) -> float | None:
    """Sum of sample ``name`` over all its label sets in Prometheus text; None when absent."""
    found = re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})?[ \t]+(\S+)(?:[ \t]+-?\d+)?[ \t]*$",
                       metrics_text, re.M)
    return sum(float(v) for v in found) if found else None


class StartFailed(ServerError):
    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(f"the server container {reason} before it became ready")


def url_port(url: str) -> int:
    p = urlparse(url)
    return p.port or (443 if p.scheme == "https" else 80)


def wait_ready(url: str, model: str, timeout: float, api_key: str | None = None,
               failed: Callable[[], str | None] | None = None, quiet: bool = False,
               status: Callable[[], str] | None = None, every: float = 15) -> float:
    """Wait until /health answers 200 and /v1/models lists ``model``; the seconds it took.

    ``failed`` (a starting server): why its container failed, or None while it lives; asked every
    second, it ends the wait with :class:`StartFailed`. Without it a refused connection ends the
    wait at once. ``status`` adds what the server is doing to each progress line. UsageError
    (exit 3) on timeout or a different model.
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
    try:
        ServerAPI(url, timeout=2).health()
        return True
    except Unreachable:
        return False
