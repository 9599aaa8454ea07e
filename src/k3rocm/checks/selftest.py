"""``k3rocm selftest`` (``make selftest``): before the 1.5 TB load, prove on a small Kimi-K3-shaped
checkpoint that this base, this overlay and these settings serve, fuse and agree.

``selftest model [SRC] [OUT]`` cuts the small checkpoint (default OUT
``<K3_MODELS_DIR>/Kimi-K3-selftest``). ``selftest run`` serves it as ``make up`` would (same
profile, settings, image, compose service), only K3_MODEL, K3_PORT (+1) and K3_PROFILER_DIR
changed, in its own compose project, with this shell's vendor variables (run dir's vendor.env).
Checked first (one line each, exit 2, nothing started): the bench client image, the port, the
GPUs free, both arms against the image's base facts. Steps:

    build    the serving image; its base facts applied to the settings (refusal: exit 2)
    up       serve arm B (the --on fusions on); wait until ready; overlay decisions
    census   decode kernel census (expectations from the small model's MLA layer count)
    greedy   fixed prompts, greedy, top-20 logprobs per position
    bench    one short aiperf point
    down     server log kept
    off      the same server as arm A (every K3_FUSE_* 0): greedy again, down
    compare  on vs off: the largest logprob gap (up to each prompt's first differing token)
             within LOGPROB_TOL

On the CPU stand-in (CPU=1) the tiny DeepSeek-shaped model serves and both servers are arm A
(the fusions need ROCm + AITER; a K3_FUSE_* switch set in the shell or .env is kept for the
first). Results: ``<results>/<UTC>-selftest/`` (summary.json, summary.md, logs/, both server
logs); every server it started is stopped, also on failure and Ctrl-C / SIGTERM.

Exit codes: 0 every step ok; 1 a check failed; 2 bad input (nothing loaded); 3 a server did not
come up or no Docker engine; 4 cannot judge (a logprob gap with no bound, or a step refused its
input after a server had started); 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from k3rocm.checks.ab import arms as armlib
from k3rocm.checks.steps import REPO, Pipeline, StepResult, bench_numbers, census_numbers
from k3rocm.deploy import selftest_model
from k3rocm.errors import UsageError
from k3rocm.options import DeploymentFlags

PROJECT = "k3rocm-selftest"
PROMPTS = ("The capital of France is", "def fibonacci(n):", "1, 2, 3, 5, 8,",
           "Kimi-K3 runs on eight MI355X GPUs and")
GREEDY_TOKENS = 16
STEPS = ("build", "up", "census", "greedy", "bench", "down", "off", "compare")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = p.add_subparsers(dest="what", metavar="{model,run}", required=True)
    m = sub.add_parser(
        "model", help="write a small Kimi-K3-shaped checkpoint (few layers and experts)",
        description=selftest_model.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    selftest_model.add_arguments(m)
    r = sub.add_parser(
        "run", help="serve the small checkpoint as `make up` would; census, greedy off/on, bench",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--model", default=None,
                   help="the small checkpoint: a /models/... path or a host directory under "
                   f"K3_MODELS_DIR (default: /models/{selftest_model.DEFAULT_OUT}; on the CPU "
                   "stand-in the deployment's own K3_MODEL)")
    r.add_argument("--port", type=int, default=None,
                   help="host port of the selftest server (default: K3_PORT + 1)")
    r.add_argument("--project", default=PROJECT, help=f"compose project (default {PROJECT})")
    r.add_argument("--timeout", type=float, default=1800,
                   help="seconds to wait for each server (default 1800)")
    r.add_argument("--no-build", action="store_true",
                   help="do not build the serving image first (it must exist)")
    r.add_argument("--workload", default=None,
                   help="bench workload (default: ci-tiny on the CPU stand-in, decode-8k1k)")
    r.add_argument("--bench-args", default="",
                   help="more `k3rocm bench` arguments (default: concurrency 1, 4 requests)")
    r.add_argument("--census-args", default="", help="more `k3rocm census` arguments")
    armlib.add_on_argument(r)
    r.add_argument("--verbose", action="store_true", help="stream each step's output too")
    DeploymentFlags.add_arguments(r)


def run(args: argparse.Namespace) -> int:
    return selftest_model.run(args) if args.what == "model" else selftest(args)


def deployment_view(args: argparse.Namespace) -> dict:
    """``--print-deployment``: for ``run``, the selftest server's deployment."""
    if args.what != "run":
        return {}
    dep, srv, switches = _plan(args, check_model=False)
    return {**dep.to_json(), "project": srv.project, "arm_env": switches}


