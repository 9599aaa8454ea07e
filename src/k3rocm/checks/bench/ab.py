"""Fusion off (A) vs on (B) under one protocol, or A/A for the noise floor.

Protocol (the same for every slot, stated in every report): the slots run in the interleaved
order A B B A A B B A ...; each slot starts a fresh server (its own compose project, through
:mod:`k3rocm.checks.ab.arms`) with the arm's fusion toggles, waits until it is ready, then runs
the whole workload (its own warmups, the same seed and request counts) in the client
container, then saves the server's log and removes it. Nothing is shared between slots, so no
arm gets a warmer server or a different position in a longer sweep.

Calibration (``mode == "cal"``, CPU stand-in only): both arms as in A/A, arm B with a known
injected delay per engine step; the report states injected vs detected ITL change.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3rocm.checks.ab import arms as armlib
from k3rocm.checks.bench import runner, stats, summary
from k3rocm.checks.bench.run import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    check_tokenizer,
    run_bench,
)
from k3rocm.checks.bench.workloads import Workload, shell_line
from k3rocm.errors import UsageError
from k3rocm.rundir import create_run_dir, write_json_atomic, write_text_atomic


def _log(msg: str) -> None:
    print(f"[bench-ab] {msg}", file=sys.stderr, flush=True)


@dataclass
class ABPlan:
    workload: Workload
    arms: armlib.Arms
    results: Path
    client_image: str
    runs_per_server: int = 1
    noise_floor_dir: Path | None = None
    n_boot: int = 2000
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def mode(self) -> str:  # "ab" | "aa" | "cal"
        return self.arms.mode

    @property
    def repeats(self) -> int:
        return self.arms.repeats

    @property
    def arm_env(self) -> dict[str, dict[str, str]]:
        return self.arms.arm_env

    def slots(self) -> list[str]:
        return self.arms.slots()

    def protocol_key(self, image_id: str | None) -> str:
        """Same key <=> same protocol: workload protocol, server image, server env minus the
        fusion toggles, repeats and order."""
        base_env = {k: v for k, v in self.arms.describe_env().items()
                    if k != "K3_TEST_PLUGINS_DIR"}
        blob = json.dumps({"workload": self.workload.protocol(), "image_id": image_id,
                           "server_env": base_env, "gpu": not self.arms.cpu,
                           "pin_engine_core": self.arms.pin_engine_core,
                           "runs_per_server": self.runs_per_server}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def describe(self) -> list[str]:
        w = self.workload
        if self.mode == "aa":
            arms = "A/A: both arms identical (" + _env_str(self.arm_env["A"]) + ")"
        elif self.mode == "cal":
            arms = (f"calibration: both arms {_env_str(self.arm_env['A'])}; arm B with an "
                    f"injected {self.arms.delay_ms:g} ms per engine step "
                    f"({armlib.STEP_DELAY_ENV}, CPU stand-in test double)")
        else:
            arms = (f"A = fusions off ({_env_str(self.arm_env['A'])}), B = fusions on "
                    f"({_env_str(self.arm_env['B'])})")
        k = self.runs_per_server
        runs = ("the complete workload" if k == 1 else
                f"the complete workload {k} times back to back (run 1 on the fresh server, "
                f"run 2.. on the same server: identical for both arms)")
        return [
            f"mode {self.mode.upper()}: {arms}",
            f"order {' '.join(self.slots())} ({self.repeats} server(s) per arm, interleaved; "
            f"{self.repeats * k} run(s) per arm)",
            "every slot: a freshly started server (its own compose project, image "
            f"{self.arms.image or 'compose default'}), wait until ready, {runs} `{w.name}` "
            "with its "
            f"own {w.warmup_request_count} warmup requests per point, then the server is stopped",
            f"topology: {_env_str(self.arms.topology())}",
            "statistic: per arm the median over repeats of the per-run value (computed from the "
            "run's per-request records); effect d = (B - A) / A; 95% CI from a two-level "
            "bootstrap (repeats, then requests within each repeat)",
            f"server env (both arms): {_env_str(self.arms.describe_env())}"
            + ("; EngineCore pinned to the worker's cores (CPU stand-in)"
               if self.arms.pin_engine_core else ""),
        ]


def _env_str(env: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(env.items())) or "(none)"


def _run_name(slot: int, arm: str, k: int) -> str:
    return f"{slot:02d}-{arm}-{k}"


def dry_run_lines(plan: ABPlan) -> list[str]:
    from k3rocm.checks.bench.run import planned_command
    from k3rocm.rundir import utc_stamp

    lines = [f"# {x}" for x in plan.describe()]
    run_dir = plan.results.resolve() / f"{utc_stamp()}-{plan.workload.name}-{plan.mode}"
    for i, arm in enumerate(plan.slots()):
        env = {**plan.arms.compose_env(arm), **plan.arms.arm_container_env.get(arm, {})}
        lines.append(f"# slot {i} arm {arm}: compose up (server) with {_env_str(env)}")
        if plan.arms.scale is not None:
            from k3rocm.deploy.scale.render import router_argv

            lines.append(f"#   replicas on ports {plan.arms.replica_ports} (K3_PORT each), "
                         f"then the router: {' '.join(router_argv(plan.arms.scale))}")
        for k in range(plan.runs_per_server):
            lines.append(shell_line(planned_command(plan.workload,
                                                    run_dir / "runs" / _run_name(i, arm, k))))
    return lines


# ---------------------------------------------------------------------------------------------


def run_ab(plan: ABPlan, docker=None) -> int:
    w = plan.workload
    check_tokenizer(w.tokenizer)
    armlib.check_port(plan.arms)
    client = docker or runner.docker_client()
    runner.check_client_image(client, plan.client_image)
    image_ref, image_id = armlib.image_id(plan.arms, client)
    armlib.announce(plan.arms, plan.results, plan.runs_per_server)
    key = plan.protocol_key(image_id)
    ab_dir = create_run_dir(plan.results, f"{w.name}-{plan.mode}")
    _log(f"{plan.mode.upper()} run directory {ab_dir} (protocol {key})")
    plan_doc = {"mode": plan.mode, "protocol_key": key, "protocol": plan.describe(),
                "workload": w.model_dump(mode="json"), "slots": plan.slots(),
                "arm_env": plan.arm_env, "arm_container_env": plan.arms.arm_container_env,
                "server_image": image_ref, "server_image_id": image_id,
                "server_env": plan.arms.describe_env(), "topology": plan.arms.topology(),
                **plan.extra}
    write_json_atomic(ab_dir / "plan.json", plan_doc)

    runs: list[dict[str, Any]] = []
    slots_info: list[dict[str, Any]] = []
    interrupted = False
    stamp = ab_dir.name.split("-")[0].lower()
    t_all = time.time()
    slot_dir = ab_dir / "runs"
    slot_dir.mkdir(parents=True, exist_ok=True)
    for i, arm in enumerate(plan.slots()):
        _log(f"slot {i + 1}/{len(plan.slots())} arm {arm}: starting a fresh server "
             f"({_env_str({**plan.arm_env[arm], **plan.arms.arm_container_env.get(arm, {})})})")
        slot_failed = None
        info: dict[str, Any] = {"server": None, "server_ready_s": None, "pin": None}
        t0 = time.time()
        try:
            with armlib.arm_server(plan.arms, i, arm, stamp,
                                   slot_dir / f"{i:02d}-{arm}-server.log", ab_dir / "servers",
                                   model=w.model, api_key=w.api_key, client=client
                                   ) as (srv, info):
                container = srv.container(client)
                for k in range(plan.runs_per_server):
                    run_dir = slot_dir / _run_name(i, arm, k)
                    run_dir.mkdir()
                    entry: dict[str, Any] = {
                        "slot": i, "arm": arm, "run": k, "server": info["server"],
                        "run_dir": str(run_dir), "status": "failed", "env": plan.arm_env[arm],
                        "container_env": plan.arms.arm_container_env.get(arm, {}),
                        "server_ready_s": info["server_ready_s"], "pin": info["pin"]}
                    runs.append(entry)
                    t1 = time.time()
                    res = run_bench(w, results=plan.results, client_image=plan.client_image,
                                    server_timeout=30, progress=plan.progress,
                                    server_container=container, docker=client,
                                    run_dir=run_dir,
                                    extra_provenance={"ab": {"mode": plan.mode, "slot": i,
                                                             "arm": arm, "run": k,
                                                             "protocol_key": key,
                                                             "compose_project":
                                                                 info["server"],
                                                             "topology": info["topology"]}})
                    entry.update(status=res.status, message=res.message,
                                 seconds=round(time.time() - t1, 1))
                    write_json_atomic(ab_dir / "runs.json", runs)
                    if res.status == "interrupted":
                        interrupted = True
                    if res.status != "ok":
                        break
        except KeyboardInterrupt:
            interrupted = True
            slot_failed = "interrupted"
        except UsageError as exc:
            slot_failed = str(exc)
            _log(f"slot {i} failed: {exc}")
        slots_info.append({"slot": i, "arm": arm, "server": info["server"],
                           "server_ready_s": info["server_ready_s"],
                           "seconds": round(time.time() - t0, 1), "error": slot_failed})
        if slot_failed and not any(r["slot"] == i for r in runs):
            runs.append({"slot": i, "arm": arm, "run": 0, "server": info["server"],
                         "run_dir": None,
                         "status": "interrupted" if interrupted else "failed",
                         "message": slot_failed, "env": plan.arm_env[arm]})
        write_json_atomic(ab_dir / "runs.json", runs)
        if interrupted or slot_failed or any(r["status"] != "ok" for r in runs):
            break

    floor_doc = None if plan.mode == "aa" else find_noise_floor(plan, key)
    comp = compare(w, runs, plan, key, floor_doc)
    if plan.mode == "cal":
        comp["calibration"] = calibration(comp, plan.arms.delay_ms)
    comp["slots"] = slots_info
    comp["wall_seconds"] = round(time.time() - t_all, 1)
    comp["interrupted"] = interrupted
    write_json_atomic(ab_dir / "comparison.json", comp)
    write_text_atomic(ab_dir / "comparison.md", comparison_markdown(comp))
    _plot(comp, runs, ab_dir)
    n_ok = sum(r["status"] == "ok" for r in runs)
    total = len(plan.slots()) * plan.runs_per_server
    if interrupted:
        print(f"k3rocm: error: bench-ab interrupted after {n_ok} of {total} runs; what finished "
              f"is compared in {ab_dir}", file=sys.stderr)
        return EXIT_INTERRUPTED
    if n_ok < total:
        bad = next((r for r in runs if r["status"] != "ok"),
                   {"slot": len(slots_info), "arm": "?", "message": "not run"})
        print(f"k3rocm: error: bench-ab: slot {bad['slot']} (arm {bad['arm']}) failed: "
              f"{bad.get('message')}; {n_ok} of {total} runs kept in {ab_dir}", file=sys.stderr)
        return EXIT_FAILED
    head = comp["headline"]
    for c in comp.get("calibration") or []:
        head += (f"; calibration c={c['concurrency']}: injected +{c['injected_ms']:g} ms/step, "
                 f"detected {c['detected_ms']:+.2f} ms ITL p50")
    print(f"bench-ab {plan.mode.upper()} {w.name}: {head}; report {ab_dir / 'comparison.md'}")
    return EXIT_OK


# ---------------------------------------------------------------------------------------------


def _run_values(run_dir: Path, c: int, n: int) -> dict[str, Any] | None:
    """Per-request arrays of one run's point (and run-level output tokens/s), if it is ok."""
    try:
        doc = json.loads((run_dir / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    point = next((p for p in doc.get("points", []) if p["concurrency"] == c
                  and p["request_count"] == n), None)
    if not point or point["status"] != "ok" or not point.get("dir"):
        return None
    ok, _ = summary.profiling_records(summary.read_records(Path(point["dir"])))
    out: dict[str, Any] = {"output_tps": point.get("output_tps")}
    for key in ("itl", "ttft", "e2el"):
        out[key] = summary.request_values(ok, summary.LATENCY_METRICS[key][0])
    return out


def compare(w: Workload, runs: Sequence[dict], plan: ABPlan, key: str,
            floor_doc: dict | None) -> dict[str, Any]:
    rows = []
    for c, n in w.points():
        # arm -> server -> [run values]
        per_arm: dict[str, dict[str, list[dict]]] = {"A": {}, "B": {}}
        for r in runs:
            if r["status"] == "ok" and r.get("run_dir"):
                v = _run_values(Path(r["run_dir"]), c, n)
                if v is not None:
                    per_arm[r["arm"]].setdefault(r.get("server", r["slot"]), []).append(v)
        for mkey, stat, label, lower in stats.AB_METRICS:
            a = [g for g in ([v[mkey] for v in runs_ if v.get(mkey)]
                             for runs_ in per_arm["A"].values()) if g]
            b = [g for g in ([v[mkey] for v in runs_ if v.get(mkey)]
                             for runs_ in per_arm["B"].values()) if g]
            res = stats.bootstrap_diff(a, b, stat, n_boot=plan.n_boot)
            floor = _floor_for(floor_doc, c, label)
            row = {"concurrency": c, "metric": label, "key": mkey, "stat": stat,
                   "lower_is_better": lower, **res, "noise_floor": floor,
                   "verdict": stats.verdict(res, lower, floor)}
            hw = res.get("halfwidth")
            n_arm = min(res.get("n_a") or 0, res.get("n_b") or 0)
            row["repeats_for_1pct"] = stats.repeats_needed(hw, n_arm, 0.01)
            row["repeats_for_1pct_80power"] = stats.repeats_needed(hw, n_arm, 0.01, power=0.8)
            rows.append(row)
    itl = [r for r in rows if r["metric"] == "ITL p50"]
    head = "; ".join(f"c={r['concurrency']} ITL p50 {_pct(r['d'])} "
                     f"[{_pct(r['lo'])}, {_pct(r['hi'])}] {r['verdict']}" for r in itl)
    bunched = _bunched_runs(runs)
    if bunched:
        head += (f"; {summary.BUNCHED_NOTE} in {len(bunched)} run point(s) "
                 f"(first: slot {bunched[0]['slot']} arm {bunched[0]['arm']} "
                 f"c={bunched[0]['concurrency']})")
    return {"mode": plan.mode, "protocol_key": key, "protocol": plan.describe(),
            "workload": w.name, "command": _first_command(runs),
            "runs": list(runs), "rows": rows, "headline": head or "no comparable runs",
            "bunched": bunched,
            "noise_floor_from": floor_doc.get("dir") if floor_doc else None}


def _bunched_runs(runs: Sequence[dict]) -> list[dict[str, Any]]:
    """Every (run, point) whose stream was not per token (summary's ``stream`` judgement)."""
    out = []
    for r in runs:
        try:
            doc = json.loads((Path(r["run_dir"]) / "summary.json").read_text())
        except (OSError, TypeError, KeyError, json.JSONDecodeError):
            continue
        for p in doc.get("points", []):
            st = p.get("stream") or {}
            if st.get("bunched"):
                out.append({"slot": r["slot"], "arm": r["arm"], "run": r.get("run"),
                            "concurrency": p["concurrency"], "note": st.get("note")})
    return out


def calibration(comp: dict, delay_ms: float | None) -> list[dict[str, Any]]:
    """Injected vs detected, per concurrency: every engine step of arm B sleeps ``delay_ms``
    and emits one token per running request, so B's ITL should be A's + ``delay_ms``."""
    out = []
    for r in comp["rows"]:
        if r["metric"] != "ITL p50" or r.get("a") is None or r.get("b") is None:
            continue
        a, b = r["a"], r["b"]
        detected = b - a
        out.append({"concurrency": r["concurrency"], "injected_ms": delay_ms,
                    "a_itl_ms": a, "b_itl_ms": b, "detected_ms": round(detected, 3),
                    "detected_over_injected": round(detected / delay_ms, 3)
                    if delay_ms else None,
                    "expected_d": round(delay_ms / a, 4) if delay_ms and a else None,
                    "d": r.get("d"), "lo": r.get("lo"), "hi": r.get("hi"),
                    "verdict": r["verdict"]})
    return out


def _first_command(runs: Sequence[dict]) -> str | None:
    for r in runs:
        path = Path(r["run_dir"]) / "command.txt"
        if path.is_file():
            return path.read_text().strip()
    return None


def _floor_for(floor_doc: dict | None, c: int, label: str) -> float | None:
    if not floor_doc:
        return None
    for r in floor_doc.get("rows", []):
        if r["concurrency"] == c and r["metric"] == label and r.get("d") is not None:
            vals = [abs(r["d"]), r.get("halfwidth") or 0.0]
            vals = [v for v in vals if not math.isnan(v)]
            return max(vals) if vals else None
    return None


def find_noise_floor(plan: ABPlan, key: str) -> dict | None:
    """The A/A comparison to report beside this A/B: --noise-floor DIR, else the newest A/A
    under the results root with the same protocol key."""
    cands: list[Path] = []
    if plan.noise_floor_dir:
        cands = [plan.noise_floor_dir]
    elif plan.results.is_dir():
        cands = sorted(plan.results.glob(f"*-{plan.workload.name}-aa*/comparison.json"),
                       reverse=True)
        cands = [p.parent for p in cands]
    for d in cands:
        try:
            doc = json.loads((Path(d) / "comparison.json").read_text())
        except (OSError, json.JSONDecodeError):
            if plan.noise_floor_dir:
                raise UsageError(f"--noise-floor {d}: no readable comparison.json there", 2) \
                    from None
            continue
        if doc.get("mode") != "aa":
            if plan.noise_floor_dir:
                raise UsageError(f"--noise-floor {d} is not an A/A run", 2)
            continue
        if plan.noise_floor_dir or doc.get("protocol_key") == key:
            doc["dir"] = str(d)
            doc["same_protocol"] = doc.get("protocol_key") == key
            return doc
    return None


def _pct(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v * 100:+.2f}%"


def _num(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v:.4g}"


def comparison_markdown(comp: dict) -> str:
    mode = comp["mode"].upper()
    lines = [f"# bench-ab {mode}: {comp['workload']}", "", "## Protocol (identical for every "
             "run; numbers from another protocol are not comparable)", ""]
    lines += [f"- {x}" for x in comp["protocol"]]
    lines += [f"- protocol key `{comp['protocol_key']}`"]
    if comp.get("command"):
        lines += [f"- aiperf command (slot 0; only the artifact dir differs per slot): "
                  f"`{comp['command']}`"]
    lines += [""]
    for b in comp.get("bunched") or []:
        lines += [f"**slot {b['slot']} arm {b['arm']} c={b['concurrency']}: {b['note']}.** "
                  "ITL and TTFT of that run describe chunks, not tokens.", ""]
    if comp["mode"] in ("ab", "cal"):
        src = comp.get("noise_floor_from")
        lines += [f"Noise floor (A/A, same protocol): {src}" if src else
                  "Noise floor: **no A/A run with this protocol yet** - run `make bench-ab "
                  "AA=1` with the same settings; verdicts below rest on the CI alone.", ""]
    if comp.get("calibration"):
        lines += ["## Calibration: injected vs detected", "",
                  "| c | injected ms/step | A ITL p50 ms | B ITL p50 ms | detected ms | "
                  "detected/injected | expected d | detected d [95% CI] | verdict |",
                  "|---:|---:|---:|---:|---:|---:|---:|---|---|"]
        for c in comp["calibration"]:
            lines.append(
                f"| {c['concurrency']} | {c['injected_ms']:g} | {_num(c['a_itl_ms'])} | "
                f"{_num(c['b_itl_ms'])} | {_num(c['detected_ms'])} | "
                f"{_num(c['detected_over_injected'])} | {_pct(c['expected_d'])} | "
                f"{_pct(c['d'])} [{_pct(c['lo'])}, {_pct(c['hi'])}] | {c['verdict']} |")
        lines += ["", "Arm B's server sleeps the injected time in every engine step (one "
                  "token per running request), so B's ITL should be A's plus the injected "
                  "time: detected/injected near 1 means the protocol measures what happens.",
                  ""]
    lines += ["## Runs", "", "| slot | arm | run | status | server ready s | run s |",
              "|---:|---|---:|---|---:|---:|"]
    for r in comp["runs"]:
        lines.append(f"| {r['slot']} | {r['arm']} | {r.get('run', 0)} | {r['status']} | "
                     f"{r.get('server_ready_s', 'n/a')} | {r.get('seconds', 'n/a')} |")
    lines += ["", "## Comparison (B vs A)", "",
              "| c | metric | A (median) | B (median) | d = (B-A)/A | 95% CI | A/A floor | "
              "verdict | repeats/arm for 1% (80% power) |",
              "|---:|---|---:|---:|---:|---|---:|---|---:|"]
    for r in comp["rows"]:
        floor = "n/a" if r.get("noise_floor") is None else f"±{r['noise_floor'] * 100:.2f}%"
        lines.append(
            f"| {r['concurrency']} | {r['metric']} | {_num(r.get('a'))} | {_num(r.get('b'))} | "
            f"{_pct(r.get('d'))} | [{_pct(r.get('lo'))}, {_pct(r.get('hi'))}] | {floor} | "
            f"{r['verdict']} | {r.get('repeats_for_1pct') or 'n/a'} "
            f"({r.get('repeats_for_1pct_80power') or 'n/a'}) |")
    lines += ["", f"Headline: {comp['headline']}", "",
              "Latency in ms (lower is faster), output tokens/s (higher is faster). "
              "'within noise' = the CI contains 0 (or the effect is inside the A/A floor). "
              "With one server per arm the CI cannot hold server-to-server noise: an effect "
              "then counts only beyond the A/A floor."]
    return "\n".join(lines) + "\n"


def _plot(comp: dict, runs: Sequence[dict], out: Path) -> None:
    """ab_itl.png: per-run ITL p50 in slot order, per concurrency, colored by arm."""
    from k3rocm.checks.bench.plots import _pyplot, _save

    plt = _pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for idx, r in enumerate(runs):
        if r["status"] != "ok" or not r.get("run_dir"):
            continue
        try:
            doc = json.loads((Path(r["run_dir"]) / "summary.json").read_text())
        except (OSError, json.JSONDecodeError):
            continue
        for p in doc["points"]:
            v = summary._m(p, "itl", "p50")
            if v is not None:
                ax.scatter(idx, v, color="tab:blue" if r["arm"] == "A" else "tab:orange",
                           marker="o" if p["concurrency"] == doc["points"][0]["concurrency"]
                           else "s")
                ax.annotate(f"c={p['concurrency']}", (idx, v), fontsize=7,
                            textcoords="offset points", xytext=(3, 3))
    ax.set_xlabel("run (in order); blue = A, orange = B")
    ax.set_ylabel("ITL p50 (ms)")
    ax.set_title(f"bench-ab {comp['mode'].upper()} {comp['workload']}: ITL p50 per run")
    ax.grid(alpha=0.3)
    _save(fig, out / "ab_itl.png")
    plt.close(fig)


# --- the command (k3rocm ab --measure bench, bench-ab): args -> plan -> run ---

def build_plan(args: argparse.Namespace) -> ABPlan:
    if args.runs_per_server < 1:
        raise UsageError(f"--runs-per-server {args.runs_per_server}: must be >= 1", 2)
    if args.n_boot < 100:
        raise UsageError(f"--n-boot {args.n_boot}: use at least 100", 2)
    if args.url:
        raise UsageError("--url is not used by bench-ab (it starts its own servers): use --port",
                         2)
    arms = armlib.arms_from_args(args)
    sets = list(args.sets)
    if not any(s.startswith("model=") for s in sets) and not args.model \
            and not os.environ.get("BENCH_MODEL"):
        model, _key = armlib.served_model(arms)
        sets.append(f"model={model}")
    args.sets = [*sets, f"url={arms.url}"]
    from k3rocm.checks.bench.cli import resolve_from_args

    w = resolve_from_args(args)
    return ABPlan(workload=w, arms=arms, results=args.results,
                  client_image=args.client_image, runs_per_server=args.runs_per_server,
                  noise_floor_dir=args.noise_floor, n_boot=args.n_boot,
                  progress=not args.quiet)


def run_bench_ab(args: argparse.Namespace) -> int:
    plan = build_plan(args)
    if args.dry_run:
        for line in dry_run_lines(plan):
            print(line)
        return 0
    if plan.noise_floor_dir and plan.mode != "aa":
        find_noise_floor(plan, "")  # validate early
    code = run_ab(plan)
    sys.stdout.flush()
    return code
