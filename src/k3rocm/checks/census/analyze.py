"""Census of a set of rank traces: records vs claim, ranks, role counts, checks, and the per-rank
report (stock vs fused launches and time per MLA layer per decode step)."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from itertools import takewhile
from typing import Any

from k3rocm.checks.census import expect
from k3rocm.checks.census.decisions import Decisions, cross_check
from k3rocm.checks.census.expect import Check
from k3rocm.checks.census.fusions import FusionClaim
from k3rocm.checks.census.modelcfg import ModelFacts
from k3rocm.checks.census.spec import Spec
from k3rocm.checks.census.trace import TraceSet, iso_time
from k3rocm.errors import EXIT_CHECK_FAILED, EXIT_INCOMPLETE, EXIT_OK, UsageError
from k3rocm.rundir import columns, table
from k3rocm.serving.fusions import FUSIONS, Fusion

CAUSES = ("known causes: ROCm 7.2.0's roctracer drops graph-replayed dispatches "
          "(ROCm/ROCm#6102); kineto's activity buffer cap cuts the later steps; traces with "
          "zero GPU records (pytorch/kineto#1338); a rank that stopped profiling early. "
          "Re-collect (fewer steps: --steps, max_iterations; a ROCm build whose profiler keeps "
          "graph replays), or judge with census-ab on the same build")


@dataclass
class Census:
    traces: TraceSet
    model: ModelFacts
    claim: FusionClaim
    spec: Spec
    checks: list[Check]
    per_rank: list[dict[str, Any]]
    decisions: Decisions | None
    world_size: int
    world_source: str
    incomplete: list[dict[str, Any]] = field(default_factory=list)

    @property
    def undecided(self) -> list[Check]:
        return [c for c in self.checks if c.undecided]

    @property
    def ok(self) -> bool:
        """Nothing lost or failed, and only what census-ab's off - on decides undecided."""
        return not self.incomplete and all(c.ok is not False for c in self.checks) \
            and all(c.ab_decides for c in self.undecided)

    @property
    def verdict(self) -> str:
        if self.incomplete:
            return "INCOMPLETE TRACE"
        if any(c.ok is False for c in self.checks):
            return "FAIL"
        return "CANNOT JUDGE" if self.undecided else "PASS"

    @property
    def exit_code(self) -> int:
        return {"PASS": EXIT_OK, "FAIL": EXIT_CHECK_FAILED}.get(self.verdict, EXIT_INCOMPLETE)

    def undecided_lines(self) -> list[str]:
        by: dict[tuple[str, str], list[str]] = {}
        for c in self.undecided:
            if c.scope in ("fusion", "records", "trace"):  # not the rows judged inside them
                by.setdefault((c.fusion or c.what, c.undecided), []).append(str(c.rank))
        return [f"{what}: {why} (rank(s) {', '.join(r)})" if r != ["all"] else
                f"{what}: {why}" for (what, why), r in by.items()]

    def incomplete_lines(self) -> list[str]:
        return [f"rank {x['rank']}: {x['what']}" for x in self.incomplete]

    def table(self) -> str:
        return expect.render_summary(self.checks)

    def per_layer_step(self) -> list[dict[str, Any]]:
        """Per rank and fusion: stock vs fused launches and time in decode-only steps, also
        per MLA layer per decode step. A separable stock role (every RMSNorm) counts its
        launches less the model's other ones (None when unknown) and no ``stock_us``."""
        out = []
        L = max(self.model.mla_layers, 1)
        other = expect.other_norms(self.spec.other_norms_formula, self.model)
        for pr in self.per_rank:
            D = pr["decode_steps"]
            n = {r: v["decode"] for r, v in pr["roles"]["launches"].items()}  # decode-only
            t = {r: v["decode"] for r, v in pr["roles"]["time_us"].items()}

            def per(x: float | None, D: int = D) -> float | None:
                return round(x / (L * D), 4) if D and x is not None else None

            row: dict[str, Any] = {"rank": pr["rank"], "decode_steps": D,
                                   "mla_layers": self.model.mla_layers}
            for f in FUSIONS:
                sep = self.separable(f)
                stock = [n[r] if r not in sep else None if other is None else n[r] - other * D
                         for r in f.stock]
                counted = {
                    "stock_launches": None if None in stock else sum(stock),
                    "fused_launches": sum(n[r] for r in f.fused),
                    "stock_us": None if sep else sum(t[r] for r in f.stock),
                    "fused_us": sum(t[r] for r in f.fused)}
                members: dict[str, int] = {}
                for r in f.fused:
                    for m, v in pr["roles"]["members"].get(r, {}).items():
                        if v["decode"]:
                            members[m] = members.get(m, 0) + v["decode"]
                row[f.name] = {
                    "asked": self.claim.asked[f.name], **counted, **{
                        k: round(counted[k], 3) for k in ("stock_us", "fused_us")
                        if counted[k] is not None},
                    **{f"{r}_launches": n[r] for r in f.stock},
                    **{f"{r}_us": t[r] for r in f.stock}, "fused_members": members,
                    **{k.removesuffix("_launches") + "_per_layer_step": per(v)
                       for k, v in counted.items()},
                    "us_per_layer_step": per(sum(t[r] for r in f.roles))}
            out.append(row)
        return out

    def separable(self, f: Fusion) -> list[str]:
        return [r for r in f.stock if self.spec.expect[r].separable]

    def report_table(self) -> str:
        """Per fusion across ranks: launches (majority, deviations) and us/L/step (mean)."""
        head = ["fusion", "asked", "ranks", "stock", "fused", "stock us/L/step",
                "fused us/L/step", "total us/L/step", "fused members / note"]
        per = self.per_layer_step()
        rows = []
        for f in FUSIONS if per else ():
            xs = [(r["rank"], r[f.name]) for r in per]
            sep = self.separable(f)
            note = _common([(k, ", ".join(f"{m} x{v}" for m, v in
                                          sorted(x["fused_members"].items()))) for k, x in xs])
            if sep and xs[0][1]["stock_launches"] is None:
                note = "; ".join(f"stock not separable in one trace (all {r} launches "
                                 f"{_common([(k, x[f'{r}_launches']) for k, x in xs])})"
                                 for r in sep)
            rows.append([f.label, _onoff(xs[0][1]["asked"]), str(len(xs)),
                         _common([(k, x["stock_launches"]) for k, x in xs]),
                         _common([(k, x["fused_launches"]) for k, x in xs]),
                         _spread([x["stock_us_per_layer_step"] for _, x in xs]),
                         _spread([x["fused_us_per_layer_step"] for _, x in xs]),
                         _spread([x["us_per_layer_step"] for _, x in xs])
                         + "".join(f" (incl. all {r} launches)" for r in sep), note])
        return columns(head, rows, rule=False)

    def to_json(self) -> dict[str, Any]:
        dec = self.decisions
        return {"ok": self.ok, "verdict": self.verdict, "incomplete": self.incomplete,
                "cannot_judge": self.undecided_lines(),
                "model": asdict(self.model), "claim": self.claim.to_json(),
                "decisions": None if dec is None else dec.to_json(),
                "world_size": self.world_size, "world_size_source": self.world_source,
                "spec": self.spec.source, "checks": [c.to_json() for c in self.checks],
                "ranks": self.per_rank, "per_mla_layer_per_decode_step": self.per_layer_step(),
                "run_started": self.traces.run_started,
                "skipped_runs": self.traces.skipped_runs, "ignored_files": self.traces.ignored,
                "notes": []}

    def markdown(self, title: str = "Decode kernel census", top: int = 25) -> str:
        c, dec, oks = self.claim, self.decisions, Counter(k.ok for k in self.checks)
        lines = [f"# {title}", "",
                 f"Verdict: **{self.verdict}** "
                 + ("(the trace lost events: the counts below are not judged)"
                    if self.incomplete else
                    f"({oks[True]} ok, {oks[False]} failed, {len(self.undecided)} cannot be "
                    f"judged, {oks[None] - len(self.undecided)} reported only)"), ""]
        if self.undecided and not self.incomplete:
            lines += ["## What cannot be judged", "",
                      *[f"- {x}" for x in self.undecided_lines()], ""]
        if self.incomplete:
            lines += ["## What the trace lost", "", *[f"- {x}" for x in self.incomplete_lines()],
                      "", f"{CAUSES}.", ""]
        lines += [
                 f"- Model: `{self.model.path}` ({self.model.model_type}): "
                 f"{self.model.layers} layers, **{self.model.mla_layers} MLA**",
                 f"- Asked for ({c.source}): " + ", ".join(
                     f"{f.label} **{_onoff(c.asked[f.name])}** ({c.detail.get(f.name, '')})"
                     for f in FUSIONS),
                 "- Decision records (the overlay's or the upstream hook's): " + (
                     "not cross-checked (--skip-records)" if dec is None else
                     f"**not cross-checked**: none found (looked in {dec.source}; pass "
                     "--server-log FILE or --skip-records)" if not dec.found else
                     f"{len(dec.records)} from {dec.source}"),
                 f"- World size {self.world_size} ({self.world_source})",
                 f"- Kernel table: {self.spec.platform} rules from "
                 f"`{self.spec.source['table']}`; other RMSNorm launches per step: "
                 f"`{self.spec.other_norms_formula}`", "",
                 f"- Run judged: the newest in the directory, started "
                 f"{iso_time(self.traces.run_started)} "
                 f"({self.per_rank[0]['started_source'] if self.per_rank else ''})"]
        lines += [f"- Skipped: {x['why']}: started {x['started']}, ranks "
                  f"{_ranks(x['ranks'])} ({len(x['files'])} file(s))"
                  for x in self.traces.skipped_runs]
        lines += [f"- rank {pr['rank']}: {pr['mode']} trace `{pr['path']}`, {pr['steps']} engine "
                  f"steps ({pr['decode_steps']} decode-only, {pr['empty_steps_ignored']} without a "
                  f"forward ignored), {pr['launches']} launches, {pr['unattributed']} outside "
                  "steps" for pr in self.per_rank]
        lines += ["", "## Expected vs seen", "", expect.render_summary_markdown(self.checks), "",
                  "## Per fusion across ranks, per MLA layer per decode step", "", "```",
                  self.report_table(), "```"]
        unit = "device" if all(p["mode"] == "gpu" for p in self.per_rank) else "host (CPU op)"
        uncl = sorted({k for pr in self.per_rank for k in pr["roles"]["unclassified"]})
        if uncl:
            lines += ["", "## Unclassified launches in the MLA attention region (per rank)", "",
                      *table(["kernel", "launches per rank (ranks that differ)"], "", (
                          [f"`{k}`", _common([(pr["rank"], pr["roles"]["unclassified"].get(k, 0))
                                              for pr in self.per_rank])] for k in uncl))]
        kernels = {pr["rank"]: {k["name"]: k for k in pr["kernels"]} for pr in self.per_rank}
        every = {n: [kt[n] for kt in kernels.values() if n in kt]  # per kernel, in rank order
                 for kt in kernels.values() for n in kt}
        total = {n: sum(k["total_us"] for k in ks) for n, ks in every.items()}
        lines += ["", f"## Top {top} kernels by {unit} time, across ranks", "", *table(
            ["kernel", "launches per rank (ranks that differ)", "per step",
             "mean total us per rank", "mean us"], "llrrr",
            ([f"`{n}`", _common([(r, kt[n]["launches"] if n in kt else 0)
                                 for r, kt in kernels.items()]),
              every[n][0]["per_step"], round(total[n] / len(kernels), 3),
              round(total[n] / max(sum(k["launches"] for k in every[n]), 1), 3)]
             for n in sorted(total, key=lambda n: (-total[n], n))[:top]))]
        return "\n".join(lines) + "\n"


