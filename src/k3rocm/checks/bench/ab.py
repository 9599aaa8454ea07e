"""The bench measure of the A/B driver: fusions off (A) vs on (B), A/A, or calibration.

Every slot (order A B B A ...) runs the whole workload on a fresh server; the server is the unit
of the statistics. Calibration (CPU stand-in): arm B sleeps a known delay per engine step.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3rocm.checks.bench import STEP_DELAY_ENV, stats, summary
from k3rocm.checks.bench.cli import add_common, resolve_from_args
from k3rocm.checks.bench.plots import _pyplot, _save
from k3rocm.checks.bench.run import check_tokenizer, planned_command, run_bench
from k3rocm.checks.bench.workloads import Workload, shell_line
from k3rocm.deploy.provenance import NO_RECORD, read_text, served_as
from k3rocm.errors import EXIT_CHECK_FAILED as EXIT_FAILED
from k3rocm.errors import EXIT_INCOMPLETE, EXIT_INTERRUPTED, EXIT_OK, UsageError, tagged_log
from k3rocm.options import Options, option
from k3rocm.rundir import table, utc_stamp, write_json_atomic, write_text_atomic
from k3rocm.serving.fusions import switches

_log = tagged_log("bench-ab")


@dataclass
class ABPlan:
    """The bench measure's plan and run state (the A/B driver's measure protocol)."""

    workload: Workload
    arms: Any  # k3rocm.checks.ab.arms.Arms
    results: Path
    client_image: str
    runs_per_slot: int = 1  # --runs-per-server
    noise_floor_dir: Path | None = None
    primary: tuple[str, int] = ("ITL p50", 1)
    progress: bool = True
    dry_dir: Path = Path()  # where a run would write (the dry run's aiperf lines)
    run: Any = None  # the driver's Run
    key: str = ""  # the planned protocol key
    before_line: str = ""
    runs: list[dict[str, Any]] = field(default_factory=list)
    t0: float = 0.0
    report = "comparison"
    checks_fusions = keep_going = True

    @property
    def mode(self) -> str:  # "ab" | "aa" | "cal"
        return self.arms.mode

    @property
    def label(self) -> str:
        return f"{self.workload.name}-{self.mode}"

    def protocol_key(self, image_id: str | None) -> str:
        """Same key <=> same protocol (workload, image, server env minus the fusions, ...)."""
        blob = json.dumps({"workload": self.workload.protocol(), "image_id": image_id,
                           "server_env": self.arms.describe_env(), "gpu": not self.arms.cpu,
                           "pin_engine_core": self.arms.pin_engine_core,
                           "runs_per_server": self.runs_per_slot}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def describe(self) -> list[str]:
        w, a, env_str = self.workload, self.arms, self.arms.env_str
        if self.mode == "aa":
            arms = "A/A: both arms identical (" + env_str(a.arm_env["A"]) + ")"
        elif self.mode == "cal":
            arms = (f"calibration: both arms {env_str(a.arm_env['A'])}; arm B with an "
                    f"injected {a.delay_ms:g} ms per engine step "
                    f"({STEP_DELAY_ENV}, CPU stand-in test double)")
        else:
            arms = (f"A = fusions off ({env_str(a.arm_env['A'])}), B = fusions on "
                    f"({env_str(a.arm_env['B'])})")
        k = self.runs_per_slot
        return [
            f"mode {self.mode.upper()}: {arms}",
            f"order {' '.join(a.slots())} ({a.repeats} server(s) per arm, interleaved; "
            f"{a.repeats * k} run(s) per arm)",
            f"every slot: a fresh server (image {a.image or 'compose default'}), {k} complete "
            f"run(s) of `{w.name}` ({w.warmup_request_count} warmup requests per point), stop",
            f"topology: {env_str(a.topology())}",
            "statistic: one value per server; d = (B - A) / A on geometric means; two-sided t "
            "test on log server values, pooled with an A/A of the same recorded protocol",
            f"primary metric (declared before the run): {self.primary[0]} at c="
            f"{self.primary[1]}, judged at 5%; other rows: {stats.MULTIPLICITY}",
            "drift: A B B A order" + (" balances linear drift" if a.repeats % 2 == 0 else
                                       f"; odd repeats ({a.repeats}) leave some drift"),
            f"server env (both arms): {env_str(a.describe_env())}"
            + ("; EngineCore pinned (CPU stand-in)" if a.pin_engine_core else ""),
        ]


    # --- the measure protocol (k3rocm.checks.ab.cli) ---

    def lines(self) -> list[str]:
        """The dry run's head: the protocol, and the MDE of the planned design (from the newest
        A/A of this workload) beside the upstream PRs' effect, before anything starts."""
        from k3rocm.deploy.upstream_ref import LATENCY_AB_EFFECT

        design, comp = design_before(self, None)
        seen = stats.effect_line(LATENCY_AB_EFFECT, self.arms.repeats, comp.get("var_log"),
                                 comp.get("df", 0), self.primary[0])
        return [f"# {x}" for x in [
            *self.describe(), design, "the upstream PRs' effect (vLLM PRs #52494, #57640: C=1 "
            f"decode ITL moved ~{LATENCY_AB_EFFECT:.1%}): {seen}"]]

    def slot_lines(self, i: int, arm: str) -> list[str]:
        return [shell_line(planned_command(self.workload, self.dry_dir / "runs" /
                                           _run_name(i, arm, k)))
                for k in range(self.runs_per_slot)]

    def begin(self) -> None:
        w, arms, run = self.workload, self.arms, self.run
        self.t0 = time.time()
        run.model, run.api_key = w.model, w.api_key  # what the workload asks the servers for
        self.key = key = self.protocol_key(run.image_id)
        self.before_line = design_before(self, key)[0]
        _log(f"before the run: {self.before_line}")
        _log(f"{self.mode.upper()}: planned protocol {key}")
        write_json_atomic(run.dir / "plan.json", {
            "mode": self.mode, "planned_key": key, "protocol": self.describe(),
            "primary": {"metric": self.primary[0], "concurrency": self.primary[1]},
            "design_before": self.before_line, "workload": w.model_dump(mode="json"),
            "slots": arms.slots(), "arm_env": arms.arm_env,
            "arm_container_env": arms.arm_container_env, "server_image": run.image,
            "server_image_id": run.image_id, "server_env": arms.describe_env(),
            "topology": arms.topology()})

    def log_name(self, i: int, arm: str) -> str:
        return f"runs/{i:02d}-{arm}-server.log"

    def measure(self, i: int, arm: str, srv, info: dict) -> bool:
        arms, client, slot_dir = self.arms, self.run.client, self.run.dir / "runs"
        container = srv.container(client)
        for k in range(self.runs_per_slot):
            run_dir = slot_dir / _run_name(i, arm, k)
            run_dir.mkdir(parents=True)
            entry: dict[str, Any] = {
                "slot": i, "arm": arm, "run": k, "server": info["server"],
                "run_dir": str(run_dir), "status": "failed", "env": arms.arm_env[arm],
                "container_env": arms.arm_container_env.get(arm, {}),
                "server_ready_s": info["server_ready_s"], "pin": info["pin"]}
            self.runs.append(entry)
            t1 = time.time()
            res = run_bench(self.workload, results=self.results, client_image=self.client_image,
                            server_timeout=30, progress=self.progress,
                            server_container=container, docker=client, run_dir=run_dir,
                            deployment=info["deployment"], extra_provenance={"ab": {
                                "mode": self.mode, "slot": i, "arm": arm, "run": k,
                                "protocol_key": self.key, "compose_project": info["server"],
                                "topology": info["topology"]}})
            entry.update(status=res.status, message=res.message,
                         seconds=round(time.time() - t1, 1))
            write_json_atomic(self.run.dir / "runs.json", self.runs)
            if res.status != "ok":
                return False
        if self.mode == "cal":
            save_applied_delays(container, applied_record_path(slot_dir, i, arm))
        return True

    def compare(self, slots: list[dict]) -> dict[str, Any]:
        w, runs, last = self.workload, self.runs, slots[-1]
        interrupted = last["error"] == "interrupted" or any(r["status"] == "interrupted"
                                                             for r in runs)
        if last["error"] and not any(r["slot"] == last["slot"] for r in runs):
            runs.append({"slot": last["slot"], "arm": last["arm"], "run": 0,
                         "server": last["server"], "run_dir": None,
                         "status": "interrupted" if interrupted else "failed",
                         "message": last["error"], "env": self.arms.arm_env[last["arm"]]})
        write_json_atomic(self.run.dir / "runs.json", runs)
        rkey, diffs = recorded_protocol(w, runs, self.mode, self.runs_per_slot)
        floor_doc = None if self.mode == "aa" else find_noise_floor(self, rkey or "")
        comp = compare(w, runs, self.mode, rkey or "", floor_doc, self.primary, self.describe())
        comp.update(planned_key=self.key, design_before=self.before_line,
                    protocol_differences=diffs, slots=slots, interrupted=interrupted)
        if diffs and self.mode != "aa":
            comp["invalid"] = ("slots ran different server setups (only the fusion switches "
                               "may differ): " + " | ".join(diffs))
        elif diffs:  # an A/A whose slots differ: flagged, never pooled as a variance component
            comp["protocol_key"] = None
            comp["headline"] += ("; FLAGGED (not used as a variance component): "
                                 + " | ".join(diffs))
        if self.mode == "cal":
            comp["calibration"] = calibration(comp, self.arms.delay_ms)
        comp["wall_seconds"] = round(time.time() - self.t0, 1)
        return comp

    def markdown(self, comp: dict) -> str:
        return comparison_markdown(comp)

    def verdict(self, comp: dict, ab_dir: Path) -> int:
        """The headline and the exit code; a run that did not finish or may not be read is
        refused in one line."""
        _plot(comp, self.runs, ab_dir)
        n_ok = sum(r["status"] == "ok" for r in self.runs)
        total = len(self.arms.slots()) * self.runs_per_slot
        if comp["interrupted"]:
            raise UsageError(f"bench-ab interrupted after {n_ok} of {total} runs; what finished "
                             f"is compared in {ab_dir}", EXIT_INTERRUPTED)
        if n_ok < total:
            bad = next((r for r in self.runs if r["status"] != "ok"),
                       {"slot": len(comp["slots"]), "arm": "?", "message": "not run"})
            raise UsageError(f"bench-ab: slot {bad['slot']} (arm {bad['arm']}) failed: "
                             f"{bad.get('message')}; {n_ok} of {total} runs kept in {ab_dir}",
                             EXIT_FAILED)
        refused = refusal(comp, ab_dir)
        if refused:
            raise UsageError(refused[0].removeprefix("k3rocm: error: "), refused[1])
        head = comp["headline"] + f"; {comp['design_after']}"
        for c in comp.get("calibration") or []:
            head += (f"; calibration c={c['concurrency']}: injected +{c['injected_ms']:g} ms/"
                     f"step (applied {_num(c['applied_ms'])}), detected "
                     f"{c['detected_ms']:+.2f} ms ITL p50")
        print(f"bench-ab {self.mode.upper()} {self.workload.name}: {head}; report "
              f"{ab_dir / 'comparison.md'}")
        return EXIT_OK


