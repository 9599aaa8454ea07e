"""Expected vs seen launch counts. Expectations come from what the server was ASKED for (the
claim), the model config (MLA layer count) and the trace's engine steps; never from the
overlay's own report (that is cross-checked separately, census/decisions.py)."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from k3rocm.checks.census.fusions import FusionClaim
from k3rocm.checks.census.modelcfg import ModelFacts
from k3rocm.checks.census.spec import ROLES, Spec, eval_formula
from k3rocm.checks.census.trace import RankTrace

SCOPES = ("decode", "other", "outside")


@dataclass
class RoleCounts:
    """Launches and time (us) per role, split by decode-only steps, the other steps and
    launches outside every step; which names matched; fused Q-prep members; the launches in
    the MLA attention region that match no role."""

    launches: dict[str, dict[str, int]]
    time_us: dict[str, dict[str, float]]
    names: dict[str, list[str]]
    members: dict[str, dict[str, int]]  # member -> scope -> launches (fused_qprep)
    unclassified: dict[str, int]  # name -> MLA-region (or unknown graph-replayed) launches


def role_counts(rt: RankTrace, spec: Spec) -> RoleCounts:
    launches = {r: dict.fromkeys(SCOPES, 0) for r in ROLES}
    time_us = {r: dict.fromkeys(SCOPES, 0.0) for r in ROLES}
    names: dict[str, set[str]] = {r: set() for r in ROLES}
    members: dict[str, dict[str, int]] = {}
    unclassified: Counter[str] = Counter()
    decode = [s.decode_only for s in rt.steps]
    qprep = spec.roles["fused_qprep"]
    for ln in [*rt.launches, *rt.outside]:
        where = "outside" if ln.step < 0 else ("decode" if decode[ln.step] else "other")
        matched = False
        for rname, role in spec.roles.items():
            if role.counts(ln.name, ln.parents, outermost=rt.mode == "cpu"):
                matched = True
                launches[rname][where] += ln.count
                time_us[rname][where] += ln.dur
                names[rname].add(ln.name)
                if rname == "fused_qprep" and qprep.members:
                    m = members.setdefault(qprep.member_of(ln.name), dict.fromkeys(SCOPES, 0))
                    m[where] += ln.count
        if not matched and rt.mode == "gpu" and (
                any(x.search(p) for p in ln.parents for x in spec.region.parents)
                or (not ln.parents and where == "decode"
                    and not any(x.search(ln.name) for x in spec.region.known_kernels))):
            # around a host operator of the MLA region; or, graph-replayed (no operator
            # around the launch) in a decode step, of no known family (GEMMs, MoE, ...)
            unclassified[ln.name] += ln.count
    return RoleCounts(launches, {r: {k: round(v, 3) for k, v in d.items()}
                                 for r, d in time_us.items()},
                      {r: sorted(v) for r, v in names.items()}, members,
                      dict(unclassified.most_common()))


@dataclass
class Check:
    rank: int | str  # "all" for checks over the whole set (ranks present, records)
    what: str
    role: str
    scope: str  # "all steps" | "decode-only steps" | "other steps" | "no step" | ...
    rule: str  # the formula in words
    expected: int | None
    seen: int
    ok: bool | None  # None = reported, not checked

    @property
    def status(self) -> str:
        return {True: "ok", False: "FAIL", None: "not checked"}[self.ok]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "status": self.status}


def other_norms(spec: Spec, model: ModelFacts) -> int | None:
    if spec.other_norms_formula is None:
        return None
    return eval_formula(spec.other_norms_formula, {"layers": model.layers,
                                                   "mla_layers": model.mla_layers})


def build_checks(rt: RankTrace, spec: Spec, model: ModelFacts, claim: FusionClaim,
                 extra_per_step: dict[str, int] | None = None) -> tuple[list[Check], RoleCounts]:
    extra = extra_per_step or {}
    rc = role_counts(rt, spec)
    L, S = model.mla_layers, len(rt.steps)
    D = sum(1 for s in rt.steps if s.decode_only)
    P = S - D
    norm_on, qprep_on = claim.qk_norm, claim.decode_qprep
    n = rc.launches
    checks: list[Check] = []

    def tot(role: str) -> int:
        return n[role]["decode"] + n[role]["other"]

    def add(role: str, scope_steps: int) -> int:
        return extra.get(role, 0) * scope_steps

    def check(what: str, role: str, scope: str, rule: str, expected: int | None,
              seen: int) -> None:  # judged when something is expected, else reported only
        checks.append(Check(rt.rank, what, role, scope, rule, expected, seen,
                            None if expected is None else seen == expected))

    asked = f"(qk_norm asked {'on' if norm_on else 'off'})"
    check(f"fused q/kv RMSNorm launches {asked}", "fused_qk_norm", "all steps",
          f"{L} MLA layers x {S} steps" if norm_on else "0 (fusion asked off)",
          (L * S if norm_on else 0) + add("fused_qk_norm", S), tot("fused_qk_norm"))
    other = other_norms(spec, model)
    check(f"stock q/kv RMSNorm launches {asked}", "qk_norm", "all steps",
          "not derivable from one trace: this model's other RMSNorm launches per step are "
          "unknown on this platform (census-ab judges the off - on difference; or pass "
          "--other-norms)" if other is None else
          ("0 (the pair is gone)" if norm_on else f"2 x {L} MLA layers x {S} steps")
          + f"; seen = all {tot('qk_norm')} RMSNorm launches - "
          f"({spec.other_norms_formula} = {other}) other norms x {S} steps",
          None if other is None else (0 if norm_on else 2 * L * S) + add("qk_norm", S),
          tot("qk_norm") - (other or 0) * S)
    q_asked = f"(decode_qprep asked {'on' if qprep_on else 'off'})"
    check(f"fused Q-prep launches {q_asked}", "fused_qprep", "decode-only steps",
          f"{L} MLA layers x {D} decode steps" if qprep_on else "0 (fusion asked off)",
          (L * D if qprep_on else 0) + add("fused_qprep", D), n["fused_qprep"]["decode"])
    check(f"stock KV-cache write launches {q_asked}", "cache_write",
          "decode-only steps", "0 (the fused launch writes the cache)" if qprep_on
          else f"{L} MLA layers x {D} decode steps",
          (0 if qprep_on else L * D) + add("cache_write", D), n["cache_write"]["decode"])
    check(f"stock q concat + fp8 quant launches {q_asked}", "q_concat_quant",
          "decode-only steps", "0 (the fused launch writes the fp8 query)" if qprep_on else
          "reported only: one per MLA layer and decode step with an fp8 KV cache; none with a "
          "bf16 query", add("q_concat_quant", D) if qprep_on else None,
          n["q_concat_quant"]["decode"])
    qrole = spec.roles["fused_qprep"]
    for m in qrole.members:
        if m.forbidden:
            check(f"fused Q-prep member '{m.name}' launches", "fused_qprep", "anywhere",
                  f"0 ({m.why})", 0, sum(rc.members.get(m.name, {}).values()))
    if qrole.members:
        ran = {k: sum(v.values()) for k, v in rc.members.items()}
        check("fused Q-prep members that ran", "fused_qprep", "anywhere", "reported only: "
              + (", ".join(f"{k} x{v}" for k, v in sorted(ran.items())) or "none"), None,
              sum(ran.values()))
    if P:
        check("fused Q-prep launches in steps with prefill", "fused_qprep", "other steps",
              "0 (never taken outside decode-only batches)", 0, n["fused_qprep"]["other"])
        check("KV-cache write launches in steps with prefill", "cache_write", "other steps",
              f"{L} MLA layers x {P} steps", L * P + add("cache_write", P),
              n["cache_write"]["other"])
    for role in ROLES:
        if n[role]["outside"]:
            check(f"{role} launches outside engine steps", role, "no step", "reported only: "
                  "launched outside any execute_* annotation (e.g. a draft model's proposal "
                  "pass or the sampler); see docs/census.md", None, n[role]["outside"])
    if rc.unclassified:
        top = ", ".join(f"{k} x{v}" for k, v in list(rc.unclassified.items())[:6])
        check("unclassified launches in the MLA attention region", "-", "all",
              f"reported only: match no role: {top}", None, sum(rc.unclassified.values()))
    return checks, rc


def step_checks(rt: RankTrace, min_decode_steps: int) -> list[Check]:
    D = sum(1 for s in rt.steps if s.decode_only)
    rule = f">= {min_decode_steps} (profile after prefill is over)"
    if rt.empty_steps:
        rule += f"; {rt.empty_steps} step(s) without a forward ignored"
    return [Check(rt.rank, "decode-only engine steps captured", "-", "trace",
                  rule, min_decode_steps, D, min_decode_steps <= D)]


def rank_checks(ranks: list[int], world_size: int, source: str) -> list[Check]:
    missing = sorted(set(range(world_size)) - set(ranks))
    extra = sorted(set(ranks) - set(range(world_size)))
    rule = f"ranks 0..{world_size - 1} (world size {world_size} from {source})"
    if missing:
        rule += f"; MISSING rank(s) {', '.join(map(str, missing))}"
    if extra:
        rule += f"; rank(s) {', '.join(map(str, extra))} outside the world"
    return [Check("all", "worker traces, one per rank", "-", "trace set", rule, world_size,
                  len(set(ranks) & set(range(world_size))), not missing and not extra)]


def columns(head: list[str], rows: list[list[str]], rule: bool = True) -> str:
    """Plain-text columns two spaces apart. ``rule``: a dashed line under the head and the last
    column (free text) left unpadded; else every column padded and each line right-stripped."""
    padded = len(head) - 1 if rule else len(head)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(padded)]
    body = [head, ["-" * w for w in widths] + ["-" * 4], *rows] if rule else [head, *rows]
    lines = ["  ".join([*(c.ljust(w) for c, w in zip(r[:padded], widths, strict=True)),
                        *r[padded:]]) for r in body]
    return "\n".join(lines if rule else [ln.rstrip() for ln in lines])


def render_table(checks: list[Check]) -> str:
    """A plain-text table: one row per check, expected next to seen."""
    return columns(["rank", "check", "scope", "expected", "seen", "status", "rule"],
                   [[str(c.rank), c.what, c.scope, _dash(c.expected), str(c.seen), c.status,
                     c.rule] for c in checks])


def summarize(checks: list[Check]) -> list[dict[str, Any]]:
    """One row per check across ranks: the value most ranks show, how many show it, and every
    rank that deviates (the per-rank rows stay in census.json)."""
    groups: dict[tuple[str, str, str], list[Check]] = {}
    for c in checks:
        groups.setdefault((c.what, c.scope, c.role), []).append(c)
    rows = []
    for (what, scope, _), cs in groups.items():
        common = Counter((c.expected, c.seen, c.ok) for c in cs).most_common(1)[0][0]
        major = [c for c in cs if (c.expected, c.seen, c.ok) == common]
        devs = [c for c in cs if (c.expected, c.seen, c.ok) != common]
        oks = [c.ok for c in cs]
        rows.append({
            "check": what, "scope": scope, "expected": common[0], "seen": common[1],
            "ranks": f"{len(major)}/{len(cs)}" if cs[0].rank != "all" else "set",
            "status": "FAIL" if False in oks else "ok" if True in oks else "not checked",
            "rule": major[0].rule,
            "deviations": [f"rank {c.rank}: expected {_dash(c.expected)}, seen {c.seen} "
                           f"({c.status})" for c in devs]})
    return rows


def render_summary(checks: list[Check]) -> str:
    """Plain text: one row per check across ranks, deviations on the row."""
    return columns(["check", "scope", "ranks", "expected", "seen", "status", "deviations / rule"],
                   [[r["check"], r["scope"], r["ranks"], _dash(r["expected"]), str(r["seen"]),
                     r["status"], "; ".join(r["deviations"]) or r["rule"]]
                    for r in summarize(checks)])


def render_summary_markdown(checks: list[Check]) -> str:
    out = ["| check | scope | ranks | expected | seen | status | rule | deviating ranks |",
           "|---|---|---|---:|---:|---|---|---|"]
    for r in summarize(checks):
        status = f"**{r['status']}**" if r["status"] == "FAIL" else r["status"]
        out.append(f"| {r['check']} | {r['scope']} | {r['ranks']} | {_dash(r['expected'])} | "
                   f"{r['seen']} | {status} | {r['rule'].replace('|', '/')} | "
                   f"{'; '.join(r['deviations']) or '-'} |")
    return "\n".join(out)


def _dash(v: int | None) -> str:
    return "-" if v is None else str(v)
