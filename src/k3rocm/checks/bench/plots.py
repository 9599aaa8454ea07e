"""PNG plots of a bench run (matplotlib, Agg backend; host side only)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

from k3rocm.checks.bench.summary import LATENCY_METRICS
from k3rocm.rundir import write_bytes_atomic


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        return None
    return plt


def _save(fig, path: Path) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    write_bytes_atomic(path, buf.getvalue())
    return path


def write_plots(points: Sequence[dict], out_dir: Path, title: str) -> list[Path]:
    """latency_vs_concurrency.png and throughput_vs_interactivity.png (failed points marked);
    [] when matplotlib is missing."""
    if (plt := _pyplot()) is None:
        return []
    ok = [p for p in points if p["status"] == "ok" and p.get("metrics")]
    failed = [p for p in points if p["status"] != "ok"]
    all_c = sorted({p["concurrency"] for p in points})
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key in zip(axes, ("ttft", "itl", "e2el"), strict=True):
        _, label, unit = LATENCY_METRICS[key]
        xs = [p["concurrency"] for p in ok if key in p["metrics"]]
        for stat, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            ax.plot(xs, [p["metrics"][key][stat] for p in ok if key in p["metrics"]], style,
                    label=stat)
        for p in failed:
            ax.axvline(p["concurrency"], color="red", alpha=0.4, linestyle="--")
        ax.set(xlabel="concurrency", ylabel=f"{label} ({unit})", title=label)
        if xs and max(xs) / max(min(xs), 1) >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(all_c, [str(c) for c in all_c])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{title}: latency vs concurrency" + (" (red: failed points)" if failed else ""))
    written = [_save(fig, out_dir / "latency_vs_concurrency.png")]
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4.2))
    pts = [(x, y, p["concurrency"]) for p in ok
           if (x := p["metrics"].get("tps_user", {}).get("p50")) is not None
           and (y := p.get("output_tps")) is not None]
    if pts:
        ax.plot([t[0] for t in pts], [t[1] for t in pts], "o-")
        for x, y, c in pts:
            ax.annotate(f"c={c}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    else:
        ax.text(0.5, 0.5, "no successful point", ha="center", va="center",
                transform=ax.transAxes)
    ax.set(xlabel="interactivity: output tokens/s per user (p50)",
           ylabel="throughput: output tokens/s (all users)",
           title=f"{title}: throughput vs interactivity")
    ax.grid(alpha=0.3)
    written.append(_save(fig, out_dir / "throughput_vs_interactivity.png"))
    plt.close(fig)
    return written
