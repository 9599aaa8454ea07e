"""``k3rocm census``: prove from the server's profiler trace which fused kernels run, how often.

Live: against a running server started with the profiler (K3_PROFILER_DIR), drive a
decode-heavy streaming load, profile a few decode steps, collect every rank's trace into
``results/<UTC>-census/``, count launches per step and judge them against what the server was
ASKED for (K3_FUSE_* in the server container's env, default on; or ``--fusions``), the model
config and the trace. The overlay's decision records are cross-checked against the same claim.
Offline: ``--trace-dir DIR`` analyses existing traces (no server).

The server URL, API key, served model name, checkpoint (K3_MODEL under K3_MODELS_DIR) and
results root come from the deployment settings (shell > .env > profile); flags override them.

Exit codes: 0 all checks pass, 1 a check failed, 2 bad input, 3 server/trace problems or no
Docker engine, 4 incomplete trace (lost kernel events or ranks: nothing judged), 130
interrupted.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from k3rocm.checks.census.analyze import Census, run_census
from k3rocm.checks.census.common import (
    add_analysis_arguments,
    base_provenance,
    extra_from,
    model_dir_from,
    normalizer_from,
    positive,
    resolve_world_size,
    results_root,
)
from k3rocm.checks.census.complete import CAUSES
from k3rocm.checks.census.decisions import Decisions
from k3rocm.checks.census.fusions import FusionClaim, from_cli, from_env
from k3rocm.checks.census.modelcfg import read_model_facts
from k3rocm.checks.census.spec import load_spec
from k3rocm.checks.census.trace import load_trace_dir
from k3rocm.deploy import runrecord
from k3rocm.errors import UsageError
from k3rocm.rundir import create_run_dir, write_json_atomic, write_text_atomic
from k3rocm.serving.decisions import decision_files, records_from_files, records_from_log
from k3rocm.serving.fusions import FUSIONS


def _log(msg: str) -> None:
    print(f"[census] {msg}", file=sys.stderr, flush=True)


FUSIONS_METAVAR = ",".join(f"{f.name}=on|off" for f in FUSIONS)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    p.add_argument("--trace-dir", help="analyse the traces in this directory instead of "
                   "driving a server")
    p.add_argument("--fusions", metavar=FUSIONS_METAVAR,
                   help="what the server was asked for (default: "
                   f"{' / '.join(f.env for f in FUSIONS)} in the server container's env, "
                   "unset = on; offline: the run's provenance.json beside the trace directory)")
    p.add_argument("--server-log", metavar="FILE", help="server log holding the overlay's "
                   "'K3ROCM-DECISION {...}' records (default: k3rocm-decisions-pid*.json "
                   "beside the traces, or the server container's log)")
    s = p.add_argument_group("live server")
    s.add_argument("--url", default=None, help="server base URL (default: from "
                   "K3_BIND_ADDRESS and K3_PORT)")
    s.add_argument("--model", help="served model name (default: the first in /v1/models, "
                   "else K3_SERVED_MODEL_NAME)")
    s.add_argument("--container", help="server container name/id (default: the container "
                   "publishing the URL's port); used for the log, provenance and traces")
    s.add_argument("--server-trace-dir", help="host path of the server's K3_PROFILER_DIR "
                   "(default: the server container's mount of it; without a container, "
                   "mapped through K3_RESULTS_DIR when it lies under /results; "
                   "else the traces are copied out of the container)")
    s.add_argument("--concurrency", type=int, default=8, help="concurrent streams")
    s.add_argument("--max-tokens", type=int, default=1024, help="output tokens per request")
    s.add_argument("--prompt-words", type=int, default=64, help="prompt length (words)")
    s.add_argument("--steps", type=int, default=6, help="decode steps to profile (the server's"
                   " max_iterations may stop it earlier)")
    s.add_argument("--server-timeout", type=float, default=60.0,
                   help="seconds to wait for /health")
    s.add_argument("--trace-timeout", type=float, default=900.0,
                   help="seconds to wait for the trace files after /stop_profile")
    s.add_argument("--label", default="census", help="run directory label")
    add_analysis_arguments(p)


# -- helpers used by census-ab too ------------------------------------------------------------

def analyse(trace_dir: Path, args: argparse.Namespace, claim: FusionClaim,
            decisions: Decisions | None, files: list[Path] | None = None,
            server_argv: list[str] | None = None) -> Census:
    model = read_model_facts(model_dir_from(args))
    norm = normalizer_from(args)
    extra = extra_from(args)
    traces = load_trace_dir(trace_dir, norm, args.mode, files)
    world, world_src = resolve_world_size(traces.world_size, args, server_argv)
    platform = args.platform
    if platform == "auto":
        platform = "rocm" if any(r.mode == "gpu" for r in traces.ranks) else "cpu"
    spec = load_spec(platform, model.model_type, args.spec, args.other_norms)
    return run_census(traces, model, claim, spec, decisions, world, world_src,
                      args.min_decode_steps, extra)


NO_RECORDS = "k3rocm-decisions-none.json"  # beside traces: the server log held no record


def read_decisions(args: argparse.Namespace, trace_dir: Path | None = None,
                   container: Any = None) -> Decisions | None:
    """The overlay's records: --server-log, else the JSON files beside the traces, else the
    server container's log. None when --skip-records."""
    if args.skip_records:
        return None
    if getattr(args, "server_log", None):
        text = Path(args.server_log).read_text(errors="replace")
        return Decisions(records_from_log(text, f"server log {args.server_log}"),
                         f"server log {args.server_log}")
    if trace_dir is not None and trace_dir.is_dir():
        files = decision_files(trace_dir)
        if files:
            return Decisions(records_from_files(files),
                             f"{len(files)} decision file(s) in {trace_dir}")
        marker = trace_dir / NO_RECORDS
        if marker.is_file():  # a live census read the server's log and found none
            try:
                src = str(json.loads(marker.read_text()).get("source", "the server log"))
            except (OSError, ValueError, AttributeError):
                raise UsageError(f"{marker} is not valid JSON; remove it or re-run") from None
            return Decisions([], f"{src} (read when the traces were collected; {marker})")
    if container is not None:
        src = f"the log of container {container.name}"
        return Decisions(records_from_log(container.logs().decode(errors="replace"), src), src)
    where = f"{trace_dir}" if trace_dir is not None else "the server"
    return Decisions([], f"k3rocm-decisions-pid*.json in {where}; no --server-log, no server "
                     "container", found=False)


