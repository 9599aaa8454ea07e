"""``k3rocm selftest`` (``make selftest``): before the 1.5 TB load, prove on a small Kimi-K3-shaped
checkpoint that this base, this overlay and these settings serve, fuse and agree.

- ``k3rocm selftest model [SRC] [OUT]``: cut the small checkpoint from the operator's own one
  (:mod:`k3rocm.deploy.selftest_model`; default OUT ``<K3_MODELS_DIR>/Kimi-K3-selftest``).
- ``k3rocm selftest run``: the deployment ``make up`` would serve (same profile, settings,
  image, compose service, entrypoint), with only ``K3_MODEL`` (the small checkpoint),
  ``K3_PORT`` (+1) and ``K3_PROFILER_DIR`` (inside the run directory) changed, in its own
  compose project. Steps:

    build    the serving image (as make up), then the base facts recorded in it are applied to
             the settings: a setting the base cannot run stops here (exit 2), before any load
    up       serve arm B (the fusions --on names on); wait until ready; provenance (overlay
             decisions)
    census   decode kernel census from the server's profiler (expectations from the small
             model's own MLA layer count)
    greedy   a few fixed prompts, greedy, with logprobs
    bench    one short aiperf point
    down     server log kept
    off      the same server with every K3_FUSE_* switch 0: greedy again, down
    compare  greedy tokens fusions on vs off: identical, or the first position that differs
             with both logprobs

  The two servers are the A/B's two arms (:func:`k3rocm.checks.ab.arms.arm_envs`): "off" is
  arm A (every K3_FUSE_* switch 0), the first server is arm B (the fusions ``--on`` names, default
  all, switched on, the rest off). Both are rendered against the serving image's base facts
  before the build (the image as it is) and again after it, as the A/B does before its first
  cold start: an arm the base cannot serve is refused (exit 2) before any server starts, naming
  the ``--on`` choices the base can serve.

  One summary (stdout, ``summary.md``, ``summary.json``) in ``<results>/<UTC>-selftest/``,
  each step's log under ``logs/``, both server logs kept. Every server it started is stopped at
  the end, on failure and on Ctrl-C / SIGTERM.

On the CPU stand-in (``CPU=1``) the same steps run with the tiny DeepSeek-shaped smoke model
(Kimi-K3's KDA layers need GPU kernels); the fusions need ROCm + AITER, so there both servers
are arm A (the stock path; a K3_FUSE_* switch set in the shell or .env is kept for the first)
and the census checks the stock counts.

Exit codes: 0 every step ok; 1 a check failed (census, greedy tokens differ, bench point);
2 bad input or a setting the base cannot run (nothing loaded); 3 a server did not come up;
130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

from k3rocm.checks.ab import arms as armlib
from k3rocm.checks.steps import (
    Interrupted,
    StepResult,
    bench_numbers,
    census_numbers,
    new_dirs,
    run_step,
    say,
    step_rows,
    verdict,
)
from k3rocm.deploy import selftest_model
from k3rocm.errors import UsageError

PROJECT = "k3rocm-selftest"
PROMPTS = ("The capital of France is", "def fibonacci(n):", "1, 2, 3, 5, 8,",
           "Kimi-K3 runs on eight MI355X GPUs and")
GREEDY_TOKENS = 16
STEPS = ("build", "up", "census", "greedy", "bench", "down", "off", "compare")


_say = functools.partial(say, tag="selftest")


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
        "run", help="serve the small checkpoint as `make up` would; census, greedy off/on, bench",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--model", default=None,
                   help="the small checkpoint: a /models/... path or a host directory under "
                   f"K3_MODELS_DIR (default: /models/{selftest_model.DEFAULT_OUT}; on the CPU "
                   "stand-in the deployment's own K3_MODEL)")
    r.add_argument("--port", type=int, default=None,
                   help="host port of the selftest server (default: the deployment's K3_PORT "
                   "+ 1)")
    r.add_argument("--project", default=PROJECT, help=f"compose project (default {PROJECT})")
    r.add_argument("--timeout", type=float, default=1800,
                   help="seconds to wait for each server (default 1800)")
    r.add_argument("--no-build", action="store_true",
                   help="do not build the serving image first (it must exist)")
    r.add_argument("--workload", default=None,
                   help="bench workload for the short point (default: ci-tiny on the CPU "
                   "stand-in, decode-8k1k on the node), one point: --bench-args to change it")
    r.add_argument("--bench-args", default="",
                   help="more `k3rocm bench` arguments (default: concurrency 1, 4 requests)")
    r.add_argument("--census-args", default="",
                   help="more `k3rocm census` arguments")
    armlib.add_on_argument(r)
    r.add_argument("--verbose", action="store_true", help="stream each step's output too")
    r.add_argument("--env-file", default=".env", help="settings file (default .env)")


def run(args: argparse.Namespace) -> int:
    if args.what == "model":
        return selftest_model.run(args)
    return selftest(args)


def deployment_view(args: argparse.Namespace) -> dict:
    """What ``--print-deployment`` shows: the selftest server's deployment for ``run``."""
    from k3rocm.deploy.deployment import load_deployment

    if args.what != "run":
        return load_deployment(env_file=args.env_file).to_json()
    dep, srv, switches = _plan(args, check_model=False)
    return {**dep.to_json(), "project": srv.project, "arm_env": switches}