# ------------------------------------------------------------------------------------ plan


def arms(on: str, base) -> dict[str, dict[str, str]]:
    """The servers' switches: the A/B's arms, B ("on") and A ("off"). On the CPU stand-in the
    fusions cannot run: B is arm A too, except a switch the user set (shell or .env)."""
    envs = armlib.arm_envs(on)
    if base.cpu:
        envs["B"] = {k: base.rendered.env[k] if base.sources.get(k) in ("env", ".env") else v
                     for k, v in envs["A"].items()}
    return envs


def _plan(args: argparse.Namespace, check_model: bool = True, extra: dict | None = None,
          vendor_file: Path | None = None):
    """(deployment, the fusions-on ComposeServer, the arms' switches); bad input: UsageError.
    ``vendor_file``: this shell's vendor variables, written there for the servers."""
    from k3rocm.deploy.config_cmd import write_vendor_env
    from k3rocm.deploy.lifecycle import ComposeServer

    if args.timeout <= 0:
        raise UsageError(f"--timeout {args.timeout:g} must be > 0")
    base = args.deployment
    cpu = base.cpu
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
    switches = arms(args.on, base)
    env = {"K3_MODEL": model, "K3_PORT": str(port), **(extra or {}), **switches["B"]}
    dep = base.with_env(check_model, **env)  # the settings of `make up`, these changed
    if vendor_file is not None:  # never the shared .k3rocm/vendor.env (an earlier shell's)
        write_vendor_env(vendor_file, dep.rendered)
        if cpu:  # logprobs need torch.compile, and the stand-in has no C++ compiler: eager
            with open(vendor_file, "a", encoding="utf-8") as fh:
                fh.write("TORCHDYNAMO_DISABLE=1\n")
        env["K3_VENDOR_ENV_FILE"] = str(vendor_file)
    srv = ComposeServer(project=args.project, cpu=cpu, env=env, url=dep.url,
                        model=dep.served_model_name, api_key=dep.api_key)
    return dep, srv, switches


def base_check(dep, srv, switches: dict[str, dict[str, str]], env_file: str) -> dict[str, Any]:
    """Both arms against the image's base facts (the A/B's own check; a refusal is exit 2):
    the fusions-on arm's decision, where the facts came from, both arms'."""
    checked = armlib.base_check(switches, {**os.environ, **srv.env}, env_file, dep.image,
                                dep.settings.profile)
    if not checked["arms"]:
        return {"facts_from": checked["facts_from"],
                "notes": ["base facts unknown: checked at start"]}
    return {**checked["arms"]["B"], "facts_from": checked["facts_from"], "arms": checked["arms"]}


# ------------------------------------------------------------- before any build or server


class _Args(argparse.ArgumentParser):
    """A measure's own parser for ``--bench-args`` / ``--census-args``: an error is one line."""

    def error(self, message: str):  # argparse would print its usage and exit
        raise UsageError(f"{self.prog}: {message}")