def _common(values: list[tuple[int, Any]]) -> str:
    top = Counter(na(v) for _, v in values).most_common(1)[0][0]
    devs = [f"rank {r}: {na(v)}" for r, v in values if na(v) != top]
    return top + (f" [{'; '.join(devs)}]" if devs else "")


def _spread(values: list[float | None]) -> str:
    xs = [v for v in values if v is not None]
    if not xs:
        return "n/a"
    mean = round(sum(xs) / len(xs), 4)
    return str(mean) if min(xs) == max(xs) else f"{mean} ({min(xs)}-{max(xs)})"


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def _onoff(v: bool | None) -> str:
    return {True: "on", False: "off", None: "unknown"}[v]


def na(v: Any) -> str:
    return "n/a" if v is None else str(v)


def run_census(traces: TraceSet, model: ModelFacts, claim: FusionClaim, spec: Spec,
               decisions: Decisions | None, world_size: int, world_source: str,
               min_decode_steps: int = 1,
               extra_per_step: dict[str, int] | None = None) -> Census:
    checks = expect.rank_checks([r.rank for r in traces.ranks], world_size, world_source)
    checks += cross_check(claim, decisions)
    per_rank = []
    for rt in traces.ranks:
        checks += expect.step_checks(rt, min_decode_steps)
        unplaced = rt.mode == "gpu" and not rt.launches and bool(rt.outside)
        if unplaced:
            why = (f"none of its {rt.unattributed} kernel(s) can be attributed to an engine "
                   "step (no launch record with the same correlation id inside a step, no "
                   "gpu_user_annotation step span on the kernel's queue); re-collect with the "
                   "profiler's runtime (HIP/CUDA API) records")
            checks.append(Check(rt.rank, "kernels attributed to engine steps", "-", "trace",
                                why, None, 0, None, undecided=why))
        cks, rc = expect.build_checks(rt, spec, model, claim, extra_per_step)
        if unplaced:
            cks = [c for c in cks if c.fusion == ""]  # nothing in any step: not judged
        if rt.mode == "gpu" and rt.launches and not any(
                sum(v.values()) for v in rc.launches.values()):
            top = ", ".join(k["name"] for k in rt.kernel_table()[:3])
            raise UsageError(
                f"rank {rt.rank} trace {rt.path.name}: none of its {rt.n_launches} GPU "
                f"kernel launches matches any kernel role of the {spec.platform} table "
                f"(top kernels: {top}); the names are in a form the table does not know: add "
                f"them to {spec.source['table']} (docs/census.md)")
        checks += cks
        per_rank.append({**rt.summary(), "steps_detail": [s.to_json() for s in rt.steps],
                         "roles": asdict(rc),
                         "per_step": [dict(c.most_common()) for c in rt.per_step_counts()],
                         "kernels": rt.kernel_table()})
    expect.settle_ranks(checks)
    return Census(traces, model, claim, spec, checks, per_rank, decisions, world_size,
                  world_source, losses(traces, world_size, spec))


