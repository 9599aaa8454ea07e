"""The server lifecycle through compose (``compose.yaml`` is the only container definition).

One :class:`ComposeServer` is one compose project's ``server`` service: ``make up/wait/down``,
``k3rocm smoke``, each A/B arm server and the tests' fixture. Per-server differences are
environment: compose interpolates ``K3_*``; anything else goes through the per-server env file
(``K3_VENDOR_ENV_FILE``) on top of ``.k3rocm/vendor.env``.

``k3rocm server up|wait|logs|save-log|provenance|down``: ``wait`` polls until ready (exit 3 with
the last log lines on timeout); a container that fails meanwhile is stopped, removed and its log
saved into a run directory (no start retried). ``down`` saves the log, then stops and removes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3rocm.deploy.deployment import KFD, compose_files
from k3rocm.deploy.engine import docker_client
from k3rocm.errors import UsageError, tagged_log
from k3rocm.options import DeploymentFlags, Options, like, option

REPO = Path(__file__).resolve().parents[3]
DEFAULT_PROJECT = "k3rocm"
SERVICE = "server"
STOP_TIMEOUT = 60  # compose.yaml's stop_grace_period
NEVER_EXITED = "0001-01-01T00:00:00Z"  # State.FinishedAt of a never-exited container


_log = tagged_log("server")


@dataclass
class ComposeServer:
    """One compose project's ``server``. ``env``: for compose (on top of this process's env
    when ``inherit_env``); ``container_env``: for the container only (a per-server env file).
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

    def compose_env(self) -> dict[str, str]:
        base = dict(os.environ) if self.inherit_env else {
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

    def state(self) -> str | None:
        """running / exited / ... of the server container, None when there is none
        (through the engine once the container is known: a `compose ps` per second costs CPU).
        """
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
        """Why the server container has failed (exited, restarting, restarted since
        :meth:`up` or the wait began, unhealthy, gone), from ``docker inspect``; None while
        it lives."""
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

    def up(self, build: bool = False,
           log_path: Path | Callable[[], Path] | None = None) -> None:
        """Start the server detached (``build``: build first; an image is never pulled). If
        compose fails, what it created is removed, its log saved first to ``log_path`` (as
        :meth:`wait`)."""
        if not self.cpu and not KFD.exists():
            raise UsageError(f"the GPU compose files map {KFD}, which this host does not have: "
                             "run on the AMD GPU node, or start the CPU stand-in (make CPU=1, "
                             "or --no-gpu)", 2)
        args = ["up", "-d", "--build" if build else "--no-build", SERVICE]
        # a container compose keeps counts only exits from now on
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
            path = None
            with contextlib.suppress(OSError):  # the results directory: removed anyway
                path = log_path() if callable(log_path) else log_path
            self.down(log_path=path, timeout=0)  # what compose created goes too
            where = f"; its log: {path}" if path is not None and path.is_file() else ""
            raise UsageError(f"starting the server (compose project {self.project}) failed: "
                             f"{err[-1]}{where}", code)

    def wait(self, timeout: float, every: float = 10, quiet: bool = False,
             log_path: Path | Callable[[], Path] | None = None) -> float:
        """Wait until ready (server_api.wait_ready). A container that fails meanwhile is
        stopped, removed and its log saved to ``log_path`` (a callable: asked only then); exit 3.
        """
        from k3rocm.deploy.server_api import StartFailed, wait_ready

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
        except UsageError as exc:  # a timeout, another model: exit 3, the log lines above
            print(f"k3rocm: last server log lines ({self.project}):\n{self.tail(25)}",
                  file=sys.stderr)
            if not isinstance(exc, StartFailed):
                raise UsageError(str(exc), exc.exit_code) from None
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
        if self.cpu:
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
        """Save the log (``log_path``), stop and remove the server. ``timeout`` None: the
        container's own stop_grace_period, as ``docker compose down`` without ``-t``.
        """
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


_PIN_SCRIPT = r"""
w=""; e=""
for p in /proc/[0-9]*; do
  n=$(cat "$p/comm" 2>/dev/null)
  case "$n" in
    VLLM::Worker*) [ -z "$w" ] && w=$(sed -n 's/^Cpus_allowed_list:[[:space:]]*//p' "$p/status") ;;
    VLLM::EngineCor*) e=${p#/proc/} ;;
  esac
done
[ -n "$e" ] || { echo "no VLLM::EngineCore process"; exit 1; }
# uni executor (no worker process): the worker runs in the EngineCore; the last cpu stays free
[ -n "$w" ] || w=$(python3 -c "import os; c = sorted(os.sched_getaffinity($e)); \
print(','.join(map(str, c[:-1] or c)))")
taskset -a -p -c "$w" "$e" >/dev/null && echo "EngineCore pid $e pinned to cpus $w"
"""


def pin_engine_core(container) -> str:
    """CPU stand-in only: pin vLLM's EngineCore next to its worker's cores, so its
    busy-poll leaves the API server's core free (else a response streams in one burst: ITL 0).
    """
    from k3rocm.deploy.provenance import exec_text

    out = exec_text(container, ["sh", "-c", _PIN_SCRIPT])
    if not out or "pinned" not in out:
        raise UsageError(f"could not pin the EngineCore in {container.name}: "
                         f"{(out or 'taskset/ps failed').strip()}", 3)
    return out.strip()


def compose_server(dep, project: str | None = None) -> ComposeServer:
    """``make up``'s server of deployment ``dep``."""
    return ComposeServer(project=project or os.environ.get("COMPOSE_PROJECT_NAME")
                         or DEFAULT_PROJECT, cpu=dep.cpu,
                         url=dep.url, model=dep.served_model_name, api_key=dep.api_key)


def default_timeout(dep) -> float:
    """The engine's VLLM_ENGINE_READY_TIMEOUT_S + 10 min, or 15 min."""
    engine = dep.rendered.env.get("VLLM_ENGINE_READY_TIMEOUT_S")
    return float(engine) + 600 if engine else 900.0


class ServerOptions(Options):  # every subcommand: --env-file, --project and its own
    env_file: str = like(DeploymentFlags, "env_file")
    project: str | None = option(
        None, f"compose project (default $COMPOSE_PROJECT_NAME or {DEFAULT_PROJECT})")
    timeout: float | None = option(None, "seconds (default: the engine's "
                                   "VLLM_ENGINE_READY_TIMEOUT_S + 10 min, or 15 min)", gt=0)
    build: bool = option(False, "build the image first")
    tail: int = option(200)
    label: str = option("server-log")


SUBCOMMANDS = {  # name: (help, its own flags)
    "up": ("start the compose server and wait until it is ready", ("timeout", "build")),
    "wait": ("wait until the compose server is ready", ("timeout",)),
    "logs": ("print the compose server's log", ("tail",)),
    "save-log": ("save the compose server's log into a run directory", ("label",)),
    "provenance": ("what is serving, as JSON", ()),
    "down": ("save the log into a run directory, stop, remove", ("label",)),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = parser.add_subparsers(dest="what", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for what, (text, own) in SUBCOMMANDS.items():
        ServerOptions.add_arguments(sub.add_parser(what, help=text), skip=tuple(
            n for n in ServerOptions.flags() if n not in ("env_file", "project", *own)))


def deployment_view(args: argparse.Namespace) -> dict:
    return {"project": compose_server(args.deployment, args.project).project}


def log_run_dir(srv: ComposeServer, dep, label: str = "server-log") -> Path:
    """A new run directory (with the run record) for a saved server log; its ``server.log`` path."""
    from k3rocm.deploy import runrecord
    from k3rocm.rundir import create_run_dir

    out = create_run_dir(dep.results_root, label)
    runrecord.write(out, runrecord.build(deployment=dep, url=dep.url, server=srv.provenance()))
    return out / "server.log"


def run(args: argparse.Namespace) -> int:
    if not getattr(args, "what", None):
        raise UsageError("server needs a subcommand: up, wait, logs, save-log, provenance or "
                         "down (see k3rocm server --help)")
    o, dep = ServerOptions.from_args(args), args.deployment
    srv = compose_server(dep, o.project)
    if args.what in ("up", "wait"):
        if args.what == "up":
            srv.up(build=o.build, log_path=lambda: log_run_dir(srv, dep))
        elif srv.state() is None:
            raise UsageError("no server container: start it with `make up` "
                             "(or `k3rocm server up`)", 3)
        srv.wait(o.timeout or default_timeout(dep), log_path=lambda: log_run_dir(srv, dep))
        return 0
    if args.what == "logs":
        print(srv.tail(o.tail))
        return 0
    if args.what == "provenance":
        print(json.dumps(srv.provenance(), indent=2, default=str))
        return 0
    if srv.state() is None:  # save-log and down (argparse allows no other)
        print("k3rocm: no server log to save (no server container)", file=sys.stderr)
    else:
        saved = srv.save_log(log_run_dir(srv, dep, o.label))
        print(f"k3rocm: server log saved to {saved or '(empty log)'}", file=sys.stderr)
    if args.what == "down":
        t0 = time.time()
        srv.down()
        _log(f"compose project {srv.project} stopped and removed ({time.time() - t0:.0f}s)")
    return 0
