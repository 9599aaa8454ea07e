"""Fresh arm servers for ``k3rocm ab``: one flag set, one arm order (A B B A ...).

Each slot gets its own compose project (``k3ab-<stamp>-<slot><arm>``) with the arm's environment
over the deployment's settings; its log is saved into the run directory before it is removed.
What each slot's server really ran (recorded identity, overlay decisions) is judged here too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from k3rocm.checks.bench import STEP_DELAY_ENV
from k3rocm.deploy.engine import image_id as engine_image_id
from k3rocm.deploy.lifecycle import (
    ComposeServer,
    compose_server,
    docker_client,
)
from k3rocm.deploy.server_api import answers, wait_ready
from k3rocm.errors import UsageError, tagged_log
from k3rocm.options import Options, option
from k3rocm.rundir import create_run_dir, write_bytes_atomic
from k3rocm.serving import decisions
from k3rocm.serving.fusions import NAME_OF_ENV as FUSION_OF  # K3_FUSE_* -> decision name
from k3rocm.serving.fusions import NAMES, switches

FUSIONS_OFF = switches(False)
FUSIONS_ON = switches(True)
PLUGINS_DIR_ENV = "K3_TEST_PLUGINS_DIR"  # the test double's host directory, given by the caller
STEP_DELAY_MOUNT = "/opt/k3rocm-test"  # compose.cpu.yaml mounts K3_TEST_PLUGINS_DIR here
# Assumed time to a ready server when no earlier A/B under the results root measured one.
START_GUESS_S = {True: 90.0, False: 1800.0}  # cpu stand-in / MI355X with Kimi-K3


_log = tagged_log("ab")


def sequence(repeats: int) -> list[str]:
    """A B B A A B B A ... with ``repeats`` slots per arm."""
    return [arm for i in range(repeats) for arm in ("AB" if i % 2 == 0 else "BA")]


class OnFlag(Options):
    """``--on``: the fusions arm B asks for (shared with ``k3rocm selftest run``)."""

    on: str = option("all", metavar="FUSIONS", help="fusions asked ON in arm B, the fusions-on "
                     f"server (comma-separated: {', '.join(NAMES)}, or all; default "
                     "%(default)s); the rest stay off in both arms. A base that cannot serve an "
                     "arm is refused before any server starts, naming the fusions it can switch")


add_on_argument = OnFlag.add_arguments


def arm_envs(on: str = "all") -> dict[str, dict[str, str]]:
    """The one builder of arm environments: A every K3_FUSE_* 0, B the fusions ``on`` names 1."""
    names = [x.strip() for x in on.split(",") if x.strip()]
    if names == ["all"]:
        names = list(NAMES)
    bad = [x for x in names if x not in NAMES]
    if bad or not names:
        raise UsageError(f"--on {on!r} must name fusions from {', '.join(NAMES)} (or all)")
    return {"A": switches(False), "B": switches(dict.fromkeys(names, True))}


class ArmFlags(OnFlag):
    """The arm servers' flags, the same for every ``--measure`` (``--gpu``/``--no-gpu``: the
    deployment's, added beside them)."""

    aa: bool = option(False, "A/A mode: both arms identical (measures the noise floor)")
    aa_fusions: Literal["on", "off"] = option("on", "fusion state of both arms in A/A mode")
    calibrate_delay_ms: float | None = option(
        None, "CPU stand-in calibration: both arms as in A/A, arm B with a known injected delay "
        f"of MS per engine step ({STEP_DELAY_ENV}, a test double that compose.cpu.yaml mounts "
        f"from {PLUGINS_DIR_ENV}); the report states injected vs detected", metavar="MS", gt=0,
        le=10000)
    repeats: int | None = option(
        default_factory=lambda: os.environ.get("BENCH_AB_REPEATS") or None, ge=1,
        help="servers per arm, interleaved A B B A ... (env BENCH_AB_REPEATS; default 4 for "
        "bench, 1 for census)")
    image: str | None = option(None, "server image for both arms (default: the deployment's "
                               "K3_IMAGE, shell > .env, else k3rocm/server:latest, "
                               "k3rocm/server:cpu for the CPU stand-in); never pulled")
    port: int | None = option(None, "host port of the arm servers (default: the deployment's "
                              "K3_PORT, shell > .env > profile)", ge=1, le=65535)
    models_dir: str | None = option(None, "host directory mounted at /models (default: the "
                                    "deployment's K3_MODELS_DIR)")
    cache_dir: str | None = option(None, "host directory mounted at /cache (default: the "
                                   "deployment's K3_CACHE_DIR)")
    server_env: list[str] = option(
        default_factory=list, metavar="KEY=VALUE", help="extra server environment for both arms "
        "(repeatable), e.g. K3_PROFILE=cpu-smoke; the shell's and .env's K3_* settings apply too")
    server_timeout: float = option(3600.0, "seconds each fresh server may take to become ready "
                                   "(default %(default)g: loading Kimi-K3 takes many minutes)",
                                   gt=0)
    pin_engine_core: bool = option(
        False, "CPU stand-in: fail (exit 3) unless vLLM's EngineCore is pinned to the worker's "
        "cores (every CPU stand-in server is pinned when ready, so the API server streams per "
        "token; see docs/bench.md)")
    stop_running: bool = option(False, "a server already on --port: stop it first (its log is "
                                "saved, like `make down`) instead of refusing")


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("arm servers (the same for every --measure)")
    ArmFlags.add_arguments(g)
    gpu = g.add_mutually_exclusive_group()
    gpu.add_argument("--gpu", dest="gpu", action="store_true", default=None,
                     help="AMD devices (compose.yaml alone). Default: COMPOSE_FILE (`make ... "
                     "CPU=1`), else K3_PROFILE=cpu-smoke, else /dev/kfd decides")
    gpu.add_argument("--no-gpu", dest="gpu", action="store_false",
                     help="CPU stand-in (adds compose.cpu.yaml)")