# ------------------------------------------------------------------------------------ plan


def arms(on: str, base) -> dict[str, dict[str, str]]:
    """The two servers' switches: the A/B's arms (:func:`k3rocm.checks.ab.arms.arm_envs`), B
    first ("on"), then A ("off"). On the CPU stand-in (``base``: the deployment) the fusions
    cannot run (no ROCm, no AITER): B is arm A too, except a switch the user set (shell or
    .env)."""
    envs = armlib.arm_envs(on)
    if base.cpu:
        envs["B"] = {k: base.rendered.env[k] if base.sources.get(k) in ("env", ".env") else v
                     for k, v in envs["A"].items()}
    return envs


def _plan(args: argparse.Namespace, check_model: bool = True, extra: dict | None = None):
    """The selftest server (fusions on: arm B): (deployment, ComposeServer, the arms' switches).
    Bad input raises UsageError (exit 2) before anything starts."""
    from k3rocm.deploy.deployment import load_deployment
    from k3rocm.deploy.lifecycle import ComposeServer

    if args.timeout <= 0:
        raise UsageError(f"--timeout {args.timeout:g} must be > 0")
    for opt in ("bench_args", "census_args"):
        try:
            shlex.split(getattr(args, opt, "") or "")
        except ValueError as exc:
            raise UsageError(f"--{opt.replace('_', '-')}: {exc}") from None
    base = load_deployment(env_file=args.env_file)
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
    # the same settings as `make up` (shell > .env > profile > default), these changed
    dep = load_deployment({**os.environ, **env}, env_file=args.env_file,
                          check_model=check_model, gpu=not cpu)
    # CPU stand-in: vLLM's logprob ranking (sampler.batched_count_greater_than) is a
    # torch.compile'd function, and the stand-in image has no C++ compiler for Inductor's CPU
    # backend: a logprobs request would kill the engine (InvalidCxxCompiler). Eager there.
    srv = ComposeServer(project=args.project, cpu=cpu, env=env, url=dep.url,
                        model=dep.served_model_name, api_key=dep.api_key,
                        container_env={"TORCHDYNAMO_DISABLE": "1"} if cpu else {})
    return dep, srv, switches


def base_check(dep, srv, switches: dict[str, dict[str, str]], env_file: str) -> dict[str, Any]:
    """Both servers (the A/B's arms) rendered against the base facts recorded in the image, by
    the A/B's own check (:func:`k3rocm.checks.ab.arms.base_check`): a refusal is exit 2 before
    any server starts. The fusions-on server's base decision, with where the facts came from
    and both arms' decisions."""
    checked = armlib.base_check(switches, {**os.environ, **srv.env}, env_file, dep.image,
                                dep.settings.profile)
    if not checked["arms"]:
        return {"facts_from": checked["facts_from"],
                "notes": ["base facts unknown: checked at start"]}
    return {**checked["arms"]["B"], "facts_from": checked["facts_from"], "arms": checked["arms"]}


# --------------------------------------------------------------------------------- greedy


def greedy(url: str, model: str, api_key: str | None, timeout: float = 300) -> list[dict]:
    """Greedy completions of the fixed prompts with the chosen token's logprob."""
    import requests

    from k3rocm.deploy.server_api import ServerAPI

    api = ServerAPI(url, api_key, timeout=timeout)
    out = []
    for prompt in PROMPTS:
        try:
            r = api.post("/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": GREEDY_TOKENS,
                "temperature": 0, "logprobs": 1, "ignore_eos": True, "seed": 0})
            r.raise_for_status()
            lp = r.json()["choices"][0]["logprobs"]
        except (requests.RequestException, KeyError, IndexError, ValueError) as exc:
            raise UsageError(f"greedy request to {url} failed ({exc.__class__.__name__}: "
                             f"{str(exc)[:200]})", 3) from None
        out.append({"prompt": prompt, "tokens": lp["tokens"],
                    "logprobs": [round(float(x), 6) if x is not None else None
                                 for x in lp["token_logprobs"]]})
    return out