def measure_args(args: argparse.Namespace, dep) -> dict[str, argparse.Namespace]:
    """The census and bench steps' flags: the selftest server's, one short bench point, then
    ``--census-args`` / ``--bench-args`` (which win). Bad input: UsageError."""
    from k3rocm.checks.bench import cli as bench
    from k3rocm.checks.census import cli as census

    host = dep.model_host_dir
    server = ["--url", dep.url, "--results", str(dep.results_root)]
    ours = {"census": (census.add_arguments,
                       [*server, *(["--model-dir", str(host)] if host else [])]),
            "bench": (bench.add_arguments,
                      ["--workload", args.workload or ("ci-tiny" if dep.cpu else "decode-8k1k"),
                       *server, "--label", "selftest-bench",
                       *(["--tokenizer", str(host)] if host else []),
                       "--set", "concurrency=1", "--set", "request_count=4"])}
    out = {}
    for name, (add_arguments, argv) in ours.items():
        opt = f"--{name}-args"
        try:
            extra = shlex.split(getattr(args, f"{name}_args") or "")
        except ValueError as exc:
            raise UsageError(f"{opt}: {exc}") from None
        parser = _Args(prog=opt, add_help=False)
        add_arguments(parser)
        out[name] = parser.parse_args([*argv, *extra])
    census.CensusFlags.from_args(out["census"])  # out of range: exit 2
    return out


def early_checks(dep, client_image: str | None,
                 no_build: bool = False) -> tuple[list[UsageError], list[str]]:
    """(problems, notes): the bench client image (with ``no_build`` the serving image), the
    port free, the GPUs free (not on the CPU stand-in). Nothing is started."""
    from k3rocm.deploy.engine import docker_client, image_id
    from k3rocm.deploy.preflight import (
        DRM,
        VLLM_DEFAULT_GPU_MEMORY_UTILIZATION,
        gpu_holders,
        gpu_memory,
        port_free,
    )

    problems: list[UsageError] = []
    notes: list[str] = []
    client = docker_client(timeout=60, required=False)
    if client is None:
        problems.append(UsageError("no Docker engine answers (DOCKER_HOST or the default "
                                   "socket): start Docker; the selftest builds and serves "
                                   "through it", 3))
    elif client_image:
        try:
            image_id(client, client_image, hint="the bench step runs aiperf in it: build it with "
                     "`make clients-image` (or --bench-args '--client-image IMAGE')")
            notes.append(f"client image {client_image} present")
        except UsageError as exc:
            problems.append(exc)
        if no_build:
            try:
                image_id(client, dep.image, what="serving image", hint="build it (`make "
                         "build`, or `make build CPU=1` for the stand-in) or drop --no-build")
            except UsageError as exc:
                problems.append(exc)
    host = {"": "0.0.0.0"}.get(dep.settings.bind_address, dep.settings.bind_address)
    if port_free(host, dep.port):
        notes.append(f"port {dep.port} free")
    else:
        problems.append(UsageError(
            f"port {dep.port} on {host} is in use: the selftest server publishes it; stop "
            "what listens there or pick a free one with --port N"))
    if dep.cpu:
        notes.append("GPU check skipped: CPU stand-in")
        return problems, notes
    holders = gpu_holders(client)
    if holders:
        problems.append(UsageError(
            f"the GPUs are held by running container(s) {', '.join(holders)}: a server at "
            "K3_GPU_MEMORY_UTILIZATION keeps that share of every GPU it uses until it stops; "
            "`make down` (or `docker compose -p PROJECT down`) first"))
    need = dep.settings.gpu_memory_utilization or VLLM_DEFAULT_GPU_MEMORY_UTILIZATION
    used = [(g, u / total) for g, u, total in gpu_memory()]
    busy = [(g, f) for g, f in used if f > 1 - need]
    if not used:
        notes.append(f"GPU memory not read (no mem_info_vram_total under /sys/{DRM})")
    elif busy and not holders:
        problems.append(UsageError(
            "GPU memory in use: " + ", ".join(f"{g} {f:.0%}" for g, f in busy)
            + f"; the selftest server asks vLLM for {need:g} of each GPU "
            f"(K3_GPU_MEMORY_UTILIZATION), so at most {1 - need:.0%} may be in use: stop "
            "what holds them first"))
    elif not busy:
        notes.append(f"{len(used)} GPUs free (at most {max(f for _, f in used):.0%} in use)")
    return problems, notes


