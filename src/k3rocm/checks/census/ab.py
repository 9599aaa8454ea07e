"""The census measure of the A/B driver (``census-ab``): each arm's decode kernel census and the
off - on launch checks; ``--trace-dirs OFF,ON`` compares two existing trace sets offline.

Run directory ``<UTC>-census-ab/``: ``off/`` and ``on/`` (full census runs + server.log),
``ab.json``, ``ab.md``, ``provenance.json``. Exit 0 both arms pass, 1 one does not, 2 bad
input, 3 server, 4 incomplete trace or undecided.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from k3rocm.checks.census.analyze import Census, na
from k3rocm.checks.census.cli import (
    AnalysisFlags,
    analysis_from,
    profiling_from,
    results_root,
)
from k3rocm.checks.census.expect import Check, render_table
from k3rocm.checks.census.fusions import from_env
from k3rocm.checks.census.pipeline import (
    Profiling,
    analyse,
    claim_from_container,
    live_census,
    read_decisions,
    trace_files,
    write_report,
)
from k3rocm.deploy import runrecord
from k3rocm.errors import EXIT_INCOMPLETE, UsageError
from k3rocm.options import Options, option
from k3rocm.rundir import columns, create_run_dir
from k3rocm.serving.config import redact_env
from k3rocm.serving.fusions import BY_NAME, FUSIONS, Fusion

CONTAINER_TRACE_DIR = "/tmp/k3rocm-census-traces"


class CensusAbFlags(Options):
    trace_dirs: str | None = option(None, "compare two existing trace sets instead of starting "
                                    "servers", metavar="OFF_DIR,ON_DIR")


REPEATS = 1
SINGLE = ("census-ab", "a census counts launches exactly")
OWN = ("trace_dirs", *Profiling.flags())


def add_arguments(g: argparse._ArgumentGroup) -> None:
    CensusAbFlags.add_arguments(g)
    Profiling.add_arguments(g)
    AnalysisFlags.add_arguments(g, skip=("results",))


LABELS = {"A": "off", "B": "on"}  # the driver's arms as census-ab names them


def compare(arms: dict[str, Census]) -> dict[str, Any]:
    """Per rank and fusion, off vs on: launches (stock -> fused), us per MLA layer per decode
    step, and the A/B checks: a separable stock role (every RMSNorm) must lose exactly its 'off'
    count x MLA layers x decode steps (the other launches cancel)."""
    off, on = ({row["rank"]: row for row in arms[k].per_layer_step()} for k in ("off", "on"))
    expect = arms["on"].spec.expect
    rows: list[dict[str, Any]] = []
    checks: list[Check] = []
    notes = {f.name: _note(f, arms["on"]) for f in FUSIONS}
    for rank in sorted(set(off) | set(on)):
        if rank not in off or rank not in on:
            checks.append(Check(rank, "rank present in both arms", "-", "A/B",
                                "each rank needs a trace in both arms", 2, 1, False))
            continue
        a, b = off[rank], on[rank]
        Da, Db = a["decode_steps"], b["decode_steps"]
        L = b["mla_layers"]
        for f in FUSIONS:
            x, y = a[f.name], b[f.name]
            sep = arms["on"].separable(f)
            offs: list[Any] = []  # per stock role: launches in arm off, on (None: n/a)
            ons: list[Any] = []
            for r in f.stock:
                if r not in sep:
                    offs.append(x[f"{r}_launches"])
                    ons.append(y[f"{r}_launches"])
                    continue
                removed = None if not (Da and Db) else \
                    round(x[f"{r}_launches"] * Db / Da) - y[f"{r}_launches"]
                offs.append(removed)
                ons.append(None if removed is None else 0)
                if arms["on"].claim.asked[f.name] and not arms["off"].claim.asked[f.name]:
                    seen, want = -1 if removed is None else removed, expect[r].off or 0
                    checks.append(Check(
                        rank, f"{expect[r].label} launches removed (off - on)", r,
                        "decode-only steps", f"{want} x {L} MLA layers x {Db} decode steps",
                        want * L * Db, seen, seen == want * L * Db))
            ta, tb = x["us_per_layer_step"], y["us_per_layer_step"]
            members = ", ".join(f"{k} x{v}" for k, v in sorted(y["fused_members"].items()))
            off_stock, on_stock = (None if None in v else sum(v) for v in (offs, ons))
            rows.append({"rank": rank, "fusion": f.name, "off_decode_steps": Da,
                         "on_decode_steps": Db, "off_stock": off_stock,
                         "on_stock": on_stock, "off_fused": x["fused_launches"],
                         "on_fused": y["fused_launches"], "off_us_per_layer_step": ta,
                         "on_us_per_layer_step": tb, "saved_us_per_layer_step":
                         None if ta is None or tb is None else round(ta - tb, 4),
                         "note": notes[f.name] + (f"; fused members {members}" if members
                                                  else "")})
    return {"rows": rows, "checks": checks, "notes": notes,
            "decode_steps": {k: {r["rank"]: r["decode_steps"] for r in v.per_layer_step()}
                             for k, v in arms.items()}}


def _note(f: Fusion, c: Census) -> str:
    """What the fusion's stock and time columns hold."""
    sep = c.separable(f)
    return " + ".join(f"{c.spec.expect[r].label}" + (
        f" = the off - on difference of all {r} launches (the other ones cancel)"
        if r in sep else "") for r in f.stock) + "".join(
        f"; us includes all {r} launches" for r in sep)