def _run_name(slot: int, arm: str, k: int) -> str:
    return f"{slot:02d}-{arm}-{k}"


def design_before(plan: ABPlan, key: str | None) -> tuple[str, dict]:
    """(MDE line, A/A variance component) of the planned design from the newest A/A (``key``
    None: of the workload, for the dry run; else of this planned protocol)."""
    aa = find_noise_floor(plan, key, field="planned_key")
    comp = _floor_for({**(aa or {}), "same_protocol": True}, plan.primary[1],
                      plan.primary[0]) or {}
    line = stats.design_line(comp.get("var_log"), comp.get("df", 0), plan.arms.repeats,
                             plan.primary[0])
    if aa:
        line += f" (from the A/A {aa['dir']}" + (
            "; its protocol is checked when the run starts)" if key is None else ")")
    return line, comp


def refusal(comp: dict, ab_dir: Path) -> tuple[str, int] | None:
    """(error line, exit code) when the comparison may not be read: invalid slots (1), a
    calibration whose CI misses the applied delay's effect (1) or has no record of it (4)."""
    if comp.get("invalid"):
        return (f"k3rocm: error: bench-ab refused: {comp['invalid']}; no verdict (report in "
                f"{ab_dir})", EXIT_FAILED)
    cal = comp.get("calibration") or []
    missed = [c for c in cal if c["covered"] is False]
    if missed:
        m = missed[0]
        return (f"k3rocm: error: bench-ab calibration failed: c={m['concurrency']} expected "
                f"{_pct(m['expected_d'])} (applied {_num(m.get('applied_ms'))} ms/step, "
                f"injected {m['injected_ms']:g}) outside the CI [{_pct(m['lo'])}, "
                f"{_pct(m['hi'])}] (report in {ab_dir})", EXIT_FAILED)
    unjudged = [c for c in cal if c["covered"] is None]
    if unjudged:
        u = unjudged[0]
        return (f"k3rocm: error: bench-ab calibration cannot be judged: c={u['concurrency']}: "
                f"{u.get('why') or 'no confidence interval'} (report in {ab_dir})",
                EXIT_INCOMPLETE)
    return None