def claim_offline(args: argparse.Namespace, trace_dir: Path) -> FusionClaim:
    """--fusions, else the server env recorded in the run's provenance.json (written by a live
    census beside its traces/ directory)."""
    if args.fusions:
        return from_cli(args.fusions)
    for cand in (trace_dir / "provenance.json", trace_dir.parent / "provenance.json"):
        if not cand.is_file():
            continue
        try:
            prov = __import__("json").loads(cand.read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"{cand} is not valid JSON ({exc.__class__.__name__})") from None
        server = prov.get("server", prov) if isinstance(prov, dict) else None
        cont = server.get("container") if isinstance(server, dict) else None
        env = cont.get("env") if isinstance(cont, dict) else None
        if isinstance(env, dict):
            return from_env(env, f"the server env recorded in {cand}")
    raise UsageError(f"what the server was asked for is unknown: pass --fusions "
                     f"{FUSIONS_METAVAR} (no provenance.json with the server's "
                     f"env beside {trace_dir})")


def write_report(run_dir: Path, census: Census, provenance: dict[str, Any],
                 title: str = "Decode kernel census", top: int = 25) -> None:
    write_json_atomic(run_dir / "census.json", {**census.to_json(), "provenance": provenance})
    seed = (provenance.get("seed_comparison") or {}).get("text")
    write_text_atomic(run_dir / "census.md", census.markdown(title, top)
                      + (f"\n## Upstream figures\n\n{seed}\n" if seed else "")
                      + "\n## Provenance\n\n```json\n"
                      + __import__("json").dumps(provenance, indent=2, default=str)[:20000]
                      + "\n```\n")
    write_json_atomic(run_dir / "provenance.json", provenance)