def vendor_note(dep, repo: Path) -> str:
    """The vendor variables the servers get (this shell's), and where the shared
    .k3rocm/vendor.env (an earlier shell's, not used) differs."""
    from k3rocm.serving.config import is_secret, read_dotenv

    mine = {k: v for k, v in dep.rendered.env.items()  # what write_vendor_env writes
            if dep.rendered.sources.get(k) == "env" and not k.startswith("K3_")
            and not is_secret(k)}
    stale_path = repo / ".k3rocm" / "vendor.env"
    try:
        stale = read_dotenv(stale_path)
    except UsageError:
        stale = {}
    differ = sorted(k for k in set(mine) | set(stale) if mine.get(k) != stale.get(k))
    return (f"vendor variables from this shell: {', '.join(sorted(mine)) or 'none'}"
            + (f" ({stale_path} differs in {', '.join(differ)}: not used)" if differ else ""))


# --------------------------------------------------------------------------------- greedy


LOGPROB_TOP = 20  # top_logprobs per position: vLLM's default --max-logprobs
# The largest logprob gap on vs off that is still rounding (docs/selftest.md, "The logprob
# tolerance"): one bf16 step of the logits at |z| < 16 (2^-4), twice through the logsumexp.
LOGPROB_TOL = 2 * 2.0 ** -4


def greedy(url: str, model: str, api_key: str | None, timeout: float = 300) -> list[dict]:
    """Greedy completions of PROMPTS: per position the token (by id: random weights decode
    many ids to one text), its logprob and the top LOGPROB_TOP logprobs."""
    import requests

    from k3rocm.deploy.server_api import ServerAPI

    api = ServerAPI(url, api_key, timeout=timeout)
    out = []
    for prompt in PROMPTS:
        try:
            r = api.post("/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": GREEDY_TOKENS,
                "temperature": 0, "logprobs": LOGPROB_TOP, "return_tokens_as_token_ids": True,
                "ignore_eos": True, "seed": 0})
            r.raise_for_status()
            lp = r.json()["choices"][0]["logprobs"]
            top = [{t: round(float(v), 6) for t, v in (d or {}).items()}
                   for d in lp["top_logprobs"]]
        except (requests.RequestException, KeyError, IndexError, TypeError,
                ValueError) as exc:
            raise UsageError(f"greedy request to {url} failed ({exc.__class__.__name__}: "
                             f"{str(exc)[:200]})", 3) from None
        out.append({"prompt": prompt, "tokens": lp["tokens"],
                    "logprobs": [round(float(x), 6) if x is not None else None
                                 for x in lp["token_logprobs"]],
                    "top_logprobs": top})
    return out


def _cross(run: dict, pos: int, token: str) -> tuple[float | None, float | None]:
    """(this arm's logprob of ``token`` at ``pos``, None outside its top-N; the lowest of its
    top-N there, which bounds it)."""
    top = (run.get("top_logprobs") or [])[pos:pos + 1]
    top = top[0] if top else {}
    if run["tokens"][pos] == token and run["logprobs"][pos] is not None:
        return run["logprobs"][pos], min(top.values(), default=None)
    return top.get(token), min(top.values(), default=None)