# Allowed to differ between slots: the fusion switches (A/B), and in a calibration the
# step-delay double's two variables (arm B only).
ARM_ENV = frozenset(switches(True))
CAL_ENV = frozenset({STEP_DELAY_ENV, "PYTHONPATH"})
WHERE_ENV = frozenset({"K3_PORT", "HOSTNAME"})  # where a slot listens, not what it runs


def slot_identity(run_dir: Path, mode: str) -> dict[str, Any] | None:
    """What one slot's server really ran (image id, rendered argv and env from its run record),
    minus what may differ between arms."""
    try:
        server = json.loads((run_dir / "provenance.json").read_text()).get("server") or {}
    except (OSError, json.JSONDecodeError):
        return None
    skip = ARM_ENV | WHERE_ENV | (CAL_ENV if mode == "cal" else frozenset())
    served = served_as(server)
    argv = served.argv
    if argv:  # where it listens is not the protocol
        argv = [x for i, x in enumerate(argv)
                if x != "--port" and (i == 0 or argv[i - 1] != "--port")]
    return {"image_id": (server.get("container") or {}).get("image_id"),
            "env": {k: v for k, v in sorted(served.env.items()) if k not in skip},
            "argv": argv}


def identity_diff(a: dict, b: dict) -> list[str]:
    out = []
    if a["image_id"] != b["image_id"]:
        out.append(f"image {a['image_id']} vs {b['image_id']}")
    for k in sorted(set(a["env"]) | set(b["env"])):
        va, vb = a["env"].get(k, "(unset)"), b["env"].get(k, "(unset)")
        if va != vb:
            out.append(f"env {k}={va} vs {vb}")
    if a["argv"] is None or b["argv"] is None:  # no rendered record: cannot be shown equal
        out.append(f"argv unknown ({NO_RECORD})")
    elif a["argv"] != b["argv"]:
        ea, eb = a["argv"], b["argv"]
        out.append(f"argv {' '.join(x for x in ea if x not in eb) or '-'} vs "
                   f"{' '.join(x for x in eb if x not in ea) or '-'}")
    return out


def recorded_protocol(w: Workload, runs: Sequence[dict], mode: str, runs_per_server: int
                      ) -> tuple[str | None, list[str]]:
    """(key, differences): the key from the first slot's recorded server identity; one line per
    slot whose identity differs."""
    first_runs = {r["slot"]: r for r in reversed(runs) if r.get("run_dir")}  # each slot's first
    ids = [(r, ident) for r in sorted(first_runs.values(), key=lambda r: r["slot"])
           if (ident := slot_identity(Path(r["run_dir"]), mode)) is not None]
    if not ids:
        return None, []
    first_run, first = ids[0]
    diffs = []
    for r, ident in ids[1:]:
        d = identity_diff(first, ident)
        if d:
            diffs.append(f"slot {r['slot']} (arm {r['arm']}) differs from slot "
                         f"{first_run['slot']} (arm {first_run['arm']}): {'; '.join(d)}")
    # The key: the first slot (always arm A) as recorded, whatever the mode, so that an A/A and
    # a calibration or A/B of the same setup share it (the calibration's delay is arm B's only).
    key_ident = slot_identity(Path(first_run["run_dir"]), "ab")
    blob = json.dumps({"workload": w.protocol(), "runs_per_server": runs_per_server,
                       "server": key_ident}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16], diffs


