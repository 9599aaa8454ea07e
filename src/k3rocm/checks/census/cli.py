"""``k3rocm census``: prove from the server's profiler trace which fused kernels run, how often.

Live (a server with K3_PROFILER_DIR) or offline (``--trace-dir``); docs/census.md. Exit codes:
0 PASS, 1 FAIL, 2 bad input, 3 server problem, 4 incomplete trace / cannot judge.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from k3rocm.checks.census import pipeline as pl
from k3rocm.checks.census.analyze import CAUSES, Census
from k3rocm.checks.census.expect import other_norms
from k3rocm.checks.census.fusions import from_cli
from k3rocm.checks.census.modelcfg import read_model_facts
from k3rocm.checks.census.spec import ROLES
from k3rocm.deploy import runrecord
from k3rocm.errors import UsageError
from k3rocm.options import Options, ServerFlags, like, option
from k3rocm.rundir import create_run_dir
from k3rocm.serving.fusions import FUSIONS

LIVE = "live server"  # --help group


class AnalysisFlags(Options):
    """The analysis flags ``census`` and ``ab --measure census`` share."""

    model_dir: str | None = option(
        None, "checkpoint directory (or its config.json) as seen from this host: the MLA layer "
        "count comes from it (default: K3_MODEL mapped through K3_MODELS_DIR when it lies under "
        "/models)")
    other_norms: str | None = option(
        None, "separate RMSNorm launches per step that are not MLA q/kv norms, e.g. "
        "'2*layers + 1' (overrides the model family's rule)", metavar="FORMULA")
    extra: list[str] = option(
        default_factory=list, metavar="ROLE=N", help=f"add N expected launches per step to "
        f"ROLE ({', '.join(ROLES)}), e.g. for draft-model layers")
    min_decode_steps: int = option(1, "fail unless at least this many decode-only steps were "
                                   "traced", ge=0)
    world_size: int | None = option(
        None, "ranks that must each have a worker trace, when the traces do not record it "
        "(distributedInfo.world_size); live runs fall back to the server's tensor-parallel "
        "size", ge=1)
    skip_records: bool = option(False, "do not cross-check the overlay's decision records (for "
                                "a server whose overlay predates them); the report says so")
    top: int = option(25, "kernels in the markdown's top table (across ranks)", ge=1)
    results: Path | None = like(ServerFlags, "results", "results root (default: K3_RESULTS_DIR "
                                "or ./results)")


def model_dir_from(args: argparse.Namespace, dep=None) -> str:
    """--model-dir, else the checkpoint on this host of ``dep`` (an A/B arm's) or the
    command's deployment."""
    if args.model_dir:
        return args.model_dir
    dep = dep or args.deployment
    if dep.model_host_dir is not None and dep.model_host_dir.exists():
        return str(dep.model_host_dir)
    raise UsageError("no model config: pass --model-dir <checkpoint dir with config.json> "
                     f"(K3_MODEL={dep.model} is not a path on this host)")


def results_root(args: argparse.Namespace, dep=None) -> str:
    return args.results or str((dep or args.deployment).results_root)


def analysis_from(args: argparse.Namespace, dep=None) -> pl.Analysis:
    """The analysis flags, checked before any expensive work (exit 2)."""
    f = AnalysisFlags.from_args(args)  # out of range: exit 2
    model_dir = model_dir_from(args, dep)
    other_norms(f.other_norms, read_model_facts(model_dir))  # a bad formula: exit 2 now
    extra: dict[str, int] = {}
    for item in f.extra:
        role, sep, n = item.partition("=")
        if not sep or role not in ROLES or not n.strip().lstrip("-").isdigit():
            raise UsageError(f"--extra {item!r} is not ROLE=N with ROLE one of "
                             f"{', '.join(ROLES)} and N an integer")
        extra[role] = int(n)
    if getattr(args, "fusions", None):
        from_cli(args.fusions)
    server_log = getattr(args, "server_log", None)
    if server_log and not Path(server_log).is_file():
        raise UsageError(f"--server-log {server_log} does not exist")
    return pl.Analysis(model_dir, extra, f.other_norms, f.min_decode_steps, f.world_size,
                       f.skip_records, server_log, f.top)


def profiling_from(args: argparse.Namespace) -> pl.Profiling:
    return pl.Profiling.from_args(args, server_trace_dir=getattr(args, "server_trace_dir", None))


class CensusFlags(Options):
    """``k3rocm census``'s own flags (plus :class:`pl.Profiling`, :class:`AnalysisFlags`)."""

    trace_dir: str | None = option(None, "analyse the traces in this directory instead of "
                                   "driving a server")
    fusions: str | None = option(
        None, "what the server was asked for (default: "
        f"{' / '.join(f.env for f in FUSIONS)} in the server container's env, unset = on; "
        "offline: the run's provenance.json beside the trace directory)",
        metavar=pl.FUSIONS_METAVAR)
    server_log: str | None = option(
        None, "server log holding the overlay's 'K3ROCM-DECISION {...}' records (default: "
        "k3rocm-decisions-pid*.json beside the traces, or the server container's log)",
        metavar="FILE")
    url: str | None = like(ServerFlags, "url", group=LIVE)
    model: str | None = like(ServerFlags, "model", "served model name (default: the first in "
                             "/v1/models, else K3_SERVED_MODEL_NAME)", group=LIVE)
    container: str | None = like(
        ServerFlags, "server_container", "server container name/id (default: the container "
        "publishing the URL's port); used for the log, provenance and traces", group=LIVE)
    server_trace_dir: str | None = option(
        None, "host path of the server's K3_PROFILER_DIR (default: the server container's mount "
        "of it; without a container, mapped through K3_RESULTS_DIR when it lies under "
        "/results; else the traces are copied out of the container)", group=LIVE)
    server_timeout: float = option(60.0, "seconds to wait for /health", group=LIVE, gt=0,
                                   unit=" seconds")
    label: str = option("census", "run directory label", group=LIVE)


def add_arguments(p: argparse.ArgumentParser) -> None:
    groups: dict[str, argparse._ArgumentGroup] = {}
    CensusFlags.add_arguments(p, groups)
    pl.Profiling.add_arguments(groups[LIVE])
    AnalysisFlags.add_arguments(p.add_argument_group("analysis"))


def finish(census: Census, run_dir: Path) -> int:
    for x in census.traces.skipped_runs:
        print(f"census: skipped {x['why']}: started {x['started']}, ranks "
              f"{', '.join(map(str, x['ranks']))} ({len(x['files'])} file(s))")
    print(census.table(), "", census.report_table(), sep="\n")
    bad = [c for c in census.checks if c.ok is False]
    if census.incomplete:
        for line in census.incomplete_lines():
            print(f"census: lost: {line}")
        verdict = (f"INCOMPLETE TRACE ({len(census.incomplete)} loss(es); the fusions were not "
                   f"judged; {CAUSES})")
    elif census.verdict == "CANNOT JUDGE":
        for line in census.undecided_lines():
            print(f"census: cannot judge: {line}")
        verdict = (f"CANNOT JUDGE ({len(census.undecided_lines())} reason(s) above; nothing "
                   "contradicts the claim, the evidence does not prove it)")
    elif census.verdict == "PASS":
        verdict = "PASS"
        if census.decisions is not None and not census.decisions.found:
            verdict += (" (the overlay's decision records were not cross-checked: none found; "
                        "pass --server-log FILE or --skip-records)")
    else:
        verdict = f"FAIL ({len(bad)} failed: {'; '.join(sorted({c.what for c in bad}))[:300]})"
    print(f"census: {verdict}")
    print(f"census: report in {run_dir}/census.md")
    return census.exit_code


def deployment_view(args: argparse.Namespace) -> dict:
    """What this command resolved (``--print-deployment``)."""
    try:
        model_dir: str | None = str(Path(model_dir_from(args)).absolute())
    except UsageError:
        model_dir = None
    return {"url": (args.url or args.deployment.url).rstrip("/"),
            "served_model_name": args.model or args.deployment.served_model_name,
            "results_root": str(Path(results_root(args)).absolute()),
            "model_host_dir": model_dir}


def run(args: argparse.Namespace) -> int:
    CensusFlags.from_args(args)  # out of range: exit 2
    dep = args.deployment
    args.url = args.url or dep.url
    opts = analysis_from(args, dep)
    if args.trace_dir:
        tdir = Path(args.trace_dir)
        if not tdir.is_dir():
            raise UsageError(f"--trace-dir {tdir} does not exist or is not a directory")
        claim = pl.claim_offline(tdir, args.fusions)
        decisions = pl.read_decisions(opts, tdir)
        census = pl.analyse(tdir, opts, claim, decisions)
        run_dir = create_run_dir(results_root(args, dep), args.label)
        files = pl.trace_files([r.path for r in census.traces.ranks])
        pl.write_report(run_dir, census, runrecord.build(
            deployment=dep, source="trace-dir", trace_dir=str(args.trace_dir),
            claim=claim.to_json(), trace_files=files), top=args.top)
        return finish(census, run_dir)
    return finish(*run_live(args, dep, opts))


def run_live(args: argparse.Namespace, dep, opts) -> tuple[Census, Path]:
    from k3rocm.deploy.engine import docker_client
    from k3rocm.deploy.provenance import find_server_container
    from k3rocm.deploy.server_api import ServerAPI, wait_ready

    load = profiling_from(args)
    api_key = dep.api_key
    url = args.url.rstrip("/")
    model = args.model
    if not model:
        try:
            model = ServerAPI(url, api_key).models()[0]
        except (UsageError, IndexError):  # wait_ready reports an unreachable server
            model = dep.served_model_name
    wait_ready(url, model, args.server_timeout, api_key)

    client = docker_client(required=bool(args.container))
    container = None
    if args.container:
        try:
            container = client.containers.get(args.container)
        except Exception as exc:  # noqa: BLE001 - docker.errors.NotFound
            raise UsageError(f"--container {args.container}: not found in the Docker "
                             f"engine ({exc.__class__.__name__})", 3) from None
    elif client is not None:
        container = find_server_container(client, url)

    if args.fusions:
        claim = from_cli(args.fusions)
    elif container is not None:
        claim = pl.claim_from_container(container)
    else:
        raise UsageError("what the server was asked for is unknown: no server container found "
                         f"for {url}; pass --container or --fusions")
    if container is None and not args.server_log and not args.skip_records:
        raise UsageError("the overlay's decision records are unreachable without the server "
                         "container: pass --container, --server-log FILE or --skip-records")
    run_dir = create_run_dir(results_root(args, dep), args.label)
    pl.log(f"run directory {run_dir}")
    census = pl.live_census(url, model, api_key, client, container, claim, run_dir, opts, load,
                         dep=dep)
    return census, run_dir