def validate_common(args: argparse.Namespace) -> None:
    """Everything that can be checked before any expensive work."""
    positive("--min-decode-steps", args.min_decode_steps, 0)
    read_model_facts(model_dir_from(args))
    normalizer_from(args)
    extra_from(args)
    load_spec("rocm" if args.platform == "auto" else args.platform, None, args.spec,
              args.other_norms)
    if getattr(args, "fusions", None):
        from_cli(args.fusions)
    if getattr(args, "server_log", None) and not Path(args.server_log).is_file():
        raise UsageError(f"--server-log {args.server_log} does not exist")
    if getattr(args, "world_size", None) is not None:
        positive("--world-size", args.world_size)


def _finish(census: Census, run_dir: Path | None, top: int) -> int:
    for x in census.traces.skipped_runs:
        print(f"census: skipped {x['why']}: started {x['started']}, ranks "
              f"{', '.join(map(str, x['ranks']))} ({len(x['files'])} file(s))")
    print(census.table())
    print()
    print(census.report_table())
    bad = [c for c in census.checks if c.ok is False]
    if census.incomplete:
        for line in census.incomplete_lines():
            print(f"census: lost: {line}")
        verdict = (f"INCOMPLETE TRACE ({len(census.incomplete)} loss(es); the fusions were not "
                   f"judged; {CAUSES})")
    elif census.ok:
        verdict = "PASS"
        if census.decisions is not None and not census.decisions.found:
            verdict += (" (the overlay's decision records were not cross-checked: none found; "
                        "pass --server-log FILE or --skip-records)")
    else:
        verdict = f"FAIL ({len(bad)} failed: {'; '.join(sorted({c.what for c in bad}))[:300]})"
    print(f"census: {verdict}")
    if run_dir is not None:
        print(f"census: report in {run_dir}/census.md")
    return census.exit_code


def _deployment_args(args: argparse.Namespace):
    """The deployment; the server URL defaults to its URL (results root and checkpoint dir:
    :func:`results_root`, :func:`model_dir_from`)."""
    from k3rocm.deploy.deployment import load_deployment

    dep = load_deployment()
    if getattr(args, "url", None) is None:
        args.url = dep.url
    return dep


def deployment_view(args: argparse.Namespace) -> dict:
    """What this command resolved (``--print-deployment``)."""
    dep = _deployment_args(args)
    try:
        model_dir: str | None = str(Path(model_dir_from(args)).absolute())
    except UsageError:
        model_dir = None
    return {**dep.to_json(), "url": args.url.rstrip("/"),
            "served_model_name": args.model or dep.served_model_name,
            "results_root": str(Path(results_root(args)).absolute()),
            "model_host_dir": model_dir}


def run(args: argparse.Namespace) -> int:
    dep = _deployment_args(args)
    validate_common(args)
    if args.trace_dir:
        tdir = Path(args.trace_dir)
        if not tdir.is_dir():
            raise UsageError(f"--trace-dir {tdir} does not exist or is not a directory")
        claim = claim_offline(args, tdir)
        decisions = read_decisions(args, tdir)
        census = analyse(tdir, args, claim, decisions)
        run_dir = create_run_dir(results_root(args), args.label)
        files = [r.path for r in census.traces.ranks]
        write_report(run_dir, census, runrecord.build(
            deployment=dep, source="trace-dir", trace_dir=str(args.trace_dir),
            claim=claim.to_json(), trace_files=base_provenance(files)["trace_files"]),
            top=args.top)
        return _finish(census, run_dir, args.top)
    return run_live(args, dep)


