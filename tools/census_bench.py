"""Benchmark of the census trace parser (``make census-bench``; not a test).

Writes a gzip worker trace of N million events with the structure
tests/data/census/make_traces.py uses (per engine step a ``user_annotation``; per kernel launch
a ``cpu_op``, a ``hipLaunchKernel`` runtime event and a ``kernel`` event linked by correlation
id; Kimi-K3's 93 layers, 24 MLA, fusions on), then parses it in a fresh process per size and
prints seconds and peak memory (resident set growth over the process after imports) per million
events.

    python tools/census_bench.py [--sizes 1,3,10] [--dir /tmp/k3rocm-census-bench]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "census"


def write_trace(path: Path, n_events: int) -> int:
    """Stream a trace of about ``n_events`` events to ``path``; returns the exact count."""
    import runpy

    mt = runpy.run_path(str(DATA / "make_traces.py"))
    cfg = json.loads((DATA / "models" / "kimi-k3" / "config.json").read_text())
    kda = set(cfg["text_config"]["linear_attn_config"]["kda_layers"])
    mla = [i for i in range(93) if (i + 1) not in kda]
    ks = mt["_step_kernels"](mla, 93, True, "on", "on", "per_head")
    pid = tid = 4000
    n = 0
    t = 10_000.0
    gpu_t = t
    corr = 0
    step = 0
    dumps = json.JSONEncoder(separators=(",", ":")).encode
    with gzip.open(path, "wt", compresslevel=1) as fh:
        fh.write('{"schemaVersion":1,"deviceProperties":[{"id":0,"name":"AMD Instinct '
                 'MI355X"}],"distributedInfo":{"backend":"nccl","rank":0,"world_size":1},'
                 '"traceEvents":[')
        first = True
        while n < n_events:
            start = t
            for kname, kdur, op in ks:
                corr += 1
                evs = ({"ph": "X", "cat": "cpu_op", "name": op.split(">")[0], "pid": pid,
                        "tid": tid, "ts": round(t, 3), "dur": 6.0},
                       {"ph": "X", "cat": "cuda_runtime", "name": "hipLaunchKernel",
                        "pid": pid, "tid": tid, "ts": round(t + 1, 3), "dur": 4.0,
                        "args": {"correlation": corr}},
                       {"ph": "X", "cat": "kernel", "name": kname, "pid": 0, "tid": 7,
                        "ts": round(max(gpu_t, t + 5), 3), "dur": kdur,
                        "args": {"correlation": corr, "device": 0, "stream": 7}})
                for e in evs:
                    fh.write(("" if first else ",") + dumps(e))
                    first = False
                gpu_t = max(gpu_t, t + 5) + kdur + 0.5
                t += 7.0
                n += 3
            fh.write("," + dumps({"ph": "X", "cat": "user_annotation", "pid": pid, "tid": tid,
                                  "name": f"execute_context_0(0)_generation_8({24})",
                                  "ts": round(start - 1, 3), "dur": round(t - start + 2, 3)}))
            n += 1
            step += 1
            t += 50.0
        fh.write('],"baseTimeNanoseconds":1764700000000000000}')
    return n


def measure(path: Path) -> None:
    """Child: parse once, print seconds and peak RSS growth (bytes)."""
    from k3rocm.checks.census.trace import load_trace_dir  # noqa: F401 (imports counted out)

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    ts = load_trace_dir(path.parent, files=[path])
    secs = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": secs, "peak_bytes": peak - base,
                      "steps": len(ts.ranks[0].steps)}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,3,10", help="millions of events, comma-separated")
    ap.add_argument("--dir", default="/tmp/k3rocm-census-bench", help="where traces go")
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.measure:
        measure(Path(a.measure))
        return 0
    out = Path(a.dir)
    print(f"[bench] load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPU(s)"
          " (times scale with it)", flush=True)
    print(f"{'events':>12} {'file MB':>8} {'s':>8} {'peak MB':>8} {'s per M':>8} "
          f"{'MB per M':>9}   (s per M events = us/event; MB per M = B/event)")
    for m in (float(x) for x in a.sizes.split(",")):
        d = out / f"{m:g}M"
        d.mkdir(parents=True, exist_ok=True)
        f = d / "bench-rank-0.1764700000.pt.trace.json.gz"
        meta = d / "events.txt"
        if not f.exists() or not meta.exists():
            print(f"[bench] writing {m:g}M events to {f}", file=sys.stderr, flush=True)
            meta.write_text(str(write_trace(f, int(m * 1e6))))
        n = int(meta.read_text())
        p = subprocess.run([sys.executable, __file__, "--measure", str(f)], capture_output=True,
                           text=True, check=True)
        r = json.loads(p.stdout.strip().splitlines()[-1])
        print(f"{n:>12} {f.stat().st_size / 1e6:>8.1f} {r['seconds']:>8.2f} "
              f"{r['peak_bytes'] / 1e6:>8.1f} {r['seconds'] / n * 1e6:>8.2f} "
              f"{r['peak_bytes'] / n:>9.0f}", flush=True)
    print(f"[bench] load average at end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