def parse_env(items: list[str], flag: str = "--server-env") -> dict[str, str]:
    out = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise UsageError(f"{flag} {item!r}: expected KEY=VALUE")
        if k in FUSIONS_ON:
            raise UsageError(f"{flag} {k}: the fusion toggles are set per arm by the A/B "
                             "driver (use --aa/--on)")
        out[k] = v
    return out


def env_str(env: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(env.items())) or "(none)"


@dataclass
class Arms:
    """The arm servers of one A/B, as the measures see them (they import nothing from here)."""

    env_str = staticmethod(env_str)

    mode: str  # ab | aa | cal
    repeats: int
    arm_env: dict[str, dict[str, str]]
    port: int
    cpu: bool
    image: str | None = None
    models_dir: str | None = None
    cache_dir: str | None = None
    server_env: dict[str, str] = field(default_factory=dict)
    arm_container_env: dict[str, dict[str, str]] = field(default_factory=dict)
    server_timeout: float = 3600.0
    pin_engine_core: bool = False
    stop_running: bool = False
    delay_ms: float | None = None
    scale: Any = None  # k3rocm.deploy.scale.settings.ScaleSettings when K3_SCALE_MODE=replicas
    env_file: str | None = ".env"
    deployment: Any = None  # the command's Deployment (args.deployment): each arm re-renders it
    base: dict[str, Any] | None = None  # check_base's answer, once checked

    @property
    def replica_ports(self) -> list[int]:
        if self.scale is None:
            return [self.port]
        return [self.scale.node_port(i) for i in range(len(self.scale.nodes))]

    @property
    def url(self) -> str:
        """The router (replicas) or the one server."""
        return self.scale.router_url if self.scale is not None else \
            f"http://127.0.0.1:{self.port}"

    def topology(self) -> dict[str, Any]:
        if self.scale is None:
            return {"mode": "single", "servers_per_slot": 1}
        s = self.scale
        return {"mode": "replicas", "servers_per_slot": len(s.nodes), "nodes": list(s.nodes),
                "router": s.router_url, "router_image": s.router_image,
                "router_policy": s.router_policy}

    def slots(self) -> list[str]:
        return sequence(self.repeats)

    def compose_env(self, arm: str, port: int | None = None) -> dict[str, str]:
        env = {**self.server_env, **self.arm_env[arm], "K3_PORT": str(port or self.port)}
        if self.image:
            env["K3_IMAGE"] = self.image
        dirs = {"K3_MODELS_DIR": self.models_dir, "K3_CACHE_DIR": self.cache_dir}
        env.update({k: str(Path(v).resolve()) for k, v in dirs.items() if v})
        return env

    def describe_env(self) -> dict[str, str]:
        """The server settings both arms share (what the protocol key covers)."""
        return {k: v for k, v in self.compose_env("A").items()
                if k not in FUSIONS_ON and k != "K3_PORT"}