def parse_primary(spec: str | None, w: Workload) -> tuple[str, int]:
    """``KEY:STAT@C`` -> (row label, concurrency); default ITL p50 at the first concurrency."""
    points = [c for c, _ in w.points()]
    if not spec:
        return "ITL p50", points[0]
    what, _, c = spec.partition("@")
    labels = {f"{k}:{s}": label for k, s, label, _ in stats.AB_METRICS}
    if what not in labels or not c.isdigit() or int(c) not in points:
        raise UsageError(f"--primary {spec!r}: expected METRIC@C with METRIC one of "
                         f"{', '.join(labels)} and C one of the workload's concurrencies {points}")
    return labels[what], int(c)


def server_values(runs: Sequence[dict], c: int, n: int) -> dict[str, dict[str, list[float]]]:
    """{metric: {arm: [one value per server]}} for point (c, n) of the ok runs."""
    per_arm: dict[str, dict[str, list[dict]]] = {"A": {}, "B": {}}  # arm -> server -> runs
    for r, p in _run_points([r for r in runs if r["status"] == "ok"]):
        if (p["concurrency"], p["request_count"]) == (c, n) and p["status"] == "ok" \
                and p.get("dir"):
            ok, _ = summary.profiling_records(summary.read_records(Path(p["dir"])))
            v = {k: summary.request_values(ok, summary.LATENCY_METRICS[k][0])
                 for k in ("itl", "ttft", "e2el")}
            per_arm[r["arm"]].setdefault(r.get("server", r["slot"]), []).append(
                {**v, "output_tps": p.get("output_tps")})
    out: dict[str, dict[str, list[float]]] = {}
    for mkey, stat, label, _ in stats.AB_METRICS:
        out[label] = {arm: [stats.server_value([v[mkey] for v in rs], stat)
                            for rs in servers.values() if all(v.get(mkey) for v in rs)]
                      for arm, servers in per_arm.items()}
    return out


def judge(values: dict[tuple[int, str], dict[str, list[float]]], primary: tuple[str, int],
          floor_doc: dict | None = None) -> list[dict[str, Any]]:
    """One row per (concurrency, metric): the server-level test with the A/A variance component
    pooled in; the primary row at 5%, the others with Holm's correction."""
    rows = []
    n_secondary = max(1, sum(1 for k in values if k != (primary[1], primary[0])))
    for (c, label), arms_ in values.items():
        lower = next(lw for _, _, lb, lw in stats.AB_METRICS if lb == label)
        floor = _floor_for(floor_doc, c, label)
        # a secondary row's MDE at Holm's strictest step (alpha / number of secondary rows)
        alpha = stats.ALPHA if (label, c) == primary else stats.ALPHA / n_secondary
        res = stats.compare_servers(arms_.get("A", []), arms_.get("B", []), floor, alpha)
        rows.append({"concurrency": c, "metric": label, "lower_is_better": lower,
                     "primary": (label, c) == primary, **res, "noise_floor": floor,
                     "aa_component": stats.variance_component(
                         arms_.get("A", []) + arms_.get("B", []))})
    secondary = [r for r in rows if not r["primary"]]
    ps = [r["p"] for r in secondary]
    for r, p_adj, level in zip(secondary, stats.holm(ps), stats.holm_levels(ps), strict=True):
        r["p_holm"] = p_adj
        r["ci_level"] = 1 - (level or stats.ALPHA)
    for r in rows:  # the CI each verdict used (lo/hi stay the 95% CI: the calibration's)
        r.setdefault("ci_level", 1 - stats.ALPHA)
        r["ci_lo"], r["ci_hi"] = stats.interval(r, 1 - r["ci_level"])
        r["verdict"] = stats.verdict(r, r["lower_is_better"],
                                     r["p"] if r["primary"] else r["p_holm"])
    return rows


def compare(w: Workload, runs: Sequence[dict], mode: str, key: str, floor_doc: dict | None,
            primary: tuple[str, int], describe: list[str] | None = None) -> dict[str, Any]:
    values = {(c, label): v for c, n in w.points()
              for label, v in server_values(runs, c, n).items()}
    rows = judge(values, primary, floor_doc)
    prim = next((r for r in rows if r["primary"]), None)
    head = "no comparable runs"
    if prim and prim.get("d") is not None:
        head = (f"primary {prim['metric']} c={prim['concurrency']}: {_pct(prim['d'])} "
                f"[{_pct(prim['lo'])}, {_pct(prim['hi'])}] {prim['verdict']}")
    inputs: list[dict[str, Any]] = []  # per (run, point): aiperf's OSL check, scraped counters
    bunched: list[dict[str, Any]] = []  # every (run, point) whose stream was not per token
    for r, p in _run_points(runs):
        where = {"slot": r["slot"], "arm": r["arm"], "run": r.get("run"),
                 "concurrency": p["concurrency"]}
        sm, stream = p.get("server_metrics") or {}, p.get("stream") or {}
        inputs.append({**where, "flags": p.get("flags") or [],
                       "osl_mismatch_count": p.get("osl_mismatch_count"),
                       "prefix_cache_hit_rate": sm.get("prefix_cache_hit_rate"),
                       "mtp_acceptance_rate": sm.get("mtp_acceptance_rate")})
        if stream.get("bunched"):
            bunched.append({**where, "note": stream.get("note")})
    aa_flags = aa_notes(rows, floor_doc)
    if aa_flags:
        head += "; " + "; ".join(aa_flags)
    flagged = [i for i in inputs if i["flags"]]
    if flagged:
        head += (f"; inputs off in {len(flagged)} run point(s) (first: slot {flagged[0]['slot']}"
                 f" arm {flagged[0]['arm']} c={flagged[0]['concurrency']}: "
                 f"{flagged[0]['flags'][0]})")
    if bunched:
        head += (f"; {summary.BUNCHED_NOTE} in {len(bunched)} run point(s) "
                 f"(first: slot {bunched[0]['slot']} arm {bunched[0]['arm']} "
                 f"c={bunched[0]['concurrency']})")
    cmds = [Path(r["run_dir"]) / "command.txt" for r in runs if r.get("run_dir")]
    command = next((p.read_text().strip() for p in cmds if p.is_file()), None)  # the first run's
    return {"mode": mode, "protocol_key": key, "protocol": describe or [],
            "workload": w.name, "command": command,
            "primary": {"metric": primary[0], "concurrency": primary[1]},
            "alpha": stats.ALPHA, "multiplicity": stats.MULTIPLICITY,
            "runs": list(runs), "rows": rows, "headline": head,
            "design_after": _design_after(rows, mode),
            "bunched": bunched, "inputs": inputs,
            "noise_floor_from": floor_doc.get("dir") if floor_doc else None,
            "noise_floor_flags": aa_flags, "finished_utc": utc_stamp()}