def render_ab_table(cmp: dict[str, Any]) -> str:
    head = ["rank", "fusion", "launches off -> on", "decode steps", "stock off", "stock on",
            "fused off",
            "fused on", "us/L/step off", "on", "saved"]
    rows = []
    for r in cmp["rows"]:
        off_total = None if r["off_stock"] is None else r["off_stock"] + r["off_fused"]
        on_total = None if r["on_stock"] is None else r["on_stock"] + r["on_fused"]
        rows.append([str(r["rank"]), BY_NAME[r["fusion"]].label,
                     f"{na(off_total)} -> {na(on_total)}",
                     f"{na(r['off_decode_steps'])} -> {na(r['on_decode_steps'])}",
                     *(na(r[k]) for k in ("off_stock", "on_stock", "off_fused", "on_fused",
                                          "off_us_per_layer_step", "on_us_per_layer_step",
                                          "saved_us_per_layer_step"))])
    return columns(head, rows, rule=False)


@dataclass
class CensusAb:
    """census-ab's plan and run state (the A/B driver's measure protocol): one profile per arm,
    the arm's census in ``<run>/off/`` or ``<run>/on/`` beside its server log; or (offline) two
    trace sets analysed. Its censuses judge each arm against the overlay's decision records
    themselves (no driver fusion check)."""

    arm_env: dict[str, dict[str, str]]
    label: str = "census-ab"
    arms: Any = None  # k3rocm.checks.ab.arms.Arms
    opts: Any = None  # Analysis
    load: Any = None  # Profiling
    results: dict[str, Census] = field(default_factory=dict)
    run: Any = None  # the driver's Run (live), else the offline run directory's
    meta: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    report, checks_fusions = "ab", False

    def log_name(self, _slot: int, arm: str) -> str:
        return f"{LABELS[arm]}/server.log"

    def measure(self, _slot: int, arm: str, srv, info: dict) -> None:
        name, run = LABELS[arm], self.run
        container = srv.container(run.client)
        claim = claim_from_container(container)  # what it was asked (its rendering)
        self.results[name] = live_census(
            self.arms.url, run.model, run.api_key, run.client, container, claim, run.dir / name,
            self.opts, self.load, title=f"Decode kernel census, arm {name}",
            dep=info["deployment"])
        print(f"--- arm {name} ---\n{self.results[name].table()}")

    def compare(self, _slots: list[dict]) -> dict[str, Any]:
        """Write provenance.json; ab.json's document (ab.md: :meth:`markdown`)."""
        run, load, arms, results = self.run, self.load, self.arms, self.results
        if arms is not None:  # live
            self.meta = {
                "protocol": f"one fresh compose server per arm from image `{run.image}` "
                f"({run.image_id}), the same load in both arms (concurrency {load.concurrency}, "
                f"{load.max_tokens} output tokens, profiling {load.steps} decode steps after "
                "prefill), one profile per arm", "image": run.image, "image_id": run.image_id,
                "concurrency": load.concurrency, "max_tokens": load.max_tokens,
                "steps": load.steps}
            self.provenance = {
                "image": run.image, "image_id": run.image_id, "topology": arms.topology(),
                "server_env": redact_env(arms.describe_env()),
                "arms": {LABELS[a]: f"{LABELS[a]}/provenance.json" for a in arms.slots()}}
        runrecord.write(run.dir, runrecord.build(
            trace_files=trace_files([r.path for c in results.values() for r in c.traces.ranks]),
            **self.provenance))
        self.cmp = cmp = compare(results)
        ok = all(c.ok for c in results.values()) and all(c.ok is not False
                                                         for c in cmp["checks"])
        return {"ok": ok,
                "incomplete": {k: v.incomplete for k, v in results.items() if v.incomplete},
                "meta": self.meta,
                "comparison": {**cmp, "checks": [c.to_json() for c in cmp["checks"]]},
                "arms": {k: {"ok": v.ok, "claim": v.claim.to_json(),
                             "checks": [c.to_json() for c in v.checks]}
                         for k, v in results.items()}}

    def markdown(self, doc: dict[str, Any]) -> str:
        results, cmp = self.results, self.cmp
        unit = "device" if all(p["mode"] == "gpu" for c in results.values()
                               for p in c.per_rank) else "host (CPU operator)"
        lines = ["# Decode kernel census A/B: fusions off vs on", "",
                 f"Protocol: {doc['meta']['protocol']}. Times are {unit} times per MLA layer "
                 "per decode step.", ""]
        for key, name in LABELS.items():
            lines.append(f"- arm **{name}** (asked {self.arm_env[key]}): census "
                         f"**{results[name].verdict}** (see `{name}/census.md`)")
            lines += [f"  - lost: {x}" for x in results[name].incomplete_lines()]
        lines += ["", "```", render_ab_table(cmp), "```", "",
                  *(f"{BY_NAME[k].label}: {v}." for k, v in cmp["notes"].items()),
                  "A single profile per arm: launch counts are exact, times are one sample (no "
                  "confidence interval).", ""]
        if cmp["checks"]:
            lines += ["## A/B checks", "", "```", render_table(cmp["checks"]), "```", ""]
        return "\n".join(lines)

    def verdict(self, doc: dict[str, Any], run_dir: Path) -> int:
        """Print the report and the verdict; the exit code."""
        results, where = self.results, f"report in {run_dir}/ab.md"
        print(self.markdown(doc))
        failed = [f"arm {k}" for k, v in results.items()
                  if any(c.ok is False for c in v.checks)] \
            + [f"rank {c.rank}: {c.what}" for c in self.cmp["checks"] if c.ok is False]
        incomplete = [k for k, v in results.items() if v.incomplete]
        if incomplete:
            print(f"census-ab: INCOMPLETE TRACE (arm(s) {', '.join(incomplete)} lost events; "
                  f"nothing judged; see the arms' census.md); {where}")
            return EXIT_INCOMPLETE
        if failed:
            print(f"census-ab: FAIL ({'; '.join(failed)}); {where}")
            return 1
        # undecided: nothing contradicts the claim, nothing proves it either
        undecided = [f"arm {k}: {line}" for k, v in results.items() if not v.ok
                     for line in v.undecided_lines()]
        if undecided:
            print(f"census-ab: CANNOT JUDGE ({'; '.join(undecided)}); {where}")
            return EXIT_INCOMPLETE
        print(f"census-ab: PASS; {where}")
        return 0