def losses(traces: TraceSet, world_size: int, spec: Spec | None = None) -> list[dict[str, Any]]:
    """What the profiler lost, ({rank, what}) per finding (docs/census.md, Completeness): a
    GPU rank without kernel events (pytorch/kineto#1338) or GPU records others have; launch
    calls without their kernel; decode steps of one graph shape with fewer kernels than a step
    that ran at least as many launches of every role (ROCm/ROCm#6102, kineto's buffer cap);
    ranks without a trace."""
    present = {r.rank for r in traces.ranks}
    out = [{"rank": r, "what": "no worker trace for this rank"}
           for r in sorted(set(range(world_size)) - present)]
    gpu = [r for r in traces.ranks if r.mode == "gpu"]
    for rt in traces.ranks:
        if rt.mode == "gpu":
            continue
        if rt.gpu_evidence:
            out.append({"rank": rt.rank, "what": "no kernel events although the trace says a "
                        f"GPU ran ({'; '.join(rt.gpu_evidence)})"})
        elif gpu:
            out.append({"rank": rt.rank, "what": "no GPU records at all while rank(s) "
                        f"{', '.join(str(g.rank) for g in gpu[:4])} have kernels"})
    # kernels per decode-only step, by step shape (requests, tokens) = the graph it replays
    per_step: dict[int, list[tuple[int, tuple[int, int], Counter[str]]]] = {}
    shapes: dict[tuple[int, int], list[Counter[str]]] = defaultdict(list)
    role_of: dict[str, str] = {}  # kernel name -> its role (the name itself without a spec)

    def by_role(c: Counter[str]) -> Counter[str]:
        out: Counter[str] = Counter()
        for name, n in c.items():
            if name not in role_of:
                role_of[name] = name if spec is None else next(
                    (r for r, role in spec.roles.items() if role.hits(name)), "")
            out[role_of[name]] += n
        out["__total__"] = sum(c.values())
        del out[""]
        return out

    for rt in gpu:
        counts = [by_role(c) for c in rt.per_step_counts()]
        rows = [(s.index, (s.gen_reqs, s.gen_tokens), counts[s.index])
                for s in rt.steps if s.decode_only]
        per_step[rt.rank] = rows
        for _, key, c in rows:
            shapes[key].append(c)
        lost = sum(rt.lost_launches.values())
        if lost:
            steps = sorted(rt.lost_launches)
            out.append({"rank": rt.rank, "what": f"{lost} kernel launch(es) without their "
                        f"kernel record (in engine step(s) {', '.join(map(str, steps[:8]))}"
                        f"{', ...' if len(steps) > 8 else ''})"})
    for rank, rows in per_step.items():
        short = [(i, k, best) for i, key, c in rows
                 if (best := _complete(c, shapes[key])) > (k := c["__total__"])]
        if not short:
            continue
        total = sum(best - k for _, k, best in short)
        empty = [i for i, k, _ in short if k == 0]
        detail = ", ".join(f"step {i}: {k}/{best}" for i, k, best in short[:6])
        what = (f"{total} kernel(s) missing in {len(short)} of {len(rows)} decode-only steps "
                f"that replay the same graph as complete ones ({detail}"
                f"{', ...' if len(short) > 6 else ''})")
        if empty and empty[-1] == rows[-1][0]:
            tail = sum(1 for _ in takewhile(lambda row: not row[2]["__total__"], reversed(rows)))
            what += f"; the last {tail} step(s) have no kernels (a cut-off tail)"
        out.append({"rank": rank, "what": what})
    return out


def _complete(step: Counter[str], same_shape: list[Counter[str]]) -> int:
    """Kernels of the largest same-shape step with at least ``step``'s launches per role."""
    return max(c["__total__"] for c in same_shape
               if all(c[name] >= n for name, n in step.items() if name != "__total__"))