def compare(on: list[dict], off: list[dict]) -> dict[str, Any]:
    """Identical token sequences, or per prompt the first position that differs."""
    diffs = []
    for a, b in zip(on, off, strict=True):
        pairs = enumerate(zip(a["tokens"], b["tokens"], strict=False))
        pos = next((i for i, (x, y) in pairs if x != y),
                   None if len(a["tokens"]) == len(b["tokens"]) else
                   min(len(a["tokens"]), len(b["tokens"])))
        if pos is not None:
            diffs.append({"prompt": a["prompt"], "position": pos,
                          "on": a["tokens"][pos:pos + 1], "off": b["tokens"][pos:pos + 1],
                          "logprob_on": (a["logprobs"][pos:pos + 1] or [None])[0],
                          "logprob_off": (b["logprobs"][pos:pos + 1] or [None])[0]})
    gap = max((abs(x - y) for a, b in zip(on, off, strict=True)
               for x, y in zip(a["logprobs"], b["logprobs"], strict=False)
               if x is not None and y is not None), default=None)
    return {"identical": not diffs, "prompts": len(on), "tokens_per_prompt": GREEDY_TOKENS,
            "first_differences": diffs, "max_logprob_gap": gap}


# ------------------------------------------------------------------------------------- run


def selftest(args: argparse.Namespace) -> int:  # noqa: C901 - one linear pipeline
    from k3rocm.deploy import runrecord
    from k3rocm.rundir import create_run_dir, write_json_atomic, write_text_atomic

    t0 = time.time()
    dep, srv, switches = _plan(args)  # exit 2 before anything starts
    if not args.no_build:  # the image as it is now; checked again once built
        base_check(dep, srv, switches, args.env_file)
    run_dir = create_run_dir(dep.results_root, "selftest")
    trace_dir = f"/results/{run_dir.name}/traces"
    dep, srv, switches = _plan(args, extra={"K3_PROFILER_DIR": trace_dir})
    # the same server as arm A: every fusion off
    off_srv = dataclasses.replace(srv, env={**srv.env, **switches["A"]})
    runrecord.write(run_dir, runrecord.build(deployment=dep, url=dep.url, selftest={
        "project": srv.project, "model": dep.model}))
    host_model = dep.model_host_dir
    workload = args.workload or ("ci-tiny" if srv.cpu else "decode-8k1k")
    py = sys.executable
    env = {**os.environ, **srv.env, "COMPOSE_PROJECT_NAME": srv.project}
    commands = {
        "census": [py, "-m", "k3rocm", "census", "--url", dep.url, "--results",
                   str(dep.results_root), *(["--model-dir", str(host_model)] if host_model
                                            else []), *shlex.split(args.census_args)],
        "bench": [py, "-m", "k3rocm", "bench", "--workload", workload, "--url", dep.url,
                  "--results", str(dep.results_root), "--label", "selftest-bench",
                  *(["--tokenizer", str(host_model)] if host_model else []),
                  "--set", "concurrency=1", "--set", "request_count=4",
                  *shlex.split(args.bench_args)],
    }
    results: list[StepResult] = []
    summary: dict[str, Any] = {"run_dir": str(run_dir), "project": srv.project, "url": dep.url,
                               "model": dep.model, "profile": dep.profile, "image": dep.image,
                               "cpu_standin": srv.cpu}
    running = []
    greedy_runs: dict[str, list[dict]] = {}
    total = len(STEPS)

    def step(name: str, fn, index: int) -> None:
        _say(t0, f"{index}/{total} {name}")
        start = time.time()
        res = StepResult(name, name)
        try:
            fn(res)
            res.ok = res.ok or res.code == 0
        except UsageError as exc:
            res.code, res.note = exc.exit_code, str(exc)
            raise
        finally:
            res.seconds = time.time() - start
            results.append(res)
            _say(t0, f"{index}/{total} {name}: {'ok' if res.ok else 'FAILED'} in "
                 f"{res.seconds:.0f}s{': ' + res.note if res.note else ''}")

    def sub(res: StepResult):  # census or bench: the user's own command, its run directory
        name, log = res.name, run_dir / "logs" / f"{res.name}.log"
        before = {p.name for p in dep.results_root.iterdir()} \
            if dep.results_root.is_dir() else set()
        code, _, _ = run_step(name, commands[name], env, log, t0, STEPS.index(name) + 1,
                              args.verbose, total, "selftest")
        res.code, res.ok, res.log = code, code == 0, str(log)
        res.command = shlex.join(commands[name])
        found = new_dirs(dep.results_root, before, "-census" if name == "census"
                         else "-selftest-bench")
        if found:
            res.run_dir = str(found[-1])
            res.note, res.numbers = (census_numbers if name == "census" else
                                     bench_numbers)(found[-1])

    def serve(server, res: StepResult):
        running.append(server)
        server.up()
        res.numbers["ready_s"] = round(server.wait(args.timeout, log_path=run_dir / log_name(
            server)), 1)
        prov = server.provenance()
        res.numbers["fusion_decisions"] = prov.get("fusion_decisions")
        res.note = f"ready after {res.numbers['ready_s']} s on {server.url}"
        return prov

    def log_name(server) -> str:
        return "server-on.log" if server is srv else "server-off.log"

    def stop(server):
        server.down(log_path=run_dir / log_name(server))
        if server in running:
            running.remove(server)

    def build(res: StepResult):
        if not args.no_build:
            p = srv.compose("build", "server", timeout=None, capture=False)
            if p.returncode != 0:
                raise UsageError(f"building the serving image failed (exit {p.returncode})")
        summary["base"] = base_check(dep, srv, switches, args.env_file)
        res.numbers = summary["base"]
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
        res.note = f"server log kept: {run_dir / 'server-on.log'}"

    def off(res: StepResult):
        serve(off_srv, res)
        greedy_runs["off"] = greedy(dep.url, off_srv.model, dep.api_key)
        stop(off_srv)
        res.note = "fusions off: " + res.note

    def cmp(res: StepResult):
        c = compare(greedy_runs["on"], greedy_runs["off"])
        summary["greedy"] = {**c, **greedy_runs}
        res.ok = c["identical"]
        res.code = 0 if res.ok else 1
        res.note = (f"{c['prompts']} prompts x {GREEDY_TOKENS} tokens identical "
                    f"(max logprob gap {c['max_logprob_gap']})" if res.ok else
                    "differ: " + "; ".join(f"{d['prompt']!r} at {d['position']}: "
                                           f"{d['on']} ({d['logprob_on']}) vs {d['off']} "
                                           f"({d['logprob_off']})"
                                           for d in c["first_differences"]))

    plan = {"build": build, "up": up, "census": sub, "greedy": greedy_on, "bench": sub,
            "down": down, "off": off, "compare": cmp}

    def _term(*_):
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, _term)
    try:
        for index, name in enumerate(STEPS, 1):
            step(name, plan[name], index)
        code = next((r.code or 1 for r in results if not r.ok), 0)
    except (KeyboardInterrupt, Interrupted):
        code = 130
    except UsageError as exc:
        code = exc.exit_code
        print(f"k3rocm: error: {exc}", file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, old_term)
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for server in list(running):
                _say(t0, f"stopping {server.project}")
                with contextlib.suppress(Exception):
                    stop(server)
        finally:
            signal.signal(signal.SIGINT, old_int)
    seconds = time.time() - t0
    lines = [f"k3rocm selftest: {verdict(code)} in {seconds:.0f}s: {dep.model} on {dep.url} "
             f"(profile {dep.profile}, image {dep.image}"
             + (", CPU stand-in: fusions cannot run, both servers stock" if srv.cpu else "")
             + ")", ""]
    from k3rocm.deploy.scale.status import summarize_decisions
    from k3rocm.serving.basefacts import describe

    head, *notes = describe(summary.get("base") or {})
    lines += [f"  {head}", *(f"    {n}" for n in notes)]
    decisions = summary.get("overlay_decisions")
    if decisions is not None:
        lines.append("  overlay decisions (fusions on, arm B): " + summarize_decisions(
            {(d.get("pid"), d.get("layer_kind")): d for d in decisions}))
    lines.append("")
    lines += step_rows(results)
    lines += ["", f"  run directory: {run_dir} (summary.json, summary.md, logs/, "
              "server-on.log, server-off.log, traces/)"]
    text = "\n".join(lines)
    summary.update({"status": "ok" if code == 0 else ("interrupted" if code == 130 else
                                                      "failed"),
                    "exit_code": code, "seconds": round(seconds, 1),
                    "steps": [{"name": r.name, "ok": r.ok, "exit_code": r.code,
                               "seconds": round(r.seconds, 1), "note": r.note,
                               "run_dir": r.run_dir, "log": r.log, "numbers": r.numbers}
                              for r in results]})
    write_json_atomic(run_dir / "summary.json", summary)
    write_text_atomic(run_dir / "summary.md", "```\n" + text + "\n```\n")
    print(text)
    return code