# An A/A older than this is flagged beside the verdict (another day: other load, other clocks);
# its variance is checked in every row (stats.floor_check) whatever its age.
MAX_AA_AGE_HOURS = 24.0


def aa_age_hours(floor_doc: dict | None, now: str | None = None) -> float | None:
    """Hours between the A/A (``finished_utc``, else its directory's stamp) and ``now``."""
    from datetime import datetime, timezone

    def parse(stamp: str | None) -> datetime | None:
        try:
            return datetime.strptime((stamp or "")[:16], "%Y%m%dT%H%M%SZ").replace(
                tzinfo=timezone.utc)
        except ValueError:
            return None

    if not floor_doc:
        return None
    then = parse(floor_doc.get("finished_utc")) or parse(Path(floor_doc.get("dir") or "").name)
    ref = parse(now) if now else datetime.now(timezone.utc)
    return None if then is None or ref is None else (ref - then).total_seconds() / 3600


def aa_notes(rows: Sequence[dict], floor_doc: dict | None, now: str | None = None) -> list[str]:
    """The pooled A/A's caveats for the verdict: a refused variance check, an A/A too old."""
    if not (floor_doc or {}).get("same_protocol"):
        return []
    out = []
    prim = next((r for r in rows if r.get("primary")), None) or {}
    chk = prim.get("floor_check") or {}
    if chk and not chk.get("pooled"):
        out.append(chk["note"])
    age = aa_age_hours(floor_doc, now)
    if age is not None and age > MAX_AA_AGE_HOURS:
        out.append(f"FLAGGED: the pooled A/A is {age:.0f} h older than this run (more than "
                   f"{MAX_AA_AGE_HOURS:g} h: another day's noise; rerun the A/A with --aa)")
    return out


def _design_after(rows: list[dict], mode: str) -> str | None:
    """The MDE line after the run (an A/A: from its own variance)."""
    prim = next((r for r in rows if r["primary"]), None)
    if not prim:
        return None
    n = min(prim["servers_a"], prim["servers_b"])
    if mode == "aa":
        comp = prim.get("aa_component") or {}
        return stats.design_line(comp.get("var_log"), comp.get("df", 0), n, prim["metric"])
    if prim.get("mde") is None:
        return stats.design_line(None, 0, n, prim["metric"])
    return (f"MDE ({prim['metric']}, 80% power, two-sided 5%): {prim['mde'] * 100:.2f}% with "
            f"{n} server(s) per arm (df {prim['df']}); server-to-server CV "
            f"{prim['server_cv'] * 100:.2f}%; servers per arm needed for 1%: "
            f"{prim['servers_for_1pct'] or '> 10000'}")


def _run_points(runs: Sequence[dict]):
    """Every (run, point of its summary.json); unreadable summaries are skipped."""
    for r in runs:
        try:
            doc = json.loads((Path(r["run_dir"]) / "summary.json").read_text())
        except (OSError, TypeError, KeyError, json.JSONDecodeError):
            continue
        for p in doc.get("points", []):
            yield r, p


# The step-delay double's record of the sleeps it really applied, inside the arm server's
# container (tests/doubles/stepdelay: APPLIED_FILE): one line per engine step that slept,
# "<wall clock ns> <requested ms> <applied ms>".
STEP_DELAY_RECORD = "/tmp/k3rocm-test-stepdelay.tsv"
# what asks the double for a sleep (its ENV, BASE_ENV, DELAY_FILE_ENV), read from a run's
# recorded server environment
_DELAY_VARS = (STEP_DELAY_ENV, "K3_TEST_BASE_DELAY_MS", "K3_TEST_DELAY_FILE")


def applied_record_path(slot_dir: Path, slot: int, arm: str) -> Path:
    return slot_dir / f"{slot:02d}-{arm}-stepdelay.tsv"


def save_applied_delays(container, path: Path) -> None:
    """Copy the double's record out of the arm server after its runs (race free: a step's line
    is written before the step runs). No file: the calibration says what is missing."""
    text = read_text(container, STEP_DELAY_RECORD)
    if text is not None:  # else a missing record, judged by the calibration
        write_text_atomic(path, text)


def _read_applied(path: Path) -> list[tuple[int, float, float]]:
    try:
        text = path.read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and not line.startswith("#"):
            try:
                out.append((int(parts[0]), float(parts[1]), float(parts[2])))
            except ValueError:
                continue
    return out


