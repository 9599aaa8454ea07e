"""Expected vs seen launch counts, from the claim, the model's MLA layers, the trace's steps and
each role's kernels.json ``expect`` row (never from the decision records); each fusion judged
per rank on both halves."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from k3rocm.checks.census.fusions import FusionClaim
from k3rocm.checks.census.modelcfg import ModelFacts
from k3rocm.checks.census.spec import ROLES, Beside, Pair, Spec, eval_formula
from k3rocm.checks.census.trace import RankTrace
from k3rocm.rundir import columns, table
from k3rocm.serving.fusions import FUSIONS, Fusion

SCOPES = ("decode", "other", "outside")


@dataclass
class RoleCounts:
    """Launches and time (us) per role and scope (decode / other steps / outside), per step,
    matched names, members, and MLA-region launches that match no role."""

    launches: dict[str, dict[str, int]]
    time_us: dict[str, dict[str, float]]
    names: dict[str, list[str]]
    members: dict[str, dict[str, dict[str, int]]]  # role -> member -> scope -> launches
    unclassified: dict[str, int]  # name -> MLA-region (or unknown graph-replayed) launches
    per_step: dict[str, list[int]]  # role -> launches in each engine step


def role_counts(rt: RankTrace, spec: Spec) -> RoleCounts:
    launches = {r: dict.fromkeys(SCOPES, 0) for r in ROLES}
    time_us = {r: dict.fromkeys(SCOPES, 0.0) for r in ROLES}
    names: dict[str, set[str]] = {r: set() for r in ROLES}
    per_step = {r: [0] * len(rt.steps) for r in ROLES}
    members: dict[str, dict[str, dict[str, int]]] = {}
    unclassified: Counter[str] = Counter()
    decode = [s.decode_only for s in rt.steps]
    for ln in [*rt.launches, *rt.outside]:
        where = "outside" if ln.step < 0 else ("decode" if decode[ln.step] else "other")
        matched = False
        for rname, role in spec.roles.items():
            if role.counts(ln.name, ln.parents, outermost=rt.mode == "cpu"):
                matched = True
                launches[rname][where] += ln.count
                time_us[rname][where] += ln.dur
                names[rname].add(ln.name)
                if ln.step >= 0:
                    per_step[rname][ln.step] += ln.count
                if role.members:
                    m = members.setdefault(rname, {}).setdefault(role.member_of(ln.name),
                                                                 dict.fromkeys(SCOPES, 0))
                    m[where] += ln.count
        if not matched and rt.mode == "gpu" and (
                any(x.search(p) for p in ln.parents for x in spec.region.parents)
                or (not ln.parents and where == "decode"
                    and not any(x.search(ln.name) for x in spec.region.known_kernels))):
            unclassified[ln.name] += ln.count
    return RoleCounts(launches, {r: {k: round(v, 3) for k, v in d.items()}
                                 for r, d in time_us.items()},
                      {r: sorted(v) for r, v in names.items()}, members,
                      dict(unclassified.most_common()), per_step)


@dataclass
class Check:
    rank: int | str  # "all": over the whole set
    what: str
    role: str
    scope: str
    rule: str
    expected: int | None
    seen: int
    ok: bool | None  # None = reported only (or ``undecided``)
    fusion: str = ""
    undecided: str = ""  # why this cannot be judged
    ab_decides: bool = False  # census-ab's off - on check decides it

    @property
    def status(self) -> str:
        if self.undecided:
            return "cannot judge"
        return {True: "ok", False: "FAIL", None: "not checked"}[self.ok]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "status": self.status}


def other_norms(formula: str | None, model: ModelFacts) -> int | None:
    """The model's other RMSNorm launches per step, None when unknown."""
    if formula is None:
        return None
    return eval_formula(formula, {"layers": model.layers, "mla_layers": model.mla_layers})


NEITHER = "neither the fused nor the stock"
NOT_SEPARABLE = ("not derivable from one trace: this model's other RMSNorm launches per step "
                 "are unknown on this platform (census-ab judges the off - on difference; or "
                 "pass --other-norms FORMULA)")


