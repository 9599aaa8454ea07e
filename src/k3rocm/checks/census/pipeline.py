"""The census pipeline apart from any command line: claim, collect (live), analyse, report
(``census.json``, ``census.md``, ``provenance.json``); used by ``census`` and census-ab arms.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import groupby
from operator import attrgetter
from pathlib import Path
from typing import Any

from pydantic import model_validator

from k3rocm.checks.census.analyze import Census, run_census
from k3rocm.checks.census.decisions import Decisions
from k3rocm.checks.census.fusions import FusionClaim, from_cli, from_env
from k3rocm.checks.census.modelcfg import read_model_facts
from k3rocm.checks.census.spec import load_spec
from k3rocm.checks.census.trace import load_trace_dir
from k3rocm.deploy import runrecord
from k3rocm.deploy.provenance import ServedAs, served_as
from k3rocm.deploy.scale.status import topology
from k3rocm.errors import UsageError, tagged_log
from k3rocm.hashing import sha256_file as sha256
from k3rocm.options import Options, option
from k3rocm.rundir import write_json_atomic, write_text_atomic
from k3rocm.serving.decisions import decision_files, records_from_files, records_from_log
from k3rocm.serving.fusions import FUSIONS

FUSIONS_METAVAR = ",".join(f"{f.name}=on|off" for f in FUSIONS)
NO_RECORDS = "k3rocm-decisions-none.json"  # beside traces: the server log held no record


log = tagged_log("census")


@dataclass(frozen=True)
class Analysis:

    model_dir: str
    extra: dict[str, int]
    other_norms: str | None = None
    min_decode_steps: int = 1
    world_size: int | None = None
    skip_records: bool = False
    server_log: str | None = None
    top: int = 25


class Profiling(Options):
    """The live load and profile window (``census`` and ``ab --measure census``)."""

    concurrency: int = option(8, "concurrent streams", ge=1)
    max_tokens: int = option(1024, "output tokens per request (at least --steps + 12)", ge=1)
    prompt_words: int = option(64, "prompt length (words)", ge=1)
    steps: int = option(6, "decode steps to profile (the server's max_iterations may stop it "
                        "earlier)", ge=1)
    trace_timeout: float = option(900.0, "seconds to wait for the trace files after "
                                  "/stop_profile", gt=0, unit=" seconds")
    server_trace_dir: str | None = None  # host path of the server's K3_PROFILER_DIR

    @model_validator(mode="after")
    def _room_to_profile(self) -> Profiling:
        if self.max_tokens < self.steps + 12:
            raise ValueError(f"--max-tokens {self.max_tokens} is too few for --steps "
                             f"{self.steps}; use at least {self.steps + 12}")
        return self


def claim_from_container(container: Any) -> FusionClaim:
    """The K3_FUSE_* values ``k3rocm serve`` rendered in the container, else its env."""
    from k3rocm.serving.serve_cmd import RENDERED_FILE

    served = served_as(container=container)
    what = f"rendered settings ({RENDERED_FILE})" if served.rendered else "env"
    return from_env(served.env, f"container {container.name}'s {what}")


def claim_offline(trace_dir: Path, fusions: str | None = None) -> FusionClaim:
    """``fusions``, else the server settings in the run's provenance.json."""
    if fusions:
        return from_cli(fusions)
    for cand in filter(Path.is_file, (trace_dir / "provenance.json",
                                      trace_dir.parent / "provenance.json")):
        try:
            prov = json.loads(cand.read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"{cand} is not valid JSON ({exc.__class__.__name__})") from None
        server = prov.get("server", prov) if isinstance(prov, dict) else None
        if isinstance(server, dict) and (isinstance(server.get("rendered"), dict) or isinstance(
                (server.get("container") or {}).get("env"), dict)):
            served = served_as(server)
            what = "the server's rendered settings" if served.rendered else "the server env"
            return from_env(served.env, f"{what} recorded in {cand}")
    raise UsageError(f"what the server was asked for is unknown: pass --fusions "
                     f"{FUSIONS_METAVAR} (no provenance.json with the server's "
                     f"env beside {trace_dir})")


def resolve_world_size(trace_ws: int | None, given: int | None,
                       served: ServedAs | None = None) -> tuple[int, str]:
    """The traces' world size, else --world-size, else the server's TP; else exit 2."""
    if trace_ws is not None:
        if given is not None and given != trace_ws:
            raise UsageError(f"--world-size {given} disagrees with the traces' "
                             f"distributedInfo.world_size {trace_ws}")
        return trace_ws, "the traces' distributedInfo"
    if given is not None:
        return given, "--world-size"
    if served is not None and served.tp is not None:
        return served.tp, f"the server's tensor-parallel size, from {served.source}"
    raise UsageError("the traces do not record the world size (no distributedInfo."
                     "world_size): pass --world-size N (the server's tensor-parallel size)")


def analyse(trace_dir: Path, opts: Analysis, claim: FusionClaim, decisions: Decisions | None,
            files: list[Path] | None = None, served: ServedAs | None = None) -> Census:
    model = read_model_facts(opts.model_dir)
    traces = load_trace_dir(trace_dir, files)
    world, world_src = resolve_world_size(traces.world_size, opts.world_size, served)
    plat = "rocm" if any(r.mode == "gpu" for r in traces.ranks) else "cpu"
    spec = load_spec(plat, model.model_type, opts.other_norms)
    return run_census(traces, model, claim, spec, decisions, world, world_src,
                      opts.min_decode_steps, opts.extra)