def _asks_for_delay(run_dir: Path) -> bool | None:
    """Did this run's server (its recorded container env) ask the double for a sleep?"""
    try:
        env = json.loads((run_dir / "provenance.json").read_text())["server"]["container"][
            "env"]
    except (OSError, KeyError, TypeError, json.JSONDecodeError):
        return None
    return any(str(env.get(k) or "").strip() not in ("", "0") for k in _DELAY_VARS)


def applied_delays(runs: Sequence[dict], c: int) -> dict[str, dict[str, Any]]:
    """Per arm, the sleep its servers really applied per engine step while point ``c`` was
    measured (requested/applied ms, steps); asked but unrecorded: ``applied_ms`` None and why."""
    per_server: dict[str, dict[str, list]] = {"A": {}, "B": {}}
    why: dict[str, str] = {}
    for r, p in _run_points([r for r in runs if r["status"] == "ok"]):
        if p["concurrency"] != c or not p.get("dir"):
            continue
        run_dir = Path(r["run_dir"])
        arm, server = r["arm"], r.get("server", r["slot"])
        recs = per_server[arm].setdefault(server, [])
        window = summary.profiling_window(Path(p["dir"]))
        asked = _asks_for_delay(run_dir)
        record = applied_record_path(run_dir.parent, r["slot"], arm)
        inside = [x for x in _read_applied(record) if window and window[0] <= x[0] <= window[1]]
        if inside:
            recs.extend(inside)
        elif asked is False:
            recs.append(None)  # no sleep asked: 0 applied
        else:
            why[arm] = (f"arm {arm}'s server {server} "
                        + ("has no recorded environment" if asked is None else
                           f"asked for a sleep but left no record of it in {record.name}"
                           if not record.is_file() else
                           f"recorded no sleep in the profiling phase ({record.name})"))
    out: dict[str, dict[str, Any]] = {}
    for arm, servers in per_server.items():
        if arm in why or not servers:
            out[arm] = {"applied_ms": None, "requested_ms": None, "steps": 0,
                        "why": why.get(arm, f"no measured run of arm {arm} at c={c}")}
            continue
        means = [(0.0, 0.0) if None in recs else
                 (sum(x[1] for x in recs) / len(recs), sum(x[2] for x in recs) / len(recs))
                 for recs in servers.values()]
        out[arm] = {"requested_ms": sum(m[0] for m in means) / len(means),
                    "applied_ms": sum(m[1] for m in means) / len(means),
                    "steps": sum(len([x for x in recs if x]) for recs in servers.values())}
    return out


def calibration(comp: dict, delay_ms: float | None) -> list[dict[str, Any]]:
    """Injected vs detected per concurrency: B's ITL should be A's plus the extra sleep B's server
    really applied; passes when the 95% CI covers that effect. The nominal effect is shown only."""
    out = []
    for r in comp["rows"]:
        if r["metric"] != "ITL p50" or r.get("a") is None or r.get("b") is None:
            continue
        a, b, c = r["a"], r["b"], r["concurrency"]
        applied = applied_delays(comp.get("runs") or [], c)
        pa, pb = applied["A"], applied["B"]
        extra = (pb["applied_ms"] - pa["applied_ms"]
                 if pa["applied_ms"] is not None and pb["applied_ms"] is not None else None)
        detected = b - a
        expected = extra / a if extra is not None and a else None
        covered = stats.covers(r, expected)
        why = (pb.get("why") or pa.get("why")) if extra is None else None
        if covered is None and why is None:
            why = ("no confidence interval (one server per arm and no A/A of this recorded "
                   "protocol: run `make bench-ab AA=1` with the same settings first)")
        out.append({"concurrency": c, "injected_ms": delay_ms,
                    "applied_ms": None if extra is None else round(extra, 3),
                    "applied_a_ms": _round(pa["applied_ms"]),
                    "applied_b_ms": _round(pb["applied_ms"]),
                    "requested_a_ms": _round(pa["requested_ms"]),
                    "requested_b_ms": _round(pb["requested_ms"]),
                    "steps_a": pa["steps"], "steps_b": pb["steps"],
                    # ITL minus the applied sleep: the rest of the step, per arm (reading a
                    # miss: its difference is server-to-server/load noise, not the injection)
                    "rest_a_ms": _round(a - pa["applied_ms"]
                                        if pa["applied_ms"] is not None else None),
                    "rest_b_ms": _round(b - pb["applied_ms"]
                                        if pb["applied_ms"] is not None else None),
                    "applied_over_injected": round(extra / delay_ms, 3)
                    if extra is not None and delay_ms else None,
                    "a_itl_ms": a, "b_itl_ms": b, "detected_ms": round(detected, 3),
                    "detected_over_injected": round(detected / delay_ms, 3)
                    if delay_ms else None,
                    "detected_over_applied": round(detected / extra, 3) if extra else None,
                    "expected_d": None if expected is None else round(expected, 4),
                    "nominal_d": round(delay_ms / a, 4) if delay_ms and a else None,
                    "d": r.get("d"), "lo": r.get("lo"), "hi": r.get("hi"),
                    "covered": covered, "why": why, "verdict": r["verdict"]})
    return out


def _round(v: float | None, nd: int = 3) -> float | None:
    return None if v is None else round(v, nd)


def _floor_for(floor_doc: dict | None, c: int, label: str) -> dict[str, Any] | None:
    """The A/A's variance component of this row, only for the same recorded protocol."""
    if not (floor_doc or {}).get("same_protocol"):
        return None
    return next((r.get("aa_component") for r in floor_doc.get("rows", [])
                 if (r["concurrency"], r["metric"]) == (c, label)), None)