def arms_from_args(args: argparse.Namespace, single: tuple[str, str] | None = None) -> Arms:
    """The arm settings from the shared flags (bad input: exit 2). ``single``: (command, why)
    of a measure with one server per arm, order A B."""
    o = ArmFlags.from_args(args)
    if single and (o.aa or o.calibrate_delay_ms is not None):
        raise UsageError(f"--aa and --calibrate-delay-ms are for --measure bench ({single[1]})")
    if single and o.repeats != 1:
        raise UsageError(f"--repeats {o.repeats}: {single[0]} runs one server per arm (order "
                         f"A B; {single[1]}): use --repeats 1")
    env = parse_env(o.server_env)
    env_file = getattr(args, "env_file", ".env")
    # The deployment, once: the shell, .env and --server-env, with --gpu/--no-gpu.
    dep = args.deployment.with_env(**env)
    envs = arm_envs(o.on)
    on, off = envs["B"], envs["A"]
    container_env: dict[str, dict[str, str]] = {"A": {}, "B": {}}
    delay = o.calibrate_delay_ms
    if delay is not None:
        if o.aa:
            raise UsageError("--calibrate-delay-ms and --aa exclude each other (calibration "
                             "is an A/A with a known delay in arm B)")
        if not dep.cpu:
            raise UsageError("--calibrate-delay-ms exists only for the CPU stand-in "
                             "(--no-gpu): the delay switch is never in the serving image")
        plugins = {**os.environ, **env}.get(PLUGINS_DIR_ENV, "")
        if not Path(plugins or "/nonexistent").is_dir():
            raise UsageError(f"--calibrate-delay-ms needs the step-delay test double: set "
                             f"{PLUGINS_DIR_ENV} to its directory (now "
                             f"{plugins or 'unset'}; compose.cpu.yaml mounts it)")
        container_env["B"] = {STEP_DELAY_ENV: f"{delay:g}", "PYTHONPATH": STEP_DELAY_MOUNT}
    if delay is not None or o.aa:  # calibration: an A/A with the delay in arm B
        same = on if o.aa_fusions == "on" else off
        arm_env, mode = {"A": dict(same), "B": dict(same)}, "aa" if delay is None else "cal"
    else:
        arm_env, mode = {"A": off, "B": on}, "ab"
    models_dir = o.models_dir or str(dep.models_dir)
    source = dep.sources.get("K3_MODELS_DIR", "default")
    given = "--models-dir" if o.models_dir else \
        f"K3_MODELS_DIR (from {'the shell' if source == 'env' else source})"
    if (o.models_dir or source != "default") and not args.dry_run and \
            not Path(models_dir).is_dir():
        raise UsageError(f"{given} {models_dir!r} does not exist (it is mounted at /models in "
                         "the server)")
    scale = _replicas(env_file)
    if single and scale is not None:
        raise UsageError(f"{single[0]} runs one server per arm: unset K3_SCALE_MODE (or set it "
                         "to single)")
    return Arms(mode=mode, repeats=o.repeats, arm_env=arm_env, port=o.port or dep.port,
                cpu=dep.cpu, image=o.image or dep.image, models_dir=models_dir,
                cache_dir=o.cache_dir or str(dep.cache_dir), server_env=env,
                arm_container_env=container_env, server_timeout=o.server_timeout,
                pin_engine_core=o.pin_engine_core, stop_running=o.stop_running, delay_ms=delay,
                scale=scale, env_file=env_file, deployment=args.deployment)


LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def _replicas(env_file: str):
    """The scale settings when K3_SCALE_MODE=replicas (nodes on this host), else None."""
    from k3rocm.deploy.scale.settings import load_scale

    s = load_scale(dotenv=env_file)
    if s.mode == "single":
        return None
    if s.mode != "replicas":
        raise UsageError(f"K3_SCALE_MODE={s.mode}: the A/B runs on single servers or on "
                         "replicas behind the router (K3_SCALE_MODE=replicas)")
    remote = [n for i, n in enumerate(s.nodes) if s.node_host(i) not in LOCAL_HOSTS]
    if remote:
        raise UsageError(f"K3_SCALE_NODES has nodes on other hosts ({', '.join(remote)}): "
                         "the A/B starts every replica itself, on this host (127.0.0.1:PORT); "
                         "on a cluster run `make bench-router` per arm instead")
    if len(set(s.nodes)) != len(s.nodes):
        raise UsageError("K3_SCALE_NODES lists a node twice")
    return s


def estimate(arms: Arms, results: Path, runs_per_slot: int = 1) -> tuple[float, str]:
    """(seconds, how): cold starts x time to ready plus the runs, from earlier A/B runs under
    ``results`` (else a stated assumption)."""
    ready: list[float] = []
    run_s: list[float] = []
    for path in sorted(results.glob("*/comparison.json"))[-10:]:
        with contextlib.suppress(OSError, json.JSONDecodeError, TypeError, AttributeError):
            doc = json.loads(path.read_text())
            ready += [s["server_ready_s"] for s in doc.get("slots", []) if s.get("server_ready_s")]
            run_s += [r["seconds"] for r in doc.get("runs", []) if r.get("seconds")]
    starts = len(arms.slots())
    if ready:
        per_start, how = statistics.median(ready), f"median of {len(ready)} earlier starts"
    else:
        per_start = START_GUESS_S[arms.cpu]
        how = f"assumed {per_start:.0f}s per start ({'CPU stand-in' if arms.cpu else 'GPU'})"
    total = starts * per_start
    if run_s:
        total += starts * runs_per_slot * statistics.median(run_s)
        how += f"; runs: median of {len(run_s)} earlier runs"
    else:
        how += "; plus the measurement runs (no earlier run to time them by)"
    return total, how


def check_port(arms: Arms) -> None:
    """Refuse (exit 2) when something serves --port, unless --stop-running stops the compose
    server (log saved first)."""
    busy = [p for p in arms.replica_ports if answers(f"http://127.0.0.1:{p}")]
    if arms.scale is not None and answers(arms.scale.router_url):
        raise UsageError(f"a router already answers at {arms.scale.router_url}: the A/B "
                         "starts its own; stop it with `make router-down`")
    if not busy:
        return
    if arms.scale is not None and not arms.stop_running:
        raise UsageError(f"a server already runs on port(s) {', '.join(map(str, busy))} of "
                         "K3_SCALE_NODES: the A/B starts its own replicas there; stop them "
                         "(`make down` on each) or pass --stop-running")
    url = f"http://127.0.0.1:{busy[0]}"
    if busy[0] != arms.port:
        raise UsageError(f"a server already runs on {url}: stop it first")
    if not arms.stop_running:
        raise UsageError(f"a server already runs on port {arms.port} ({url}): the A/B starts "
                         "its own fresh servers there; stop it with `make down` or pass "
                         "--stop-running (or use another --port)")
    dep = arms.deployment
    srv = compose_server(dep)
    if srv.state() is None:
        raise UsageError(f"--stop-running: what answers on {url} is not the compose server "
                         f"of project {srv.project}; stop it yourself or use another --port")
    out = create_run_dir(dep.results_root, "server-log")
    _log(f"--stop-running: stopping compose project {srv.project} (log in {out})")
    srv.down(log_path=out / "server.log")
    t0 = time.time()
    while answers(url):
        if time.time() - t0 > 60:
            raise UsageError(f"{url} still answers after stopping {srv.project}", 3)
        time.sleep(1)


