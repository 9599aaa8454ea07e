"""Completeness before judgement: is the profiler's record whole enough to count launches?

A fusion check compares launch counts with layers x steps; a trace that lost events gives
"123/144" or "0/144" although nothing failed. So before any check is judged, the trace set is
tested for the losses known on ROCm and CUDA, and a set that lost events gets the verdict
"incomplete trace" (exit 4), naming what was lost and the known causes, never "fusion failed":

- a rank whose trace says a GPU ran (devices in ``deviceProperties``, HIP/CUDA runtime events,
  device annotations) but holds no kernel event (pytorch/kineto#1338: traces with zero GPU
  records), or a rank without GPU records while other ranks have them;
- launches whose kernel record never arrived (a ``hip*LaunchKernel`` with a correlation id no
  kernel carries);
- decode-only steps that replay the same graph (same requests and tokens) but show fewer
  kernels than the same step shape elsewhere, on this rank or another (graph-replayed dispatches
  dropped by ROCm 7.2.0's roctracer, ROCm/ROCm#6102; kineto's activity buffer cap cutting the
  later steps: a tail of steps with fewer or no kernels);
- ranks of the world without a worker trace.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import takewhile
from typing import Any

from k3rocm.checks.census.trace import TraceSet

CAUSES = ("known causes: ROCm 7.2.0's roctracer drops graph-replayed dispatches "
          "(ROCm/ROCm#6102); kineto's activity buffer cap cuts the later steps; traces with "
          "zero GPU records (pytorch/kineto#1338); a rank that stopped profiling early. "
          "Re-collect (fewer steps: --steps, max_iterations; a ROCm build whose profiler keeps "
          "graph replays), or judge with census-ab on the same build")


def losses(traces: TraceSet, world_size: int) -> list[dict[str, Any]]:
    """What was lost, one entry per finding: {rank, what}."""
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
    per_step: dict[int, list[tuple[int, tuple[int, int], int]]] = {}
    best: dict[tuple[int, int], int] = defaultdict(int)
    for rt in gpu:
        n = [sum(c.values()) for c in rt.per_step_counts()]
        rows = [(s.index, (s.gen_reqs, s.gen_tokens), n[s.index])
                for s in rt.steps if s.decode_only]
        per_step[rt.rank] = rows
        for _, key, k in rows:
            best[key] = max(best[key], k)
        lost = sum(rt.lost_launches.values())
        if lost:
            steps = sorted(rt.lost_launches)
            out.append({"rank": rt.rank, "what": f"{lost} kernel launch(es) without their "
                        f"kernel record (in engine step(s) {', '.join(map(str, steps[:8]))}"
                        f"{', ...' if len(steps) > 8 else ''})"})
    for rank, rows in per_step.items():
        short = [(i, key, k) for i, key, k in rows if k < best[key]]
        if not short:
            continue
        total = sum(best[key] - k for _, key, k in short)
        empty = [i for i, _, k in short if k == 0]
        detail = ", ".join(f"step {i}: {k}/{best[key]}" for i, key, k in short[:6])
        what = (f"{total} kernel(s) missing in {len(short)} of {len(rows)} decode-only steps "
                f"that replay the same graph as complete ones ({detail}"
                f"{', ...' if len(short) > 6 else ''})")
        if empty and empty[-1] == rows[-1][0]:
            tail = sum(1 for _ in takewhile(lambda row: not row[2], reversed(rows)))
            what += f"; the last {tail} step(s) have no kernels (a cut-off tail)"
        out.append({"rank": rank, "what": what})
    return out