def find_noise_floor(plan: ABPlan, key: str | None, field: str = "protocol_key") -> dict | None:
    """The A/A to pool: --noise-floor DIR, else the newest A/A under the results root with the
    same key (``field``: recorded or planned key; ``key`` None: the newest of the workload)."""
    cands = [plan.noise_floor_dir] if plan.noise_floor_dir else [p.parent for p in sorted(
        plan.results.glob(f"*-{plan.workload.name}-aa*/comparison.json"), reverse=True)]
    for d in cands:
        try:
            doc = json.loads((Path(d) / "comparison.json").read_text())
        except (OSError, json.JSONDecodeError):
            doc = None
        if (doc or {}).get("mode") != "aa":
            if plan.noise_floor_dir:
                why = ": no readable comparison.json there" if doc is None else " is not an A/A run"
                raise UsageError(f"--noise-floor {d}{why}")
            continue
        if plan.noise_floor_dir or key is None or doc.get(field) == key:
            doc["dir"] = str(d)
            doc["same_protocol"] = bool(key) and doc.get(field) == key
            return doc
    return None


def _pct(v: float | None) -> str:
    return summary.fmt(v, "+.2f", 100, "%")


def _num(v: float | None) -> str:
    return summary.fmt(v, ".4g")


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
        checks = [f"{r['metric']} c={r['concurrency']}: {r['floor_check']['note']}"
                  for r in comp["rows"] if r.get("floor_check")]
        lines += [f"A/A variance component (same recorded protocol): {src}" if src else
                  "A/A variance component: **no A/A run with this recorded protocol** - run "
                  "`make bench-ab AA=1` with the same settings; the test below uses this run's "
                  "servers alone.", ""]
        lines += [x for f in comp.get("noise_floor_flags") or [] for x in (f"**{f}**", "")]
        lines += [f"- {c}" for c in checks] + ([""] if checks else [])
    if comp.get("calibration"):
        lines += ["## Calibration: injected vs detected", "", *table(
            ["c", "injected ms/step (nominal)", "applied ms/step (B - A)", "applied A / B ms/step",
             "A ITL p50 ms", "B ITL p50 ms", "rest of step A / B ms", "detected ms",
             "detected/applied", "nominal d", "expected d (applied)", "detected d [95% CI]",
             "CI covers expected", "verdict"], "rrrlrrlrrrrlll",
            ([c["concurrency"], f"{c['injected_ms']:g}", _num(c.get("applied_ms")),
              f"{_num(c.get('applied_a_ms'))} / {_num(c.get('applied_b_ms'))}",
              _num(c["a_itl_ms"]), _num(c["b_itl_ms"]),
              f"{_num(c.get('rest_a_ms'))} / {_num(c.get('rest_b_ms'))}",
              _num(c["detected_ms"]), _num(c.get("detected_over_applied")),
              _pct(c.get("nominal_d")), _pct(c["expected_d"]),
              f"{_pct(c['d'])} [{_pct(c['lo'])}, {_pct(c['hi'])}]", COVERED[c["covered"]],
              c["verdict"]] for c in comp["calibration"]))]
        lines += [f"\n**c={c['concurrency']}: cannot be judged: {c['why']}.**"
                  for c in comp["calibration"] if c.get("why")]
        lines += ["", "B's ITL should be A's plus the sleep B's server really applied more per "
                  "step (recorded by the step-delay double); the calibration passes when the 95% "
                  "CI covers that expected effect. Rest of step = ITL p50 - applied sleep.", ""]
    lines += ["## Runs", "", *table(
        ["slot", "arm", "run", "status", "server ready s", "run s"], "rlrlrr",
        ([r["slot"], r["arm"], r.get("run", 0), r["status"], r.get("server_ready_s", "n/a"),
          r.get("seconds", "n/a")] for r in comp["runs"]))]
    if comp.get("invalid"):
        lines += ["", f"**INVALID: {comp['invalid']}.** No verdict.", ""]
    elif comp.get("protocol_differences"):
        lines += ["", "**Flagged: " + " | ".join(comp["protocol_differences"]) + "**", ""]
    for f in comp.get("fusion_problems") or []:
        lines += ["", f"Fusions: {f}."]
    if comp.get("inputs"):
        lines += ["", "## Inputs per run (aiperf's OSL check, the server's scraped counters)", "",
                  *table(["slot", "arm", "c", "OSL mismatches", "prefix-cache hit rate",
                                  "MTP acceptance", "input flags"], "rlrrrrl",
                                 ([i["slot"], i["arm"], i["concurrency"],
                                   _num(i["osl_mismatch_count"]),
                                   summary.rate(i["prefix_cache_hit_rate"]),
                                   summary.rate(i["mtp_acceptance_rate"]),
                                   "; ".join(i["flags"]) or "none"] for i in comp["inputs"]))]
    prim = comp.get("primary") or {}
    lines += ["", "## Comparison (B vs A), one value per server", "",
              f"Primary (declared before the run): {prim.get('metric')} at "
              f"c={prim.get('concurrency')}, two-sided t test at 5%. Other rows: "
              f"{comp.get('multiplicity')}.", "",
              f"- before the run: {comp.get('design_before') or 'n/a'}",
              f"- after the run: {comp.get('design_after') or 'n/a'}", "", *table(
                  ["c", "metric", "A servers", "B servers", "d = (B-A)/A",
                   "CI of the verdict (level)", "p", "MDE 80%", "servers/arm for 1%", "verdict"],
                  "rlllrlrrrl", map(_row_cells, comp["rows"]))]
    lines += ["", f"Headline: {comp['headline']}", "",
              "Latency in ms (lower is faster), output tokens/s (higher is faster); one value "
              "per fresh server. 'inconclusive': the CI includes 0, effects below the MDE are "
              "not excluded. Each CI is the one its verdict used (95% primary, Holm's level "
              "for secondary rows); method: docs/bench.md."]
    return "\n".join(lines) + "\n"