def slot_lines(arms: Arms, slot: int, arm: str) -> list[str]:
    """The dry run's lines of one slot's server(s)."""
    env = {**arms.compose_env(arm), **arms.arm_container_env.get(arm, {})}
    out = [f"# slot {slot} arm {arm}: compose up (server) with {env_str(env)}"]
    if arms.scale is not None:
        from k3rocm.deploy.scale.render import router_argv

        out.append(f"#   replicas on ports {arms.replica_ports} (K3_PORT each), then the "
                   f"router: {' '.join(router_argv(arms.scale))}")
    return out


@dataclass
class Run:
    """One A/B run past the shared checks: Docker client, image, model, API key, run directory."""

    arms: Arms
    client: Any
    image: str
    image_id: str
    model: str
    api_key: str | None
    dir: Path

    @contextlib.contextmanager
    def server(self, slot: int, arm: str, log_path: Path
               ) -> Iterator[tuple[ComposeServer, dict]]:
        """Fresh server(s) for one slot (one compose project per replica, the router for replicas):
        yield (first server, info); always save every log and remove what was started."""
        arms, model, api_key, client = self.arms, self.model, self.api_key, self.client
        base = f"k3ab-{self.dir.name.split('-')[0].lower()}-{slot:02d}{arm.lower()}"
        one = len(arms.replica_ports) == 1
        servers = [ComposeServer(
            project=base if one else f"{base}-r{r}", cpu=arms.cpu, env=arms.compose_env(arm, port),
            # --server-env reaches the container whether compose.yaml lists it or not
            container_env={**arms.server_env, **arms.arm_container_env.get(arm, {})},
            url=f"http://127.0.0.1:{port}", model=model, api_key=api_key,
            env_dir=self.dir / "servers")
            for r, port in enumerate(arms.replica_ports)]
        # the arm's own deployment: what each measure's run record says was served
        info: dict = {"server": base, "server_ready_s": None, "pin": None,
                      "topology": arms.topology(), "replicas": [s.project for s in servers],
                      "deployment": arm_deployment(arms, arm)}
        logs = [log_path if one else log_path.with_name(f"{log_path.stem}-r{r}{log_path.suffix}")
                for r in range(len(servers))]
        router = None
        try:
            t0 = time.time()
            for srv, log in zip(servers, logs, strict=True):  # all start, then each is waited for
                srv.up(log_path=log)
            for srv, log in zip(servers, logs, strict=True):
                srv.wait(arms.server_timeout, every=15, log_path=log)
            info["server_ready_s"] = round(time.time() - t0, 1)
            # wait() pins every CPU stand-in's EngineCore; --pin-engine-core makes it a must.
            pins = [srv.pinned for srv in servers]
            if arms.pin_engine_core and not all(pins):
                raise UsageError(f"--pin-engine-core: the EngineCore of {base} could not be "
                                 "pinned (see the warning above)", 3)
            info["pin"] = "; ".join(p for p in pins if p) or None
            if info["pin"]:
                _log(info["pin"])
            if arms.scale is not None:
                from k3rocm.deploy.scale.router import start_router, stop_router

                router = start_router(client, arms.scale, name=f"{base}-router",
                                      labels={"k3rocm.ab": base})
                wait_ready(arms.url, model, 120, api_key, every=15)
            yield servers[0], info
        finally:
            if router is not None:
                with contextlib.suppress(Exception):
                    write_bytes_atomic(log_path.with_name(f"{log_path.stem}-router.log"),
                                       router.logs())
                with contextlib.suppress(Exception):
                    stop_router(client, f"{base}-router")
            for srv, log in zip(servers, logs, strict=True):
                srv.down(log_path=log)

    def each_slot(self, log_path: Callable[[int, str], Path],
                  measure: Callable[[int, str, ComposeServer, dict], bool | None],
                  keep_going: bool = False) -> list[dict[str, Any]]:
        """The one A/B loop: ``measure(slot, arm, server, info)`` on a fresh server per slot (False:
        stop), one record per slot. A failure or Ctrl-C is raised again, unless ``keep_going``: then
        the loop ends and the measure judges what finished."""
        out: list[dict[str, Any]] = []
        for i, arm in enumerate(self.arms.slots()):
            env = {**self.arms.arm_env[arm], **self.arms.arm_container_env.get(arm, {})}
            _log(f"slot {i + 1}/{len(self.arms.slots())} arm {arm}: starting a fresh server "
                 f"({env_str(env)})")
            rec: dict[str, Any] = {"slot": i, "arm": arm, "server": None, "server_ready_s": None}
            t0, go_on, error = time.time(), True, None
            try:
                with self.server(i, arm, log_path(i, arm)) as (srv, info):
                    rec.update(server=info["server"], server_ready_s=info["server_ready_s"])
                    go_on = measure(i, arm, srv, info) is not False
            except (KeyboardInterrupt, UsageError) as exc:
                if not keep_going:
                    raise
                error = str(exc) if isinstance(exc, UsageError) else "interrupted"
                _log(f"slot {i} failed: {error}")
            out.append({**rec, "fusions": fusion_states(log_path(i, arm)),
                        "seconds": round(time.time() - t0, 1), "error": error})
            if error or not go_on:
                break
        return out


