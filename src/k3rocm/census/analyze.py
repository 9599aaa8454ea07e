"""Census of a set of rank traces: per-kernel tables, role counts, checks, and the report."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from k3rocm.census.expect import (
    Check,
    build_checks,
    render_markdown_table,
    render_table,
    step_checks,
)
from k3rocm.census.fusions import FusionStates
from k3rocm.census.modelcfg import ModelFacts
from k3rocm.census.spec import Spec
from k3rocm.census.trace import TraceSet


@dataclass
class Census:
    traces: TraceSet
    model: ModelFacts
    fusions: FusionStates
    spec: Spec
    checks: list[Check]
    per_rank: list[dict[str, Any]]

    @property
    def ok(self) -> bool:
        return all(c.ok is not False for c in self.checks)

    def table(self) -> str:
        return render_table(self.checks)

    def per_layer_step(self) -> list[dict[str, Any]]:
        """Launches and time per MLA layer per decode step, per rank (the A/B unit)."""
        out = []
        L = max(self.model.mla_layers, 1)
        for pr in self.per_rank:
            D = pr["decode_steps"]
            row: dict[str, Any] = {"rank": pr["rank"], "decode_steps": D}
            tot_l = tot_t = 0.0
            for role in ("fused_qk_norm", "qk_norm", "fused_qprep", "cache_write",
                         "q_concat_quant"):
                n = pr["roles"]["launches"][role]["decode"]
                t = pr["roles"]["time_us"][role]["decode"]
                row[role] = {"launches": n, "time_us": round(t, 3),
                             "launches_per_layer_step": round(n / (L * D), 4) if D else None,
                             "us_per_layer_step": round(t / (L * D), 4) if D else None}
            for role in ("fused_qprep", "cache_write", "q_concat_quant"):
                tot_l += pr["roles"]["launches"][role]["decode"]
                tot_t += pr["roles"]["time_us"][role]["decode"]
            row["qprep_group"] = {
                "launches": int(tot_l), "time_us": round(tot_t, 3),
                "launches_per_layer_step": round(tot_l / (L * D), 4) if D else None,
                "us_per_layer_step": round(tot_t / (L * D), 4) if D else None}
            out.append(row)
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "model": self.model.to_json(),
            "fusions": self.fusions.to_json(),
            "spec": self.spec.source,
            "checks": [c.to_json() for c in self.checks],
            "ranks": self.per_rank,
            "per_mla_layer_per_decode_step": self.per_layer_step(),
            "ignored_files": self.traces.ignored,
        }

    def markdown(self, title: str = "Decode kernel census", top: int = 25) -> str:
        f = self.fusions
        lines = [f"# {title}", "",
                 f"Verdict: **{'PASS' if self.ok else 'FAIL'}** "
                 f"({sum(c.ok is True for c in self.checks)} ok, "
                 f"{sum(c.ok is False for c in self.checks)} mismatched, "
                 f"{sum(c.ok is None for c in self.checks)} reported only)", "",
                 f"- Model: `{self.model.path}` ({self.model.model_type}): "
                 f"{self.model.layers} layers, **{self.model.mla_layers} MLA**",
                 f"- Fusions ({f.source}): q/kv RMSNorm **{_onoff(f.qk_norm)}** "
                 f"({f.reasons.get('qk_norm', '')}), decode Q-prep "
                 f"**{_onoff(f.decode_qprep)}** ({f.reasons.get('decode_qprep', '')})",
                 f"- Platform rules: {self.spec.platform}; other RMSNorm launches per step: "
                 f"`{self.spec.other_norms_formula}`", ""]
        for pr in self.per_rank:
            lines.append(f"- rank {pr['rank']}: {pr['mode']} trace `{pr['path']}`, "
                         f"{pr['steps']} engine steps ({pr['decode_steps']} decode-only), "
                         f"{pr['launches']} launches, {pr['unattributed']} outside steps")
        lines += ["", "## Expected vs seen", "", render_markdown_table(self.checks), "",
                  "## Per MLA layer per decode step", "",
                  "| rank | role | launches | time (us) | launches / layer / step | "
                  "us / layer / step |", "|---:|---|---:|---:|---:|---:|"]
        for row in self.per_layer_step():
            for role in ("fused_qk_norm", "qk_norm", "fused_qprep", "cache_write",
                         "q_concat_quant", "qprep_group"):
                r = row[role]
                lines.append(f"| {row['rank']} | {role} | {r['launches']} | {r['time_us']} | "
                             f"{r['launches_per_layer_step']} | {r['us_per_layer_step']} |")
        unit = "device" if all(p["mode"] == "gpu" for p in self.per_rank) else "host (CPU op)"
        for pr in self.per_rank:
            lines += ["", f"## Rank {pr['rank']}: top {top} by {unit} time", "",
                      "| kernel | launches | per step | total us | mean us |",
                      "|---|---:|---:|---:|---:|"]
            for k in pr["kernels"][:top]:
                lines.append(f"| `{k['name']}` | {k['launches']} | {k['per_step']} | "
                             f"{k['total_us']} | {k['mean_us']} |")
        return "\n".join(lines) + "\n"


def _onoff(v: bool | None) -> str:
    return {True: "ON", False: "OFF", None: "unknown"}[v]


def run_census(traces: TraceSet, model: ModelFacts, fusions: FusionStates, spec: Spec,
               min_decode_steps: int = 1, extra_per_step: dict[str, int] | None = None,
               all_ranks: bool = True) -> Census:
    checks: list[Check] = []
    per_rank = []
    ranks = traces.ranks if all_ranks else traces.ranks[:1]
    for rt in ranks:
        checks += step_checks(rt, min_decode_steps)
        cks, rc = build_checks(rt, spec, model, fusions, extra_per_step)
        checks += cks
        per_rank.append({**rt.summary(), "steps_detail": [s.to_json() for s in rt.steps],
                         "roles": {"launches": rc.launches, "time_us": rc.time_us,
                                   "names": rc.names},
                         "per_step": [dict(c.most_common()) for c in rt.per_step_counts()],
                         "kernels": rt.kernel_table()})
    return Census(traces, model, fusions, spec, checks, per_rank)
