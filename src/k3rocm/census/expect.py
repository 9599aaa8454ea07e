"""Expected vs seen launch counts, derived from the model config, the trace and fusion states."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from k3rocm.census.fusions import FusionStates
from k3rocm.census.modelcfg import ModelFacts
from k3rocm.census.spec import ROLES, Spec, eval_formula
from k3rocm.census.trace import RankTrace


@dataclass
class RoleCounts:
    """Launches and time (us) per role, split by decode-only steps and the other steps."""

    launches: dict[str, dict[str, int]]
    time_us: dict[str, dict[str, float]]
    names: dict[str, list[str]]  # which normalized names matched each role


def role_counts(rt: RankTrace, spec: Spec) -> RoleCounts:
    launches = {r: {"decode": 0, "other": 0, "outside": 0} for r in ROLES}
    time_us = {r: {"decode": 0.0, "other": 0.0, "outside": 0.0} for r in ROLES}
    names: dict[str, set[str]] = {r: set() for r in ROLES}
    decode = [s.decode_only for s in rt.steps]
    for ln in [*rt.launches, *rt.outside]:
        for rname, role in spec.roles.items():
            if role.counts(ln.name, ln.parents, outermost=rt.mode == "cpu"):
                where = "outside" if ln.step < 0 else ("decode" if decode[ln.step] else "other")
                launches[rname][where] += 1
                time_us[rname][where] += ln.dur
                names[rname].add(ln.name)
    return RoleCounts(launches, {r: {k: round(v, 3) for k, v in d.items()}
                                 for r, d in time_us.items()},
                      {r: sorted(v) for r, v in names.items()})


@dataclass
class Check:
    rank: int
    what: str
    role: str
    scope: str  # "all steps" | "decode-only steps" | "other steps"
    rule: str  # the formula in words
    expected: int | None
    seen: int
    ok: bool | None  # None = reported, not checked

    @property
    def status(self) -> str:
        return {True: "ok", False: "MISMATCH", None: "not checked"}[self.ok]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["status"] = self.status
        return d


def build_checks(rt: RankTrace, spec: Spec, model: ModelFacts, fusions: FusionStates,
                 extra_per_step: dict[str, int] | None = None) -> tuple[list[Check], RoleCounts]:
    extra = extra_per_step or {}
    rc = role_counts(rt, spec)
    L = model.mla_layers
    S = len(rt.steps)
    D = sum(1 for s in rt.steps if s.decode_only)
    P = S - D
    norm_on = bool(fusions.qk_norm)
    qprep_on = bool(fusions.decode_qprep)
    n = rc.launches

    def tot(role: str) -> int:
        return n[role]["decode"] + n[role]["other"]

    def add(role: str, scope_steps: int) -> int:
        return extra.get(role, 0) * scope_steps

    checks: list[Check] = []
    on_off = "on" if norm_on else "off"
    checks.append(Check(
        rt.rank, f"fused q/kv RMSNorm launches (fusion {on_off})", "fused_qk_norm", "all steps",
        f"{L} MLA layers x {S} steps" if norm_on else "0 (fusion off)",
        (L * S if norm_on else 0) + add("fused_qk_norm", S), tot("fused_qk_norm"), None))
    if spec.other_norms_formula is not None:
        other = eval_formula(spec.other_norms_formula,
                             {"layers": model.layers, "mla_layers": L})
        seen = tot("qk_norm") - other * S
        checks.append(Check(
            rt.rank, f"separate q/kv RMSNorm launches (fusion {on_off})", "qk_norm",
            "all steps",
            ("0 (pair gone)" if norm_on else f"2 x {L} MLA layers x {S} steps")
            + f"; seen = all {tot('qk_norm')} - ({spec.other_norms_formula} = {other}) x {S}"
            " other norms", (0 if norm_on else 2 * L * S) + add("qk_norm", S), seen, None))
    else:
        checks.append(Check(
            rt.rank, f"separate q/kv RMSNorm launches (fusion {on_off})", "qk_norm",
            "all steps", "not derivable: this model's other RMSNorm launches per step are "
            "unknown for this platform (see census-ab for the off-on difference)",
            None, tot("qk_norm"), None))
    q_on_off = "on" if qprep_on else "off"
    checks.append(Check(
        rt.rank, f"fused Q-prep launches (fusion {q_on_off})", "fused_qprep",
        "decode-only steps", f"{L} MLA layers x {D} decode steps" if qprep_on
        else "0 (fusion off)", (L * D if qprep_on else 0) + add("fused_qprep", D),
        n["fused_qprep"]["decode"], None))
    checks.append(Check(
        rt.rank, f"KV-cache write launches (Q-prep fusion {q_on_off})", "cache_write",
        "decode-only steps", "0 (done by the fused launch)" if qprep_on
        else f"{L} MLA layers x {D} decode steps",
        (0 if qprep_on else L * D) + add("cache_write", D), n["cache_write"]["decode"], None))
    if P:
        checks.append(Check(
            rt.rank, "fused Q-prep launches in steps with prefill", "fused_qprep",
            "other steps", "0 (never taken outside decode-only batches)",
            0, n["fused_qprep"]["other"], None))
        checks.append(Check(
            rt.rank, "KV-cache write launches in steps with prefill", "cache_write",
            "other steps", f"{L} MLA layers x {P} steps",
            L * P + add("cache_write", P), n["cache_write"]["other"], None))
    if n["q_concat_quant"]["decode"] or not qprep_on:
        checks.append(Check(
            rt.rank, "q concat + fp8 quant launches in MLA attention", "q_concat_quant",
            "decode-only steps", "reported only: generic kernels (cat, fp8 quant) launched "
            "inside the MLA attention operator; the fused Q-prep replaces them", None,
            n["q_concat_quant"]["decode"], None))
    for role in ROLES:
        if n[role]["outside"]:
            checks.append(Check(
                rt.rank, f"{role} launches outside engine steps", role, "no step",
                "reported only: launched outside any execute_* annotation (e.g. a draft "
                "model's proposal pass or the sampler); see docs/census.md", None,
                n[role]["outside"], None))
    for c in checks:
        if c.expected is not None:
            c.ok = c.seen == c.expected
    return checks, rc


def step_checks(rt: RankTrace, min_decode_steps: int) -> list[Check]:
    D = sum(1 for s in rt.steps if s.decode_only)
    return [Check(rt.rank, "decode-only engine steps captured", "-", "trace",
                  f">= {min_decode_steps} (profile after prefill is over)", min_decode_steps,
                  D, min_decode_steps <= D)]


def render_table(checks: list[Check]) -> str:
    """A plain-text table: one row per check, expected next to seen."""
    head = ["rank", "check", "scope", "expected", "seen", "status", "rule"]
    rows = [[str(c.rank), c.what, c.scope, "-" if c.expected is None else str(c.expected),
             str(c.seen), c.status, c.rule] for c in checks]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head) - 1)]
    lines = []
    for r in [head, ["-" * w for w in widths] + ["-" * 4], *rows]:
        cells = "  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True))
        lines.append(cells + "  " + r[-1])
    return "\n".join(lines)


def render_markdown_table(checks: list[Check]) -> str:
    out = ["| rank | check | scope | expected | seen | status | rule |",
           "|---:|---|---|---:|---:|---|---|"]
    for c in checks:
        exp = "-" if c.expected is None else str(c.expected)
        status = f"**{c.status}**" if c.ok is False else c.status
        out.append(f"| {c.rank} | {c.what} | {c.scope} | {exp} | {c.seen} | {status} | "
                   f"{c.rule} |")
    return "\n".join(out)
