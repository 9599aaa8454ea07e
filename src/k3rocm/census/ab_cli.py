"""``k3rocm census-ab``: the kernel census with the fusions off vs on, each on a fresh server.

Arm ``off`` runs with K3_FUSE_QK_NORM=0 K3_FUSE_DECODE_QPREP=0, arm ``on`` with both 1; each
arm starts its own server container from the same image (docker-py, the same container
settings as compose), waits for health, profiles the same decode load, collects the traces
out of the container, runs the census (its own expected-vs-seen check from the states the
overlay reported), and stops the server (its log is kept). The comparison reports launches
and time per MLA layer per decode step for each role, off vs on.

Run directory: ``results/<UTC>-census-ab/`` with ``off/`` and ``on/`` (each a full census run
directory + server.log), ``ab.json``, ``ab.md`` and ``provenance.json``.
Exit 0 when both arms pass their census, 1 when one does not, 2 bad input, 3 server problems.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from k3rocm.census.analyze import Census
from k3rocm.census.cli import live_census, validate_common
from k3rocm.census.common import add_analysis_arguments, base_provenance, positive, results_root
from k3rocm.census.fusions import from_log
from k3rocm.errors import UsageError
from k3rocm.rundir import create_run_dir, write_json_atomic, write_text_atomic

ARMS = {"off": {"K3_FUSE_QK_NORM": "0", "K3_FUSE_DECODE_QPREP": "0"},
        "on": {"K3_FUSE_QK_NORM": "1", "K3_FUSE_DECODE_QPREP": "1"}}
ROLES = ("fused_qk_norm", "qk_norm", "fused_qprep", "cache_write", "q_concat_quant",
         "qprep_group")
CONTAINER_TRACE_DIR = "/tmp/k3rocm-census-traces"
LABEL = "k3rocm.census"


def _log(msg: str) -> None:
    print(f"[census-ab] {msg}", file=sys.stderr, flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    p.add_argument("--image", default=os.environ.get("K3_SERVER_IMAGE", "k3rocm/server:latest"),
                   help="serving image both arms start from")
    p.add_argument("--port", type=int, default=18400, help="host port (127.0.0.1) for the arms")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra server environment for both arms (repeatable); the K3_* "
                   "variables of this shell are passed too, like compose does")
    p.add_argument("--models-dir", default=os.environ.get("K3_MODELS_DIR", "./models"),
                   help="host directory mounted read-only at /models")
    p.add_argument("--cache-dir", default=os.environ.get("K3_CACHE_DIR"),
                   help="host directory mounted at /cache (HF/vLLM/AITER caches)")
    p.add_argument("--gpu", choices=("auto", "yes", "no"), default="auto",
                   help="ROCm device settings (auto: yes unless K3_PROFILE=cpu-smoke)")
    p.add_argument("--arms", default="off,on", help="arms in run order (off, on)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--server-timeout", type=float, default=3600.0,
                   help="seconds each fresh server may take to become healthy")
    p.add_argument("--trace-timeout", type=float, default=900.0)
    p.add_argument("--label", default="census-ab")
    add_analysis_arguments(p)
    p.set_defaults(server_trace_dir=None, fusions=None, server_log=None)


def _server_env(args: argparse.Namespace, arm: str) -> dict[str, str]:
    from k3rocm.bench.server import server_env_from_host

    env = server_env_from_host()
    for item in args.env:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise UsageError(f"--env {item!r} is not KEY=VALUE")
        env[k] = v
    env.update(ARMS[arm])
    env["K3_PROFILER_DIR"] = CONTAINER_TRACE_DIR  # copied out of the container afterwards
    env.setdefault("VLLM_RPC_TIMEOUT", "1800000")
    return env


def _per_layer(c: Census) -> dict[int, dict[str, Any]]:
    return {row["rank"]: row for row in c.per_layer_step()}


def compare(arms: dict[str, Census]) -> dict[str, Any]:
    off, on = _per_layer(arms["off"]), _per_layer(arms["on"])
    rows = []
    for rank in sorted(set(off) & set(on)):
        for role in ROLES:
            a, b = off[rank][role], on[rank][role]
            la, lb = a["launches_per_layer_step"], b["launches_per_layer_step"]
            ta, tb = a["us_per_layer_step"], b["us_per_layer_step"]
            rows.append({"rank": rank, "role": role,
                         "off_launches": a["launches"], "on_launches": b["launches"],
                         "off_launches_per_layer_step": la, "on_launches_per_layer_step": lb,
                         "off_us_per_layer_step": ta, "on_us_per_layer_step": tb,
                         "delta_us_per_layer_step": None if ta is None or tb is None
                         else round(tb - ta, 4)})
    return {"rows": rows,
            "decode_steps": {k: {r["rank"]: r["decode_steps"] for r in v.per_layer_step()}
                             for k, v in arms.items()}}


def render_ab_markdown(arms: dict[str, Census], cmp: dict[str, Any], meta: dict[str, Any]) -> str:
    unit = "device" if all(p["mode"] == "gpu" for c in arms.values() for p in c.per_rank) \
        else "host (CPU operator)"
    lines = ["# Decode kernel census A/B: fusions off vs on", "",
             f"Protocol: one fresh server per arm from image `{meta['image']}` "
             f"({meta.get('image_id', '?')}), the same load in both arms (concurrency "
             f"{meta['concurrency']}, {meta['max_tokens']} output tokens, profiling "
             f"{meta['steps']} decode steps after prefill), one profile per arm. "
             f"Times are {unit} times per MLA layer per decode step.", ""]
    for name, c in arms.items():
        f = c.fusions
        lines.append(f"- arm **{name}** (requested {ARMS[name]}): reported q/kv RMSNorm "
                     f"{'ON' if f.qk_norm else 'OFF'} ({f.reasons.get('qk_norm', '')}), decode "
                     f"Q-prep {'ON' if f.decode_qprep else 'OFF'} "
                     f"({f.reasons.get('decode_qprep', '')}); census "
                     f"**{'PASS' if c.ok else 'FAIL'}** (see `{name}/census.md`)")
    lines += ["", "| rank | role | launches off | launches on | launches/layer/step off | "
              "on | us/layer/step off | on | delta us |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in cmp["rows"]:
        lines.append(f"| {r['rank']} | {r['role']} | {r['off_launches']} | {r['on_launches']} "
                     f"| {r['off_launches_per_layer_step']} | {r['on_launches_per_layer_step']} "
                     f"| {r['off_us_per_layer_step']} | {r['on_us_per_layer_step']} | "
                     f"{r['delta_us_per_layer_step']} |")
    lines += ["", "qprep_group = KV-cache write + q concat/fp8 quant + fused Q-prep launches in "
              "decode-only steps (the launches the decode Q-prep fusion replaces). A single "
              "profile per arm: launch counts are exact, times are one sample (no confidence "
              "interval).", ""]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from k3rocm.bench.server import ServerSpec, start_server, stop_server, wait_ready

    validate_common(args)
    if args.fusions or args.server_log:
        raise UsageError("census-ab reads each arm's fusion states from its server log; "
                         "--fusions/--server-log are for `census`")
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if sorted(arms) != ["off", "on"]:
        raise UsageError(f"--arms {args.arms!r} must name off and on once each (e.g. off,on)")
    for name in ("--concurrency", "--steps", "--port"):
        positive(name, getattr(args, name[2:].replace("-", "_")))
    positive("--max-tokens", args.max_tokens, args.steps + 12)
    envs = {a: _server_env(args, a) for a in arms}
    import docker

    try:
        client = docker.from_env(timeout=600)
        client.ping()
    except Exception as exc:  # noqa: BLE001
        raise UsageError(f"no Docker engine ({exc.__class__.__name__}); census-ab starts "
                         "fresh server containers", 3) from None
    try:
        image = client.images.get(args.image)
    except docker.errors.ImageNotFound:
        raise UsageError(f"server image {args.image!r} not found: build it or pass --image",
                         2) from None
    gpu = {"yes": True, "no": False}.get(args.gpu,
                                         envs["on"].get("K3_PROFILE", "") != "cpu-smoke")
    run_dir = create_run_dir(results_root(args), args.label)
    _log(f"run directory {run_dir}")
    url = f"http://127.0.0.1:{args.port}"
    api_key = envs["on"].get("K3_API_KEY")
    results: dict[str, Census] = {}
    stamp = time.strftime("%H%M%S")
    for arm in arms:
        arm_dir = run_dir / arm
        arm_dir.mkdir()
        spec = ServerSpec(image=args.image, port=args.port, env=envs[arm],
                          models_dir=args.models_dir, cache_dir=args.cache_dir, gpu=gpu)
        _log(f"arm {arm}: starting a fresh server from {args.image} ({ARMS[arm]})")
        container = start_server(client, spec, f"k3rocm-census-{arm}-{stamp}-{os.getpid()}",
                                 {LABEL: arm})
        try:
            def alive(c=container) -> str | None:
                c.reload()
                return c.status

            model = envs[arm].get("K3_SERVED_MODEL_NAME") or _served_name(envs[arm])
            wait_ready(url, model, args.server_timeout, api_key, is_alive=alive)
            fusions = from_log(container.logs().decode(errors="replace"),
                               f"log of the {arm} arm's server")
            results[arm] = live_census(args, url, model, api_key, client, container, fusions,
                                       arm_dir, title=f"Decode kernel census, arm {arm}")
            print(f"--- arm {arm} ---")
            print(results[arm].table())
        finally:
            stop_server(container, arm_dir / "server.log")
    cmp = compare(results)
    meta = {"image": args.image, "image_id": image.id, "concurrency": args.concurrency,
            "max_tokens": args.max_tokens, "steps": args.steps}
    write_json_atomic(run_dir / "ab.json", {
        "ok": all(c.ok for c in results.values()), "meta": meta, "comparison": cmp,
        "arms": {k: {"ok": v.ok, "fusions": v.fusions.to_json(),
                     "checks": [c.to_json() for c in v.checks]} for k, v in results.items()}})
    md = render_ab_markdown(results, cmp, meta)
    write_text_atomic(run_dir / "ab.md", md)
    write_json_atomic(run_dir / "provenance.json", {
        **base_provenance([r.path for c in results.values() for r in c.traces.ranks]),
        "image": args.image, "image_id": image.id,
        "server_env": {k: {kk: ("<redacted>" if "KEY" in kk or "TOKEN" in kk else vv)
                           for kk, vv in v.items()} for k, v in envs.items()},
        "arms": {a: f"{a}/provenance.json" for a in arms}})
    print(md)
    ok = all(c.ok for c in results.values())
    print(f"census-ab: {'PASS' if ok else 'FAIL'}; report in {run_dir}/ab.md")
    return 0 if ok else 1


def _served_name(env: dict[str, str]) -> str:
    if env.get("K3_PROFILE") == "cpu-smoke":
        return "k3-smoke"
    return "moonshotai/Kimi-K3"