def compare(on: list[dict], off: list[dict], tol: float = LOGPROB_TOL) -> dict[str, Any]:
    """Fusions on vs off, per prompt up to its first differing token: the logprob gap of each
    chosen token (at a difference, both arms' tokens). A token outside the other arm's top-N
    counts with its least possible gap. "fail" when a gap exceeds ``tol``, else "cannot judge"
    when a gap has no bound (or an answer ended early), else "ok"."""
    diffs, gaps, unbounded, spreads = [], [], [], []
    for a, b in zip(on, off, strict=True):
        n = min(len(a["tokens"]), len(b["tokens"]))
        for pos in range(n):
            top = (a.get("top_logprobs") or [])[pos:pos + 1]
            if top and len(top[0]) >= 2:
                spreads.append(max(top[0].values()) - min(top[0].values()))
            toks = [a["tokens"][pos]] if a["tokens"][pos] == b["tokens"][pos] else \
                [a["tokens"][pos], b["tokens"][pos]]
            for tok in toks:
                (x, x_min), (y, y_min) = _cross(a, pos, tok), _cross(b, pos, tok)
                if x is not None and y is not None:
                    gaps.append((abs(x - y), a["prompt"], pos, tok, True))
                    continue
                known, floor = (x, y_min) if y is None else (y, x_min)  # outside one top-N
                low = known - floor if known is not None and floor is not None else None
                if low is not None and low > 0:
                    gaps.append((low, a["prompt"], pos, tok, False))
                else:
                    unbounded.append({"prompt": a["prompt"], "position": pos, "token": tok})
            if len(toks) == 2:
                diffs.append({"prompt": a["prompt"], "position": pos,
                              "on": [a["tokens"][pos]], "off": [b["tokens"][pos]],
                              "logprob_on": a["logprobs"][pos],
                              "logprob_off": b["logprobs"][pos]})
                break
        else:
            if len(a["tokens"]) != len(b["tokens"]):  # one answer ended: nothing to compare
                diffs.append({"prompt": a["prompt"], "position": n,
                              "on": a["tokens"][n:n + 1], "off": b["tokens"][n:n + 1],
                              "logprob_on": (a["logprobs"][n:n + 1] or [None])[0],
                              "logprob_off": (b["logprobs"][n:n + 1] or [None])[0]})
                unbounded.append({"prompt": a["prompt"], "position": n, "token": None})
    worst = max(gaps, key=lambda g: g[0], default=None)
    verdict = ("fail" if worst is not None and worst[0] > tol else
               "cannot judge" if unbounded or worst is None else "ok")
    return {"identical": not diffs, "prompts": len(on), "tokens_per_prompt": GREEDY_TOKENS,
            "first_differences": diffs,
            "max_logprob_gap": None if worst is None else round(worst[0], 6),
            "max_gap_at": None if worst is None else {
                "prompt": worst[1], "position": worst[2], "token": worst[3],
                "in_both_top_n": worst[4]},
            "unbounded": unbounded, "tolerance": tol, "top_n": LOGPROB_TOP,
            "compared": len(gaps), "verdict": verdict, "ok": verdict == "ok",
            "top_n_spread_median": round(statistics.median_high(spreads), 6) if spreads else None}


def compare_note(c: dict[str, Any]) -> str:
    """The compare step's one line: the gap against the tolerance, then what differs."""
    at = c.get("max_gap_at") or {}
    gap = c["max_logprob_gap"]
    parts = []
    if gap is not None:
        where = f" at {at.get('prompt')!r} position {at.get('position')}" if gap else ""
        parts.append(f"max logprob gap {gap:.4g} {'>' if gap > c['tolerance'] else '<='} "
                     f"tolerance {c['tolerance']:g}{where}")
    if c["unbounded"]:
        parts.append("cannot judge " + ", ".join(
            f"{u['prompt']!r} position {u['position']}" for u in c["unbounded"])
            + f": a token outside the other arm's top-{c['top_n']} with no bound on its gap, "
            "or an answer that ended")
    spread = c.get("top_n_spread_median")
    if spread is not None:
        parts.append(f"top-{c['top_n']} spread median {spread:.3g} nats")
    if c["identical"]:
        parts.insert(0, f"{c['prompts']} prompts x {c['tokens_per_prompt']} tokens identical")
    else:
        parts.append("tokens differ: " + "; ".join(
            f"{d['prompt']!r} at {d['position']}: {d['on']} ({d['logprob_on']}) vs "
            f"{d['off']} ({d['logprob_off']})" for d in c["first_differences"]))
    return "; ".join(parts)


# ------------------------------------------------------------------------------------- run