COVERED = {True: "yes", False: "**NO**", None: "n/a"}


def _row_cells(r: dict) -> list:
    """A comparison row's cells: the primary row's own p, the others' Holm-adjusted."""
    p = r.get("p") if r.get("primary") else r.get("p_holm")
    level = r.get("ci_level") or 1 - stats.ALPHA
    return [r["concurrency"], f"**{r['metric']}** (primary)" if r.get("primary") else r["metric"],
            _vals(r.get("server_values_a")), _vals(r.get("server_values_b")), _pct(r.get("d")),
            f"[{_pct(r.get('ci_lo'))}, {_pct(r.get('ci_hi'))}] ({level * 100:.4g}%"
            + ("" if r.get("primary") else " Holm") + ")",
            "n/a" if p is None else f"{p:.3g}" + ("" if r.get("primary") else " (Holm)"),
            summary.fmt(r.get("mde"), ".2f", 100, "%"), r.get("servers_for_1pct") or "n/a",
            r["verdict"]]


def _vals(xs: Sequence[float] | None) -> str:
    return " ".join(_num(x) for x in xs) if xs else "n/a"


def _plot(comp: dict, runs: Sequence[dict], out: Path) -> None:
    """ab_itl.png: per-run ITL p50 in slot order, colored by arm."""
    plt = _pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    first_c = comp["rows"][0]["concurrency"] if comp["rows"] else None  # rows in sweep order
    for r, p in _run_points([r for r in runs if r["status"] == "ok"]):
        idx, v = runs.index(r), summary._m(p, "itl", "p50")
        if v is not None:
            ax.scatter(idx, v, color="tab:blue" if r["arm"] == "A" else "tab:orange",
                       marker="o" if p["concurrency"] == first_c else "s")
            ax.annotate(f"c={p['concurrency']}", (idx, v), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
    ax.set_xlabel("run (in order); blue = A, orange = B")
    ax.set_ylabel("ITL p50 (ms)")
    ax.set_title(f"bench-ab {comp['mode'].upper()} {comp['workload']}: ITL p50 per run")
    ax.grid(alpha=0.3)
    _save(fig, out / "ab_itl.png")
    plt.close(fig)


# --- the measure's side of the A/B driver (k3rocm.checks.ab.cli) ---

REPEATS = 4  # the fewest servers per arm with which a 5% test on server values has room
SINGLE = None


class BenchAB(Options):
    """``--measure bench``'s own flags (the rest: ``bench``'s and the arm servers')."""

    runs_per_server: int = option(1, "complete workload runs on each fresh server (more saves "
                                  "server starts, identical for both arms)", ge=1)
    noise_floor: Path | None = option(None, "A/A run directory to report beside this A/B "
                                      "(default: the newest A/A under --results with the same "
                                      "protocol)")
    primary: str | None = option(
        None, "the one metric judged at 5%%, declared before the run: itl:p50, itl:p90, "
        "ttft:p50, e2el:p50 or output_tps:avg at a concurrency of the workload (default itl:p50 "
        "at its first concurrency); every other row is judged with Holm's correction",
        metavar="METRIC@C")


OWN = tuple(BenchAB.flags())


def add_arguments(g: argparse._ArgumentGroup) -> None:
    add_common(g, skip=("results",))
    BenchAB.add_arguments(g)


def plan(args: argparse.Namespace, arms, dep) -> ABPlan:
    own = BenchAB.from_args(args)
    if args.url:
        raise UsageError("--url is not used by bench-ab (it starts its own servers): use --port")
    # what the arm servers serve (``dep``: their K3_MODEL, K3_API_KEY, ...: --server-env over
    # the settings) is what the client asks for, tokenizes with and authenticates to
    sets = list(args.sets)
    if not any(s.startswith("model=") for s in sets) and not args.model \
            and not os.environ.get("BENCH_MODEL"):
        sets.append(f"model={dep.served_model_name}")
    args.sets = [*sets, f"url={arms.url}"]
    w, _ = resolve_from_args(args, dep)
    if w.prefix_caching is not None:
        want = "1" if w.prefix_caching else "0"
        have = arms.server_env.get("K3_PREFIX_CACHING")
        if have not in (None, want):
            raise UsageError(f"--server-env K3_PREFIX_CACHING={have}: workload {w.name} needs "
                             f"prefix caching {'on' if w.prefix_caching else 'off'} "
                             f"(K3_PREFIX_CACHING={want}), which the A/B sets on its servers")
        arms.server_env["K3_PREFIX_CACHING"] = want
    p = ABPlan(workload=w, arms=arms, results=args.results, client_image=args.client_image,
               runs_per_slot=own.runs_per_server, noise_floor_dir=own.noise_floor,
               primary=parse_primary(own.primary, w), progress=not args.quiet)
    p.dry_dir = p.results.resolve() / f"{utc_stamp()}-{p.label}"
    if not args.dry_run:
        if p.noise_floor_dir and p.mode != "aa":
            find_noise_floor(p, "")  # validate early
        check_tokenizer(w.tokenizer)
    return p