def start(arms: Arms, results: Path, label: str, runs_per_slot: int = 1,
          client_image: str | None = None, dep=None) -> Run:
    """The shared start of every measure: both arms checked against the image's base facts, the
    port free, the images present, the cold starts announced; then the run directory."""
    base = check_base(arms)
    check_port(arms)
    client = docker_client()
    dep = dep or arm_deployment(arms)
    ref = dep.image  # the arm servers' image (--image, else K3_IMAGE, else compose's default)
    iid = engine_image_id(client, ref, "server image", "build it (make build) or pass --image")
    if client_image:
        engine_image_id(client, client_image)
    secs, how = estimate(arms, results, runs_per_slot)
    slots, per = len(arms.slots()), len(arms.replica_ports)
    where = (f", {per} replicas per slot behind the router {arms.scale.router_url}"
             if arms.scale is not None else "")
    _log(f"{arms.mode.upper()}: {slots * per} cold server start(s) in the order "
         f"{' '.join(arms.slots())}{where}, {slots * runs_per_slot} run(s); estimated "
         f"{secs / 60:.1f} min ({how})")
    _log(f"base facts from {base['facts_from']}: " + (
        f"arm(s) {', '.join(base['arms'])} can be served" if base["arms"] else
        "each arm server checks them at start"))
    run = Run(arms, client, ref, iid, dep.served_model_name, dep.api_key,
              create_run_dir(results, label))
    _log(f"run directory {run.dir}")
    return run


def arm_deployment(arms: Arms, arm: str = "B"):
    """The deployment arm ``arm``'s servers run, as compose and the entrypoint see it."""
    return arms.deployment.with_env(**arms.compose_env(arm))