def _server_trace_host_dir(args: argparse.Namespace, container: Any,
                           container_env: dict[str, str]) -> Path | None:
    """Host directory where the server's K3_PROFILER_DIR lands, or None (copy out of the
    container). Explicit --server-trace-dir wins; then the container's own bind mounts; without
    a container, /results/... is mapped through K3_RESULTS_DIR."""
    if args.server_trace_dir:
        d = Path(args.server_trace_dir)
        if not d.is_dir():
            raise UsageError(f"--server-trace-dir {d} is not a directory")
        return d
    prof = container_env.get("K3_PROFILER_DIR") or ("" if container is not None else
                                                    _deployment_profiler_dir())
    if not prof:
        return None
    if container is not None:
        best = None
        for m in container.attrs.get("Mounts") or []:
            dest = str(m.get("Destination", "")).rstrip("/")
            if dest and (prof == dest or prof.startswith(dest + "/")) and \
                    (best is None or len(dest) > len(best[0])):
                best = (dest, str(m.get("Source", "")))
        if best is None:
            return None
        if not Path(best[1]).is_dir():
            return None  # the engine's host is not this host: copy out of the container
        host = Path(best[1]) / prof[len(best[0]):].lstrip("/")
        try:
            host.mkdir(parents=True, exist_ok=True)
        except OSError:
            return None
        return host
    from k3rocm.deploy.deployment import load_deployment

    host = load_deployment().host_path(prof)
    return host if host is not None and host.is_dir() else None


def _deployment_profiler_dir() -> str:
    from k3rocm.deploy.deployment import load_deployment

    return load_deployment().settings.profiler_dir or ""


def run_live(args: argparse.Namespace, dep=None) -> int:
    from k3rocm.deploy.engine import docker_client
    from k3rocm.deploy.provenance import find_server_container
    from k3rocm.deploy.readiness import wait_ready

    if dep is None:
        dep = _deployment_args(args)
    for name in ("--concurrency", "--steps"):
        positive(name, getattr(args, name[2:].replace("-", "_")))
    positive("--max-tokens", args.max_tokens, args.steps + 12)
    api_key = dep.api_key
    url = args.url.rstrip("/")
    model = args.model or _served_model(url, api_key, dep.served_model_name)
    wait_ready(url, model, args.server_timeout, api_key)

    container = None
    client = docker_client(required=bool(args.container))
    if client is not None:
        try:
            if args.container:
                container = client.containers.get(args.container)
            else:
                container = find_server_container(client, url)
        except Exception as exc:  # noqa: BLE001
            if args.container:
                raise UsageError(f"--container {args.container}: not found in the Docker "
                                 f"engine ({exc.__class__.__name__})", 3) from None

    if args.fusions:
        claim = from_cli(args.fusions)
    elif container is not None:
        claim = claim_from_container(container)
    else:
        raise UsageError("what the server was asked for is unknown: no server container found "
                         f"for {url}; pass --container or --fusions")
    if container is None and not args.server_log and not args.skip_records:
        raise UsageError("the overlay's decision records are unreachable without the server "
                         "container: pass --container, --server-log FILE or --skip-records")
    run_dir = create_run_dir(results_root(args), args.label)
    _log(f"run directory {run_dir}")
    census = live_census(args, url, model, api_key, client, container, claim, run_dir, dep=dep)
    return _finish(census, run_dir, args.top)


def _deployment_or_none():
    from k3rocm.deploy.deployment import load_deployment

    try:
        return load_deployment()
    except UsageError:
        return None


def container_env(container: Any) -> dict[str, str]:
    return dict(e.split("=", 1) for e in (container.attrs.get("Config") or {}).get("Env") or []
                if "=" in e)


def claim_from_container(container: Any) -> FusionClaim:
    """What the server was asked for: the K3_FUSE_* values ``k3rocm serve`` rendered in it
    (after the base facts: a default the base cannot run is switched off there), else the
    container's env (docker inspect; unset = on)."""
    from k3rocm.deploy.provenance import rendered_record
    from k3rocm.serving.serve_cmd import RENDERED_FILE

    renv = (rendered_record(container) or {}).get("env") or {}
    fuse = {f.env: renv[f.env] for f in FUSIONS if f.env in renv}
    if fuse:
        return from_env({**container_env(container), **fuse},
                        f"container {container.name}'s rendered settings ({RENDERED_FILE})")
    return from_env(container_env(container), f"container {container.name}'s env")