def read_decisions(opts: Analysis, trace_dir: Path | None = None,
                   container: Any = None) -> Decisions | None:
    """Records from --server-log, else the files beside the traces, else the container log."""
    if opts.skip_records:
        return None
    if opts.server_log:
        src = f"server log {opts.server_log}"
        return Decisions(records_from_log(Path(opts.server_log).read_text(errors="replace"),
                                          src), src)
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


def trace_files(files: list[Path]) -> list[dict[str, Any]]:
    return [{"path": str(f), "bytes": f.stat().st_size, "sha256": sha256(f)} for f in files]


def write_report(run_dir: Path, census: Census, provenance: dict[str, Any],
                 title: str = "Decode kernel census", top: int = 25) -> None:
    write_json_atomic(run_dir / "census.json", {**census.to_json(), "provenance": provenance})
    upstream = (provenance.get("upstream_comparison") or {}).get("text")
    write_text_atomic(run_dir / "census.md", census.markdown(title, top)
                      + (f"\n## Upstream figures\n\n{upstream}\n" if upstream else "")
                      + "\n## Provenance\n\n```json\n"
                      + json.dumps(provenance, indent=2, default=str)[:20000]
                      + "\n```\n")
    write_json_atomic(run_dir / "provenance.json", provenance)


def server_trace_host_dir(given: str | None, container: Any, env: dict[str, str],
                          dep: Any = None) -> Path | None:
    """Host directory of the server's K3_PROFILER_DIR (--server-trace-dir, the container's
    bind mount, else mapped through K3_RESULTS_DIR), or None: copy out of the container."""
    if given:
        d = Path(given)
        if not d.is_dir():
            raise UsageError(f"--server-trace-dir {d} is not a directory")
        return d
    prof = env.get("K3_PROFILER_DIR") or ("" if container is not None or dep is None else
                                          dep.settings.profiler_dir or "")
    if not prof:
        return None
    if container is not None:
        mounts = ((str(m.get("Destination", "")).rstrip("/"), str(m.get("Source", "")))
                  for m in container.attrs.get("Mounts") or [])
        best = max(((d, src) for d, src in mounts if d and (prof == d or prof.startswith(d + "/"))),
                   key=lambda m: len(m[0]), default=None)  # the innermost mount holding prof
        if best is None or not Path(best[1]).is_dir():
            return None  # copy out of the container (a Source not on this host: remote engine)
        host = Path(best[1]) / prof[len(best[0]):].lstrip("/")
        try:
            host.mkdir(parents=True, exist_ok=True)
        except OSError:
            return None
        return host
    host = dep.host_path(prof)
    return host if host is not None and host.is_dir() else None


def speculative_note(served: ServedAs) -> str | None:
    if not served.speculative[0]:
        return None
    return ("note: the server runs speculative decoding. vLLM 0.27.x (the pinned nightly's era) "
            "runs the draft passes in sample_tokens, outside the execute_* step annotation: the "
            "census counts in-step launches only (vLLM PR #52494's 144 = 24 x 6 with MTP k=2), "
            "the draft's show in the 'outside engine steps' rows; do NOT pass --extra for them "
            "(docs/census.md, Speculative decoding)")


def live_census(url: str, model: str, api_key: str | None, client: Any, container: Any,
                claim: FusionClaim, run_dir: Path, opts: Analysis, load: Profiling, *,
                dep: Any, title: str = "Decode kernel census") -> Census:
    """Profile the server under load, collect its traces into ``run_dir/traces``, analyse,
    report (``census`` and each census-ab arm; ``dep``: that server's deployment)."""
    from k3rocm.checks.census import drive

    server_prov = runrecord.server(client, url, api_key, container=container)
    served = served_as(server_prov)
    cenv = served.env if container is not None else {}
    host_dir = server_trace_host_dir(load.server_trace_dir, container, cenv, dep)
    prof_dir = cenv.get("K3_PROFILER_DIR")
    if host_dir is None and (container is None or not prof_dir):
        raise UsageError("cannot reach the server's traces: pass --server-trace-dir <host path "
                         "of K3_PROFILER_DIR> (or run the server in a local container with "
                         "K3_PROFILER_DIR set)")
    if note := speculative_note(served):
        log(note)
    record = runrecord.build(deployment=dep, server=server_prov, url=url, source="live",
                             topology=topology(url),
                             model=model, claim=claim.to_json(), measure="census",
                             workload={"osl": load.max_tokens, "concurrency": load.concurrency,
                                       "steps": load.steps},
                             server_settings_from=served.source)
    runrecord.write(run_dir, record)  # early: kept if we fail
    traces = drive.TraceDir(host_dir, container, prof_dir)
    before = traces.snapshot()
    stopped = (lambda: bool(traces.new_files(before))) \
        if served.profiler_max_iterations > 0 else None
    info = drive.profile_under_load(url, model, api_key, load, stopped=stopped)
    log(f"profile done: {info}")
    dest = run_dir / "traces"
    log(f"collecting traces from {traces}")
    files = traces.collect(before, dest, load.trace_timeout)
    log(f"collected {len(files)} file(s) into {dest}")
    decisions = read_decisions(opts, None, container)
    if decisions is not None:  # kept beside the traces: an offline re-analysis finds them
        by_pid = attrgetter("pid")
        for pid, recs in groupby(sorted(decisions.records, key=by_pid), by_pid):
            write_json_atomic(dest / f"k3rocm-decisions-pid{pid}.json", [r.raw for r in recs])
        if decisions.found and not decisions.records:  # read, and empty: evidence too
            write_json_atomic(dest / NO_RECORDS, {"source": decisions.source, "records": 0})
    census = analyse(dest, opts, claim, decisions, served=served)
    record.update(load=info, trace_files=trace_files([r.path for r in census.traces.ranks]))
    write_report(run_dir, census, record, title=title, top=opts.top)
    return census