def census_step(cargs: argparse.Namespace, dep) -> tuple[int, dict[str, Any], Path]:
    """``k3rocm census`` on the selftest server: (exit code, census.json, run directory)."""
    from k3rocm.checks.census import cli

    census, run_dir = cli.run_live(cargs, dep, cli.analysis_from(cargs, dep))
    return cli.finish(census, run_dir), census.to_json(), run_dir


def bench_step(bargs: argparse.Namespace, dep) -> tuple[int, dict[str, Any], Path]:
    """One ``k3rocm bench`` point: (exit code, summary.json, run directory)."""
    from k3rocm.checks.bench import cli, run

    w, _ = cli.resolve_from_args(bargs, dep)
    res = run.run_bench(w, results=bargs.results, client_image=bargs.client_image,
                        server_timeout=bargs.server_timeout, label=bargs.label,
                        progress=not bargs.quiet, tp=bargs.tp, deployment=dep)
    print(res.message)
    return res.exit_code, res.summary, Path(res.summary.get("run_dir") or "")


def selftest(args: argparse.Namespace) -> int:  # noqa: C901 - one linear pipeline
    from k3rocm.deploy import runrecord
    from k3rocm.deploy.scale.status import summarize_decisions
    from k3rocm.rundir import create_run_dir
    from k3rocm.serving.basefacts import describe

    t0 = time.time()
    dep, srv, switches = _plan(args)  # exit 2 before anything starts
    problems: list[UsageError] = []
    try:
        margs = measure_args(args, dep)
    except UsageError as exc:
        problems.append(exc)
        margs = {}
    found, checked = early_checks(dep, getattr(margs.get("bench"), "client_image", None),
                                  args.no_build)
    problems += found
    checked.append(vendor_note(dep, REPO))
    try:  # the image as it is now (with --no-build, the one served); checked again once built
        base_check(dep, srv, switches, args.env_file)
    except UsageError as exc:
        problems.append(exc)
    if problems:
        for exc in problems:
            print(f"k3rocm: error: {exc}", file=sys.stderr)
        print("k3rocm selftest: nothing expensive was started (no build, no server, no run "
              "directory)", file=sys.stderr)
        return max(exc.exit_code for exc in problems)
    pipe = Pipeline("selftest", STEPS, args.verbose, t0)
    pipe.say("checked before any build or server: " + "; ".join(checked))
    run_dir = create_run_dir(dep.results_root, "selftest")
    dep, srv, switches = _plan(args, extra={"K3_PROFILER_DIR": f"/results/{run_dir.name}/traces"},
                               vendor_file=run_dir / "vendor.env")
    off_srv = dataclasses.replace(srv, env={**srv.env, **switches["A"]})  # arm A
    def log_of(server) -> Path:
        return run_dir / ("server-on.log" if server is srv else "server-off.log")

    runrecord.write(run_dir, runrecord.build(deployment=dep, url=dep.url, selftest={
        "project": srv.project, "model": dep.model}))
    summary: dict[str, Any] = {"run_dir": str(run_dir), "project": srv.project, "url": dep.url,
                               "model": dep.model, "profile": dep.profile, "image": dep.image,
                               "cpu_standin": srv.cpu, "checked_first": checked}
    running: list = []
    served: list = []  # a server was started: from here a failure is no longer "bad input"
    greedy_runs: dict[str, list[dict]] = {}

    def measure(res: StepResult):  # in-process, as values; its output in logs/<step>.log
        step, numbers = {"census": (census_step, census_numbers),
                         "bench": (bench_step, bench_numbers)}[res.name]
        try:
            res.code, doc, found = step(margs[res.name], dep)
        except UsageError as exc:  # the row says why; the selftest goes on
            print(f"k3rocm: error: {exc}", file=sys.stderr)
            res.code, res.note = exc.exit_code, str(exc)
            return
        res.run_dir = str(found)
        res.note, res.numbers = numbers(doc)

    def serve(server, res: StepResult) -> dict:
        running.append(server)
        server.up(log_path=log_of(server))
        served.append(server)
        res.numbers["ready_s"] = round(server.wait(args.timeout, log_path=log_of(server)), 1)
        prov = server.provenance()
        res.numbers["fusion_decisions"] = prov.get("fusion_decisions")
        res.note = f"ready after {res.numbers['ready_s']} s on {server.url}"
        return prov

    def stop(server):
        server.down(log_path=log_of(server))
        if server in running:
            running.remove(server)

    def build(res: StepResult):
        if not args.no_build:
            p = srv.compose("build", "server", timeout=None, capture=False)
            if p.returncode != 0:
                raise UsageError(f"building the serving image failed (exit {p.returncode})")
        res.numbers = summary["base"] = base_check(dep, srv, switches, args.env_file)
        res.note = "; ".join(summary["base"].get("notes") or []) or "base facts: no change"

    def up(res: StepResult):
        prov = serve(srv, res)
        summary["overlay_decisions"] = prov.get("fusion_decisions")
        summary["vllm_version"] = prov.get("vllm_version")

    def greedy_on(res: StepResult):
        greedy_runs["on"] = greedy(dep.url, srv.model, dep.api_key)
        res.note = f"{len(PROMPTS)} prompts x {GREEDY_TOKENS} tokens, fusions on (arm B)"

    def down(res: StepResult):
        stop(srv)
        res.note = f"server log kept: {log_of(srv)}"

    def off(res: StepResult):
        serve(off_srv, res)
        greedy_runs["off"] = greedy(dep.url, off_srv.model, dep.api_key)
        stop(off_srv)
        res.note = "fusions off: " + res.note

    def cmp(res: StepResult):
        c = compare(greedy_runs["on"], greedy_runs["off"])
        summary["greedy"] = {**c, **greedy_runs}
        res.ok, res.code = c["ok"], {"ok": 0, "fail": 1}.get(c["verdict"], 4)  # 4: no bound
        res.numbers = {k: c[k] for k in ("verdict", "identical", "max_logprob_gap",
                                         "max_gap_at", "unbounded", "tolerance", "top_n",
                                         "top_n_spread_median")}
        res.note = compare_note(c)

    plan = {"build": build, "up": up, "census": measure, "greedy": greedy_on,
            "bench": measure, "down": down, "off": off, "compare": cmp}

    def body():
        for name, fn in plan.items():
            if fn is measure:
                pipe.step(name, fn, log=run_dir / "logs" / f"{name}.log",
                          what=f"k3rocm {name} on {dep.url}")
            else:
                pipe.step(name, fn)

    def teardown():
        for server in list(running):
            pipe.say(f"stopping {server.project}")
            with contextlib.suppress(Exception):
                stop(server)

    code = pipe.run(body, teardown)
    if code == 2 and served:  # exit 2 promises nothing expensive was started: not so here
        code = 4
        bad = next((r for r in pipe.results if r.code == 2), None)
        if bad is not None:
            bad.note += (" [exit 2 (bad input) found after a server had started: the selftest "
                         "exits 4, cannot judge; fix the input and run it again]")
    head, *notes = describe(summary.get("base") or {})
    decisions = summary.get("overlay_decisions")
    pipe.finish(code, run_dir, f"{dep.model} on {dep.url} (profile {dep.profile}, image "
                f"{dep.image}" + (", CPU stand-in: fusions cannot run, both servers stock"
                                  if srv.cpu else "") + ")", summary,
                before=[f"  {head}", *(f"    {n}" for n in notes), *(
                    ["  overlay decisions (fusions on, arm B): " + summarize_decisions(
                        {(d.get("pid"), d.get("layer_kind")): d for d in decisions})]
                    if decisions is not None else []), ""],
                after=["  checked first: " + "; ".join(checked), "",
                       f"  run directory: {run_dir} (summary.json, summary.md, logs/, "
                       "server-on.log, server-off.log, traces/)"])
    return code