def build_checks(rt: RankTrace, spec: Spec, model: ModelFacts, claim: FusionClaim,
                 extra_per_step: dict[str, int] | None = None) -> tuple[list[Check], RoleCounts]:
    """Per fusion of the table, from its roles' kernels.json ``expect``: the counts, the steps
    off the asked path, and the both-halves judgement."""
    extra = extra_per_step or {}
    rc = role_counts(rt, spec)
    L, n = model.mla_layers, rc.launches
    steps = {"all": [s.index for s in rt.steps],
             "decode": [s.index for s in rt.steps if s.decode_only]}
    prefill = [s.index for s in rt.steps if not s.decode_only]
    scope_name = {"all": "all steps", "decode": "decode-only steps"}
    other = other_norms(spec.other_norms_formula, model)
    checks: list[Check] = []
    for f in FUSIONS:
        asked = claim.asked[f.name]
        word = "on" if asked else "off"
        rows: list[Check] = []

        def check(what: str, role: str, scope: str, rule: str, expected: int | None,
                  seen: int, f=f, rows=rows) -> Check:
            c = Check(rt.rank, what, role, scope, rule, expected, seen,
                      None if expected is None else seen == expected, f.name)
            rows.append(c)
            return c

        main: dict[str, Check] = {}  # role -> its count over the fusion's steps
        off_path: list[tuple[int, str]] = []  # (step, role got/want) off the per-step count
        for role in f.roles:
            e = spec.expect[role]
            idx = steps[e.steps]
            k = len(idx)
            per = e.on if asked else e.off
            seen = n[role]["decode"] + (n[role]["other"] if e.steps == "all" else 0)
            why = e.why.get(word, "")
            rule = (f"reported only: {why}" if per is None else
                    f"{per} x {L} MLA layers x {k} steps ({why})" if per else f"0 ({why})")
            sub = 0
            if e.separable:
                if other is None:
                    per, rule = None, NOT_SEPARABLE
                else:
                    sub = other
                    rule += (f"; seen = all {seen} launches - ({spec.other_norms_formula} = "
                             f"{other}) other norms x {k} steps")
                    seen -= other * k
            expected = None if per is None else per * L * k + extra.get(role, 0) * k
            main[role] = check(f"{e.label} launches ({f.name} asked {word})", role,
                               scope_name[e.steps], rule, expected, seen)
            if e.beside is not None and asked and rt.mode == "gpu":
                near, why_not = beside(rt, spec, role, e.beside)
                row = check(f"{e.label} launches beside the {spec.expect[e.beside.fused].label}"
                            f" ones ({f.name} asked {word})", role, "all steps",
                            f"0 ({e.beside.why})" if why_not is None else
                            f"reported only: {why_not}", None if why_not else 0, near)
                if main[role].expected is None:  # the one judgement of the stock half here
                    main[role] = row
            if e.pair is not None and not asked and rt.mode == "gpu" and e.off:
                layers, anchors = pairs(rt, spec, role, e.pair, e.off)
                k_all = len(steps["all"])
                want = (L + extra.get(role, 0) // e.off) * k_all  # --extra: launches
                until = " / ".join(spec.expect[u].label for u in e.pair.until)
                row = check(f"MLA layers with their {e.label} pair right before their {until} "
                            f"({f.name} asked {word})", role, "all steps",
                            f"{L} MLA layers x {k_all} steps ({e.pair.why})" if anchors == want
                            else f"reported only: {anchors} {until} launches place the pairs, "
                            f"not one per MLA layer and step ({want})",
                            want if anchors == want else None, layers)
                if main[role].expected is None:
                    main[role] = row
            if per is not None:
                want = per * L + extra.get(role, 0)
                off_path += [(i, f"step {i}: {e.label} {got}/{want}") for i in idx
                             if (got := rc.per_step[role][i] - sub) != want]
            if e.prefill is not None and prefill:
                check(f"{e.label} launches in steps with prefill", role, "other steps",
                      f"{e.prefill} x {L} MLA layers x {len(prefill)} steps "
                      f"({e.why.get('prefill', '')})",
                      e.prefill * L * len(prefill) + extra.get(role, 0) * len(prefill),
                      n[role]["other"])
            prole = spec.roles[role]
            for m in prole.members:
                if m.forbidden:
                    check(f"{e.label} member '{m.name}' launches", role, "anywhere",
                          f"0 ({m.why})", 0,
                          sum(rc.members.get(role, {}).get(m.name, {}).values()))
            if prole.members:
                ran = {mem: sum(v.values()) for mem, v in rc.members.get(role, {}).items()}
                check(f"{e.label} members that ran", role, "anywhere", "reported only: "
                      + (", ".join(f"{mem} x{v}" for mem, v in sorted(ran.items())) or "none"),
                      None, sum(ran.values()))
        bad = [x for _, x in sorted(off_path)]
        check(f"engine steps off the asked {f.label} path ({f.name} asked {word})", "-",
              "each step", "0 steps; " + ("; ".join(bad[:6]) + (", ..." if len(bad) > 6 else "")
                                          if bad else "every step shows the asked path"),
              0, len({i for i, _ in off_path}))
        rows.append(_judge(rt.rank, f, asked, main, rows, rc))
        checks += rows
    for role in ROLES:
        if n[role]["outside"]:
            checks.append(Check(
                rt.rank, f"{role} launches outside engine steps", role, "no step",
                "reported only: launched outside any execute_* annotation (e.g. a draft model's "
                "proposal pass or the sampler); see docs/census.md", None, n[role]["outside"],
                None))
    if rc.unclassified:
        top = ", ".join(f"{k} x{v}" for k, v in list(rc.unclassified.items())[:6])
        checks.append(Check(rt.rank, "unclassified launches in the MLA attention region", "-",
                            "all", f"reported only: match no role: {top}", None,
                            sum(rc.unclassified.values()), None))
    return checks, rc


def _kinds(rt: RankTrace, classes: dict[str, list[Any]]) -> dict[str, str]:
    """Each kernel name in the step sequences -> the first class one of whose roles it hits."""
    names = {name for seq in rt.sequence for name in seq}
    return {name: next((k for k, roles in classes.items()
                        if any(r.hits(name) for r in roles)), "") for name in names}


def beside(rt: RankTrace, spec: Spec, role: str, rule: Beside) -> tuple[int, str | None]:
    """``role`` launches right before each ``rule.fused`` launch and up to the next ``until``
    launch: (count, None), or (count, why) when a fused launch has no ``until`` after it."""
    kind = _kinds(rt, {"fused": [spec.roles[rule.fused]], "stock": [spec.roles[role]],
                       "until": [spec.roles[r] for r in rule.until]})
    near = 0
    for si, seq in enumerate(rt.sequence):
        is_open = False
        for i, name in enumerate(seq):
            k = kind[name]
            if k == "fused":
                if is_open:
                    return near, (f"step {si}: a {rule.fused} launch is not followed by a "
                                  f"{' / '.join(rule.until)} launch before the next one")
                j = i - 1
                while j >= 0 and kind[seq[j]] == "stock":
                    near, j = near + 1, j - 1
                is_open = True
            elif is_open and k == "stock":
                near += 1
            elif is_open and k == "until":
                is_open = False
        if is_open:
            return near, (f"step {si}: its last {rule.fused} launch is not followed by a "
                          f"{' / '.join(rule.until)} launch")
    return near, None


def pairs(rt: RankTrace, spec: Spec, role: str, rule: Pair, size: int) -> tuple[int, int]:
    """(``until`` launches whose last run of ``role`` launches before them has ``size``,
    all ``until`` launches)."""
    kind = _kinds(rt, {"stock": [spec.roles[role]],
                       "until": [spec.roles[r] for r in rule.until]})
    found = anchors = 0
    for seq in rt.sequence:
        run, in_run = 0, False  # the last run of stock launches since the last until launch
        for name in seq:
            k = kind[name]
            if k == "stock":
                run = run + 1 if in_run else 1
                in_run = True
            elif k == "until":
                found += run == size
                anchors += 1
                run, in_run = 0, False
            else:
                in_run = False
    return found, anchors


def _judge(rank: int | str, f: Fusion, asked: bool, main: dict[str, Check],
           rows: list[Check], rc: RoleCounts) -> Check:
    """The fusion's verdict on this rank: ok (both halves), FAIL, or cannot judge (nothing
    of it under a known name, or the stock half not derivable from one trace)."""
    fused = [main[r] for r in f.fused]
    stock = [main[r] for r in f.stock]
    judged_stock = [c for c in stock if c.expected is not None]
    failed = [c for c in rows if c.ok is False]
    seen_any = sum(c.seen for c in fused) + sum(c.seen for c in judged_stock)
    what = f"{f.label} fusion ({f.name} asked {'on' if asked else 'off'}): both halves"
    rule = ("fused launches " + ("there" if asked else "absent") + " AND the stock launches "
            "it replaces " + ("gone" if asked else "there"))
    why, ab = "", False
    if failed and not seen_any:
        uncl = ", ".join(list(rc.unclassified)[:4])
        why = (f"{NEITHER} {f.label} launches were found: they may run "
               "under names kernels.json does not know"
               + (f" (unclassified MLA-region launches: {uncl})" if uncl else "")
               + ": add them there")
        if not judged_stock:
            why += f"; the stock half: {NOT_SEPARABLE}"
    elif not failed and not judged_stock:
        why, ab = f"the stock half is {NOT_SEPARABLE}", True
    if why:
        for c in rows:
            if c.ok is False:
                c.ok, c.undecided = None, why
        return Check(rank, what, "-", "fusion", why, None, 0, None, f.name, why, ab)
    return Check(rank, what, "-", "fusion", rule if not failed else
                 "FAIL: " + "; ".join(sorted({c.what for c in failed}))[:200], None, 0,
                 not failed, f.name)


def settle_ranks(checks: list[Check]) -> None:
    """A rank showing none of a fusion's launches while other ranks do FAILS, not "cannot
    judge"."""
    for f in FUSIONS:
        verdicts = [c for c in checks if c.fusion == f.name and c.scope == "fusion"
                    and c.rank != "all"]
        seen = sorted({str(c.rank) for c in verdicts if c.ok is not None})
        if not seen:
            continue
        for c in checks:
            if c.fusion == f.name and c.rank != "all" and c.undecided.startswith(NEITHER):
                c.ok, c.undecided, c.ab_decides = False, "", False
                if c.scope == "fusion":
                    c.rule = (f"FAIL: none of its launches under a known name on this rank, "
                              f"while rank(s) {', '.join(seen)} show them")


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


def render_table(checks: list[Check]) -> str:
    return columns(["rank", "check", "scope", "expected", "seen", "status", "rule"],
                   [[str(c.rank), c.what, c.scope, _dash(c.expected), str(c.seen), c.status,
                     c.rule] for c in checks])


def summarize(checks: list[Check]) -> list[dict[str, Any]]:
    """One row per check across ranks: the majority value and every deviating rank."""
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
            "status": "FAIL" if False in oks else "cannot judge" if any(
                c.undecided for c in cs) else "ok" if True in oks else "not checked",
            "rule": major[0].rule,
            "deviations": [f"rank {c.rank}: expected {_dash(c.expected)}, seen {c.seen} "
                           f"({c.status})" for c in devs]})
    return rows


def render_summary(checks: list[Check]) -> str:
    return columns(["check", "scope", "ranks", "expected", "seen", "status", "deviations / rule"],
                   [[r["check"], r["scope"], r["ranks"], _dash(r["expected"]), str(r["seen"]),
                     r["status"], "; ".join(r["deviations"]) or r["rule"]]
                    for r in summarize(checks)])


def render_summary_markdown(checks: list[Check]) -> str:
    return "\n".join(table(
        ["check", "scope", "ranks", "expected", "seen", "status", "rule", "deviating ranks"],
        "lllrr", ([r["check"], r["scope"], r["ranks"], _dash(r["expected"]), r["seen"],
                   f"**{r['status']}**" if r["status"] == "FAIL" else r["status"],
                   r["rule"].replace("|", "/"), "; ".join(r["deviations"]) or "-"]
                  for r in summarize(checks))))


def _dash(v: int | None) -> str:
    return "-" if v is None else str(v)
