"""``k3rocm selftest``: before the 1.5 TB load, prove the real serving path on a small model.

- ``k3rocm selftest model [SRC] [OUT]``: cut a small Kimi-K3-shaped checkpoint from the
  operator's own one (:mod:`k3rocm.deploy.selftest_model`; default OUT
  ``<K3_MODELS_DIR>/Kimi-K3-selftest``).
- ``k3rocm selftest run``: serve a small checkpoint the way ``make up`` serves the real one
  (the same settings, profile, image and compose service, rendered by
  :func:`k3rocm.deploy.deployment.load_deployment`), with only ``K3_MODEL`` and ``K3_PORT``
  changed, in its own compose project; wait until it is ready; write the run record; stop it
  and keep its log. Run directory ``<results>/<UTC>-selftest/``: ``provenance.json`` (written
  first, then again with the server's provenance), ``server.log``, ``summary.json``. The server
  is stopped at the end, on errors and on Ctrl-C / SIGTERM (exit 130). The checks against the
  served model (kernel census, greedy tokens with the fusions off vs on, a bench point) are
  the next steps of ``make selftest``.

Exit codes: 0 ok, 2 bad input (nothing started), 3 the server did not come up, 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
from pathlib import Path

from k3rocm.deploy import selftest_model
from k3rocm.errors import UsageError

PROJECT = "k3rocm-selftest"


def _log(msg: str) -> None:
    print(f"[selftest] {msg}", file=sys.stderr, flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = p.add_subparsers(dest="what", metavar="{model,run}", required=True)
    m = sub.add_parser(
        "model", help="write a small Kimi-K3-shaped checkpoint (few layers and experts)",
        description="Cut a small checkpoint with the real tensor names, dtypes, shapes and "
        "quantization layout from a Kimi-K3 checkpoint, reading only config.json, the "
        "safetensors index and the shard headers (values are random). Keeps layers in the real "
        "order (at least one MLA and one KDA layer), the MTP layer, and the first experts; "
        "writes OUT atomically.")
    selftest_model.add_arguments(m)
    r = sub.add_parser(
        "run", help="serve a small checkpoint as `make up` serves the real one, then stop",
        description="Serve the small checkpoint with the deployment's settings (profile, "
        "image, compose service), only K3_MODEL and K3_PORT changed, in its own compose "
        "project; wait until ready; record; stop and keep the log.")
    r.add_argument("--model", default=None,
                   help="the small checkpoint: a /models/... path or a host directory under "
                   f"K3_MODELS_DIR (default: /models/{selftest_model.DEFAULT_OUT}; on the CPU "
                   "stand-in the deployment's own K3_MODEL)")
    r.add_argument("--port", type=int, default=None,
                   help="host port of the selftest server (default: the deployment's K3_PORT "
                   "+ 1)")
    r.add_argument("--project", default=PROJECT, help=f"compose project (default {PROJECT})")
    r.add_argument("--timeout", type=float, default=1800,
                   help="seconds to wait for the server (default 1800)")
    r.add_argument("--no-build", action="store_true",
                   help="do not build the serving image first (it must exist)")
    r.add_argument("--env-file", default=".env", help="settings file (default .env)")


def run(args: argparse.Namespace) -> int:
    if args.what == "model":
        return selftest_model.run(args)
    return serve(args)


def deployment_view(args: argparse.Namespace) -> dict:
    """What ``--print-deployment`` shows: the selftest server's deployment for ``run``."""
    from k3rocm.deploy.deployment import load_deployment

    if args.what != "run":
        return load_deployment(env_file=args.env_file).to_json()
    dep, srv = _plan(args, check_model=False)
    return {**dep.to_json(), "project": srv.project}


def _plan(args: argparse.Namespace, check_model: bool = True):
    """The selftest server: (deployment, ComposeServer). Bad input raises UsageError (exit 2)
    before anything starts."""
    import os

    from k3rocm.deploy.deployment import load_deployment
    from k3rocm.deploy.lifecycle import ComposeServer, cpu_from_environment

    if args.timeout <= 0:
        raise UsageError(f"--timeout {args.timeout:g} must be > 0")
    base = load_deployment(env_file=args.env_file)
    cpu = cpu_from_environment()
    model = args.model or (base.model if cpu else f"/models/{selftest_model.DEFAULT_OUT}")
    if not model.startswith("/models"):
        inside = base.container_path(Path(model).expanduser().resolve())
        if inside is None or not inside.startswith("/models"):
            raise UsageError(f"--model {model}: not under K3_MODELS_DIR ({base.models_dir}), "
                             "so the server container cannot see it")
        model = inside
    port = args.port if args.port is not None else base.port + 1
    if not 1 <= port <= 65535:
        raise UsageError(f"--port {port}: must be 1..65535")
    if port == base.port:
        raise UsageError(f"--port {port} is the deployment's own port: the selftest server "
                         "needs its own")
    env = {"K3_MODEL": model, "K3_PORT": str(port)}
    # the same settings as `make up` (shell > .env > profile > default), these two changed
    dep = load_deployment({**os.environ, **env}, env_file=args.env_file,
                          check_model=check_model)
    srv = ComposeServer(project=args.project, cpu=cpu, env=env, url=dep.url,
                        model=dep.served_model_name, api_key=dep.api_key)
    return dep, srv


def serve(args: argparse.Namespace) -> int:
    from k3rocm.deploy import runrecord
    from k3rocm.rundir import create_run_dir, write_json_atomic

    dep, srv = _plan(args)
    run_dir = create_run_dir(dep.results_root, "selftest")
    runrecord.write(run_dir, runrecord.build(deployment=dep, url=dep.url, selftest={
        "project": srv.project, "model": dep.model}))
    summary: dict = {"run_dir": str(run_dir), "project": srv.project, "url": dep.url,
                     "model": dep.model, "profile": dep.profile, "image": dep.image,
                     "server_ready_s": None, "result": "interrupted"}
    _log(f"run directory {run_dir}; compose project {srv.project}, {dep.model} on {dep.url} "
         f"(profile {dep.profile}, image {dep.image})")

    def _stop(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, _stop)
    t0 = time.time()
    try:
        srv.up(build=not args.no_build)
        summary["server_ready_s"] = round(srv.wait(args.timeout), 1)
        runrecord.write(run_dir, runrecord.build(deployment=dep, url=dep.url,
                                                 server=srv.provenance(), selftest={
                                                     "project": srv.project,
                                                     "model": dep.model}))
        summary["result"] = "served"
        return 0
    except UsageError as exc:
        summary["result"] = f"failed: {exc}"
        raise
    finally:
        signal.signal(signal.SIGTERM, old)
        _log(f"stopping {srv.project} (log: {run_dir / 'server.log'})")
        with contextlib.suppress(Exception):
            srv.down(log_path=run_dir / "server.log")
        summary["seconds"] = round(time.time() - t0, 1)
        write_json_atomic(run_dir / "summary.json", summary)
        _log(f"{summary['result']}; server ready after {summary['server_ready_s']} s; "
             f"{summary['seconds']} s in all; {run_dir}")