def base_check(arm_env: dict[str, dict[str, str]], environ: Mapping[str, str],
               env_file: str | None, image: str, profile: str) -> dict[str, Any]:
    """Every arm rendered against the base facts recorded in ``image`` (as `make config` does),
    before anything starts. A refused arm: one line, exit 2, with the ``--on`` choices this base
    can serve. Facts unknown: each server checks at start. Returns {"facts_from", "arms"}."""
    from k3rocm.deploy.config_cmd import image_base_facts
    from k3rocm.serving.config import render

    facts, where = image_base_facts(image)
    if facts is None:
        return {"facts_from": where, "arms": {}}
    common = {**{k: v for k, v in environ.items() if k not in FUSIONS_ON},
              "K3_PROFILE": profile}

    def refused(switch_env: dict[str, str]) -> tuple[str | None, dict | None]:
        try:
            r = render({**common, **switch_env}, env_file, check_model=False, base=facts)
        except UsageError as exc:
            return str(exc), None
        return None, r.base

    out: dict[str, Any] = {"facts_from": where, "arms": {}}
    for arm in sorted(arm_env):
        why, base = refused(arm_env[arm])
        if why is None:
            out["arms"][arm] = base
            for note in (base or {}).get("notes") or []:
                if note.startswith("WARNING"):
                    _log(f"arm {arm}: {note}")
            continue
        ver = (facts.get("vllm_version") or {}).get("value") or "?"
        plain = refused({})[0]  # the servers' own settings, whatever the arm switches
        if plain is not None:
            raise UsageError(f"every arm (the servers' own settings, not the fusion switches) "
                             f"cannot be served by this base (vLLM {ver}; facts from {where}): "
                             f"{plain}; no server was started")
        if refused(arm_envs()["A"])[0] is not None:  # the off arm itself: no --on helps
            offer = "no --on choice helps: this base refuses the fusions-off arm"
        else:
            ok = [n for n in NAMES if refused(switches({n: True}))[0] is None]
            if len(ok) > 1 and refused(switches(dict.fromkeys(ok, True)))[0] is None:
                ok = [",".join(ok)]
            offer = ("this base can switch: " + " or ".join(f"--on {n}" for n in ok)) if ok \
                else "this base can switch none of the fusions (" + ", ".join(NAMES) + ")"
        raise UsageError(f"arm {arm} ({env_str(arm_env[arm])}) cannot be served by this base "
                         f"(vLLM {ver}; facts from {where}): {why}; {offer}; no server was started")
    return out


def check_base(arms: Arms) -> dict[str, Any]:
    """:func:`base_check` for the arm servers, once per A/B (kept on ``arms.base``)."""
    if arms.base is None:
        dep = arm_deployment(arms, "A")
        arms.base = base_check({a: arms.arm_env[a] for a in sorted(set(arms.slots()))},
                               {**os.environ, **arms.compose_env("A")}, arms.env_file,
                               dep.image, dep.settings.profile)
    return arms.base


def fusion_states(log_path: Path) -> dict[str, list[str]] | None:
    """Each fusion's final states over the target (MLA) layers, from the overlay's decision
    records in the saved server log (None: none)."""
    try:
        recs = decisions.records_from_log(log_path.read_text(errors="replace"), log_path.name)
    except (OSError, UsageError):
        return None
    final = [r for r in decisions.final_decisions(recs).values() if r.layer_kind == "target"]
    if not final:
        return None
    return {f: sorted({r.states[f] for r in final}) for f in decisions.STATES}


def fusion_check(slots: Sequence[dict], arm_env: dict[str, dict[str, str]]
                 ) -> tuple[list[str], list[str]]:
    """(problems, refusals): one line per slot whose fusions are not what its arm asked; the
    refusals are those where the overlay decided otherwise (no records is only unverified)."""
    out = []
    for s in slots:
        states = s.get("fusions")
        if states is None:
            out.append(f"slot {s['slot']} (arm {s['arm']}): no overlay decision records in its "
                       "server log (fusion state unverified)")
            continue
        for env, fusion in FUSION_OF.items():
            asked = arm_env[s["arm"]].get(env) == "1"
            got = states.get(fusion, [])
            if (asked and got != ["on"]) or (not asked and "on" in got):
                out.append(f"slot {s['slot']} (arm {s['arm']}): {fusion} asked "
                           f"{'on' if asked else 'off'}, the overlay decided "
                           f"{'/'.join(got) or 'nothing'}")
    return out, [p for p in out if "the overlay decided" in p]