def _served_model(url: str, api_key: str | None, default: str) -> str:
    from k3rocm.deploy.server_api import ServerAPI

    try:
        return ServerAPI(url, api_key).models()[0]
    except (UsageError, IndexError):  # wait_ready reports an unreachable server
        return default


def live_census(args: argparse.Namespace, url: str, model: str, api_key: str | None,
                client: Any, container: Any, claim: FusionClaim, run_dir: Path,
                title: str = "Decode kernel census", dep=None) -> Census:
    """Profile the running server under load, collect its traces into ``run_dir/traces``,
    analyse and write the report. Used by ``census`` and by each arm of ``census-ab``."""
    from k3rocm.checks.census import drive

    cenv: dict[str, str] = container_env(container) if container is not None else {}
    host_dir = _server_trace_host_dir(args, container, cenv)
    prof_dir = cenv.get("K3_PROFILER_DIR")
    if host_dir is None and (container is None or not prof_dir):
        raise UsageError("cannot reach the server's traces: pass --server-trace-dir <host path "
                         "of K3_PROFILER_DIR> (or run the server in a local container with "
                         "K3_PROFILER_DIR set)")
    server_prov = runrecord.server(client, url, api_key, container=container)
    argv = server_prov.get("server_argv") or []
    if "--speculative-config" in argv or cenv.get("K3_MTP_K", "0") not in ("", "0"):
        _log("note: the server runs speculative decoding. vLLM 0.27.x (the pinned nightly's "
             "era) runs the draft passes in sample_tokens, outside the execute_* step "
             "annotation: the census counts in-step launches only (vLLM PR #52494's 144 = 24 "
             "x 6 with MTP k=2), the draft's show in the 'outside engine steps' rows; do NOT pass "
             "--extra for them (docs/census.md, Speculative decoding)")
    if dep is None:
        dep = _deployment_or_none()
    record = runrecord.build(deployment=dep, server=server_prov, url=url, source="live",
                             model=model, claim=claim.to_json(), measure="census",
                             workload={"osl": args.max_tokens, "concurrency": args.concurrency,
                                       "steps": args.steps})
    runrecord.write(run_dir, record)  # early: kept if we fail
    if host_dir is not None:
        before_h = drive.snapshot_host_dir(host_dir)
    else:
        before_c = drive.snapshot_container_dir(container, prof_dir)
    load = drive.Load(url, model, args.concurrency, args.max_tokens, args.prompt_words,
                      api_key)
    info = drive.profile_under_load(load, args.steps)
    _log(f"profile done: {info}")
    dest = run_dir / "traces"
    _log(f"collecting traces from {host_dir}" if host_dir is not None else
         f"collecting traces from {prof_dir} inside container {container.name}")
    if host_dir is not None:
        files = drive.collect_from_host_dir(host_dir, before_h, dest, args.trace_timeout)
    else:
        files = drive.collect_from_container(container, prof_dir, before_c, dest,
                                             args.trace_timeout)
    _log(f"collected {len(files)} file(s) into {dest}")
    decisions = read_decisions(args, None, container)
    if decisions is not None:  # kept beside the traces: an offline re-analysis finds them
        by_pid: dict[int, list[Any]] = {}
        for r in decisions.records:
            by_pid.setdefault(r.pid, []).append(r.raw)
        for pid, recs in by_pid.items():
            write_json_atomic(dest / f"k3rocm-decisions-pid{pid}.json", recs)
        if decisions.found and not decisions.records:  # read, and empty: evidence too
            write_json_atomic(dest / NO_RECORDS, {"source": decisions.source, "records": 0})
    census = analyse(dest, args, claim, decisions, server_argv=argv or None)
    record.update(load=info, trace_files=base_provenance(
        [r.path for r in census.traces.ranks])["trace_files"])
    write_report(run_dir, census, record, title=title, top=args.top)
    return census