def plan(args: argparse.Namespace, arms, dep) -> CensusAb:
    load = profiling_from(args)  # traces copied out of each arm's container
    # Both arms profile into a directory inside the container (copied out afterwards).
    arms.server_env = {"VLLM_RPC_TIMEOUT": "1800000", **arms.server_env,
                       "K3_PROFILER_DIR": CONTAINER_TRACE_DIR}
    # ``dep``: the checkpoint the arm servers load (--server-env)
    return CensusAb(arms.arm_env, args.label or "census-ab", arms, analysis_from(args, dep), load)


def offline(args: argparse.Namespace, arm_env: dict[str, dict[str, str]]) -> CensusAb:
    """``--trace-dirs OFF,ON``: the two trace sets analysed as the arms would be; no server."""
    dirs = [x.strip() for x in args.trace_dirs.split(",")]
    if len(dirs) != 2 or not all(dirs):
        raise UsageError(f"--trace-dirs {args.trace_dirs!r} must be OFF_DIR,ON_DIR")
    for d in dirs:
        if not Path(d).is_dir():
            raise UsageError(f"--trace-dirs: {d} is not a directory")
    opts = analysis_from(args)
    results = {LABELS[a]: analyse(d, opts, from_env(arm_env[a], f"the {LABELS[a]} arm (--on "
                                                    f"{args.on})"), read_decisions(opts, d))
               for a, d in zip(LABELS, map(Path, dirs), strict=True)}
    run_dir = create_run_dir(results_root(args), args.label or "census-ab")
    for (arm, c), trace_dir in zip(results.items(), dirs, strict=True):
        (run_dir / arm).mkdir()
        write_report(run_dir / arm, c, runrecord.build(
            source="trace-dir", trace_dir=trace_dir,
            claim=c.claim.to_json(), trace_files=trace_files([r.path for r in c.traces.ranks])),
            title=f"Decode kernel census, arm {arm}", top=args.top)
        print(f"--- arm {arm} ---\n{c.table()}")
    return CensusAb(arm_env, results=results, run=SimpleNamespace(dir=run_dir), meta={
        "protocol": f"offline comparison of {dirs[0]} (off) and {dirs[1]} (on)",
        "trace_dirs": dirs}, provenance={"trace_dirs": dirs, "arms": {
            LABELS[a]: e for a, e in arm_env.items()}})
