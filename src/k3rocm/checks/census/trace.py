"""Read vLLM worker profiler traces (chrome-trace JSON, plain or gzip) and count launches per step.

One worker trace per rank. Engine steps are ``user_annotation`` events named
``execute_context_<n>(<ctx tokens>)_generation_<m>(<gen tokens>)`` (or the detailed form
``execute_<T>_context_<n>(sq<ctx tokens>...)_generation_<m>(sq<gen tokens>...)``); a step with no
context requests is decode-only.

What is counted per step:
- GPU build (the trace has ``kernel`` events): every device kernel, attributed to the step whose
  time range contains the host-side launch it is linked to by its correlation id (the kernel
  itself may run after the annotation closed); kernels without a launch record fall back to a
  ``gpu_user_annotation`` step range on the device timeline. Time = device duration.
- CPU build (no ``kernel`` events, e.g. the CPU stand-in): every ``cpu_op`` inside the step's
  range. Time = host duration of the operator (inclusive of its children).
Each counted launch keeps the names of the operators it is nested in (for a launch: the
operators around its host-side launch call), so a rule can say "an rsqrt that is not inside the
fused op".
"""

from __future__ import annotations

import bisect
import gzip
import json
import os
import re
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3rocm.checks.census.names import Normalizer
from k3rocm.errors import UsageError

STEP_SIMPLE = re.compile(r"^execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
STEP_DETAILED = re.compile(r"^execute_\d+_context_(\d+)\(sq(\d+)\D.*?_generation_(\d+)\(sq(\d+)\D")
RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)(?:\D|$)")
TRACE_SUFFIXES = (".json", ".json.gz")
RUNTIME_CATS = {"cuda_runtime", "cuda_driver", "hip_runtime", "hip_driver", "runtime"}
KERNEL_CATS = {"kernel"}
# host calls that launch exactly one kernel (graph launches replay many: not counted)
LAUNCH_CALL = re.compile(r"^(hip|cuda)(Ext)?(Module)?LaunchKernel|^(hip|cu)LaunchKernel")
# JSON files that live beside the traces but are not traces (overlay decision records,
# run provenance)
NOT_TRACES = ("k3rocm-decisions-pid", "provenance.json", "census.json")


@dataclass
class Step:
    index: int
    name: str
    ts: float
    dur: float
    ctx_reqs: int
    ctx_tokens: int
    gen_reqs: int
    gen_tokens: int
    tokens_per_request: int | None = None  # a decode request's tokens (1 + speculative)

    @property
    def recompute(self) -> bool:
        """A "generation" step with more tokens than its requests can decode: a preempted
        request recomputing its prompt (vLLM labels it generation), i.e. a prefill."""
        return self.tokens_per_request is not None and \
            self.gen_tokens > self.gen_reqs * self.tokens_per_request

    @property
    def decode_only(self) -> bool:
        """No request with context tokens, and no more tokens than requests x (1 +
        speculative tokens)."""
        return self.ctx_reqs == 0 and self.gen_reqs > 0 and not self.recompute

    @property
    def empty(self) -> bool:
        """``execute_context_0(0)_generation_0(0)``: an engine step without a forward."""
        return self.ctx_reqs == 0 and self.gen_reqs == 0

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "name": self.name, "decode_only": self.decode_only,
                "ctx_reqs": self.ctx_reqs, "ctx_tokens": self.ctx_tokens,
                "gen_reqs": self.gen_reqs, "gen_tokens": self.gen_tokens,
                "tokens_per_request": self.tokens_per_request, "recompute": self.recompute,
                "dur_us": round(self.dur, 3)}


@dataclass
class Launch:
    name: str  # normalized
    raw: str
    dur: float  # microseconds (device time for kernels, host time for CPU operators)
    step: int
    parents: tuple[str, ...] = ()  # normalized names of enclosing operators (outermost first)


@dataclass
class RankTrace:
    path: Path
    rank: int
    mode: str  # "gpu" | "cpu"
    steps: list[Step]
    launches: list[Launch]
    unattributed: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    outside: list[Launch] = field(default_factory=list)  # launches in no engine step (step -1)
    world_size: int | None = None  # from distributedInfo
    rank_source: str = ""
    empty_steps: int = 0  # engine steps without a forward, ignored
    gpu_evidence: list[str] = field(default_factory=list)  # what says a GPU ran (see below)
    lost_launches: dict[int, int] = field(default_factory=dict)  # step -> launches w/o kernel
    started: float | None = None  # absolute start (s since the epoch) of the first step
    started_source: str = ""  # baseTimeNanoseconds + ts | file name | file mtime

    # -- aggregates ----------------------------------------------------------------------
    def per_step_counts(self) -> list[Counter[str]]:
        out: list[Counter[str]] = [Counter() for _ in self.steps]
        for ln in self.launches:
            out[ln.step][ln.name] += 1
        return out

    def kernel_table(self) -> list[dict[str, Any]]:
        """Per normalized name: launches, launches per step, total and mean time (us)."""
        cnt: Counter[str] = Counter()
        tot: dict[str, float] = defaultdict(float)
        steps_seen: dict[str, set[int]] = defaultdict(set)
        for ln in self.launches:
            cnt[ln.name] += 1
            tot[ln.name] += ln.dur
            steps_seen[ln.name].add(ln.step)
        n = max(len(self.steps), 1)
        rows = [{"name": k, "launches": c, "per_step": round(c / n, 3),
                 "steps_with": len(steps_seen[k]), "total_us": round(tot[k], 3),
                 "mean_us": round(tot[k] / c, 3)} for k, c in cnt.items()]
        rows.sort(key=lambda r: (-r["total_us"], r["name"]))
        return rows

    def summary(self) -> dict[str, Any]:
        return {"path": str(self.path), "rank": self.rank, "mode": self.mode,
                "steps": len(self.steps),
                "decode_steps": sum(1 for s in self.steps if s.decode_only),
                "launches": len(self.launches), "unattributed": self.unattributed,
                "empty_steps_ignored": self.empty_steps, "world_size": self.world_size,
                "rank_source": self.rank_source, "gpu_evidence": self.gpu_evidence,
                "lost_launches": sum(self.lost_launches.values()), "started": self.started,
                "started_source": self.started_source, "meta": self.meta}


# -- loading ----------------------------------------------------------------------------------

def load_json(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            head = fh.read(2)
            fh.seek(0)
            data = gzip.GzipFile(fileobj=fh).read() if head == b"\x1f\x8b" else fh.read()
        obj = json.loads(data)
    except (OSError, EOFError, gzip.BadGzipFile, zlib.error, ValueError) as exc:
        why = " ".join(str(exc).split())[:160]
        raise UsageError(f"trace {path} cannot be read as chrome-trace JSON "
                         f"({exc.__class__.__name__}: {why}); expected a .pt.trace.json or "
                         ".pt.trace.json.gz file; re-collect it") from None
    if isinstance(obj, list):
        obj = {"traceEvents": obj}
    if not isinstance(obj, dict) or not isinstance(obj.get("traceEvents"), list):
        raise UsageError(f"trace {path} has no traceEvents list; not a chrome trace")
    return obj


def parse_step_name(name: str) -> tuple[int, int, int, int] | None:
    m = STEP_SIMPLE.match(name) or STEP_DETAILED.match(name)
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4))


def decode_tokens_per_request(steps: list[Step]) -> int | None:
    """Tokens a decode request carries in this trace (1, or 1 + k with k speculative tokens):
    the most common ceil(tokens / requests) over the steps without context requests (ties:
    the larger). None without such steps."""
    per = Counter(-(-s.gen_tokens // s.gen_reqs) for s in steps
                  if s.ctx_reqs == 0 and s.gen_reqs > 0)
    if not per:
        return None
    return max(per.items(), key=lambda kv: (kv[1], kv[0]))[0]


def rank_of(path: Path, obj: dict[str, Any]) -> int | None:
    return rank_and_source(path, obj)[0]


def rank_and_source(path: Path, obj: dict[str, Any]) -> tuple[int | None, str]:
    """The trace's rank: ``distributedInfo.rank`` (torch profiler metadata), else the file
    name (``rank-<r>`` / ``..._rank<r>.``); (None, "") when neither tells."""
    info = obj.get("distributedInfo")
    if isinstance(info, dict) and isinstance(info.get("rank"), int) \
            and not isinstance(info.get("rank"), bool):
        return int(info["rank"]), "distributedInfo"
    m = RANK_IN_NAME.search(path.name)
    return (int(m.group(1)), "file name") if m else (None, "")


def world_size_of(obj: dict[str, Any]) -> int | None:
    info = obj.get("distributedInfo")
    ws = info.get("world_size") if isinstance(info, dict) else None
    return ws if isinstance(ws, int) and not isinstance(ws, bool) and ws > 0 else None


def _nest(events: list[dict[str, Any]]) -> dict[int, tuple[str, ...]]:
    """For events on one thread, map id(event) -> names of enclosing cpu_ops (outermost first)."""
    out: dict[int, tuple[str, ...]] = {}
    stack: list[tuple[float, str]] = []  # (end, name)
    for e in sorted(events, key=lambda e: (e["ts"], -e.get("dur", 0.0))):
        ts = e["ts"]
        end = ts + e.get("dur", 0.0)
        while stack and ts >= stack[-1][0]:
            stack.pop()
        out[id(e)] = tuple(n for _, n in stack)
        if e.get("cat") == "cpu_op":
            stack.append((end, e["name"]))
    return out


def parse_rank_trace(path: str | os.PathLike, normalize: Normalizer | None = None,
                     mode: str = "auto", obj: dict[str, Any] | None = None) -> RankTrace:
    """Parse one worker trace; any malformed event is a one-line UsageError naming the file."""
    path = Path(path)
    obj = obj if obj is not None else load_json(path)
    try:
        return _parse_rank_trace(path, normalize or Normalizer(), mode, obj)
    except UsageError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        why = " ".join(str(exc).split())[:120]
        raise UsageError(f"trace {path} is malformed ({exc.__class__.__name__}: {why}); "
                         "every complete event needs a numeric ts/dur and a name; re-collect "
                         "the trace") from None


def _num(e: dict[str, Any], key: str, default: float | None = None) -> float:
    v = e.get(key, default)
    if v is None:
        v = 0.0
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ValueError(f"event {str(e.get('name'))[:60]!r} has a non-numeric {key} {v!r}")
    try:
        return float(v)
    except ValueError:
        raise ValueError(f"event {str(e.get('name'))[:60]!r} has a non-numeric {key} "
                         f"{v!r}") from None


def _parse_rank_trace(path: Path, normalize: Normalizer, mode: str,
                      obj: dict[str, Any]) -> RankTrace:
    events = [e for e in obj["traceEvents"]
              if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e and "name" in e]
    for e in events:
        e["ts"] = _num(e, "ts")
        e["dur"] = _num(e, "dur", 0.0)
        if not isinstance(e.get("args", {}), dict):
            raise ValueError(f"event {str(e['name'])[:60]!r} has args that are not an object")
    rank, rank_source = rank_and_source(path, obj)
    if rank is None:
        rank = -1

    step_evs = []
    gpu_step_evs = []
    for e in events:
        parsed = parse_step_name(str(e["name"]))
        if parsed is None:
            continue
        if e.get("cat") == "user_annotation":
            step_evs.append((e, parsed))
        elif e.get("cat") == "gpu_user_annotation":
            gpu_step_evs.append((e, parsed))
    step_evs.sort(key=lambda t: t[0]["ts"])
    empty = sum(1 for _, p in step_evs if p[0] == 0 and p[2] == 0)
    # engine steps without a forward (no requests) are ignored, neither decode nor prefill;
    # their device-side ranges are dropped the same way
    step_evs = [(e, p) for e, p in step_evs if not (p[0] == 0 and p[2] == 0)]
    gpu_step_evs = [(e, p) for e, p in gpu_step_evs if not (p[0] == 0 and p[2] == 0)]
    steps = [Step(i, str(e["name"]), e["ts"], e["dur"], *p) for i, (e, p) in enumerate(step_evs)]
    per_req = decode_tokens_per_request(steps)
    for s in steps:
        s.tokens_per_request = per_req
    starts = [s.ts for s in steps]

    def step_at(ts: float) -> int | None:
        i = bisect.bisect_right(starts, ts + 1e-3) - 1
        if i >= 0 and ts <= steps[i].ts + steps[i].dur + 1e-3:
            return i
        return None

    kernels = [e for e in events if e.get("cat") in KERNEL_CATS]
    evidence = gpu_evidence(obj, events)
    if mode == "auto":
        mode = "gpu" if kernels else "cpu"
    if mode not in ("gpu", "cpu"):
        raise UsageError(f"trace mode {mode!r} is not valid; use auto, gpu or cpu")

    by_thread: dict[tuple[Any, Any], list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op" or e.get("cat") in RUNTIME_CATS:
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    parents: dict[int, tuple[str, ...]] = {}
    for evs in by_thread.values():
        parents.update(_nest(evs))

    launches: list[Launch] = []
    outside: list[Launch] = []
    unattributed = 0
    lost: dict[int, int] = {}
    if mode == "cpu":
        for e in events:
            if e.get("cat") != "cpu_op":
                continue
            si = step_at(e["ts"])
            raw = str(e["name"])
            ln = Launch(normalize(raw), raw, e["dur"], -1 if si is None else si,
                        tuple(normalize(p) for p in parents.get(id(e), ())))
            if si is None:
                unattributed += 1
                outside.append(ln)
                continue
            launches.append(ln)
    else:
        by_corr: dict[Any, dict[str, Any]] = {}
        for e in events:
            if e.get("cat") in RUNTIME_CATS:
                corr = (e.get("args") or {}).get("correlation")
                if corr is not None:
                    by_corr[corr] = e
        kernel_corrs = {(k.get("args") or {}).get("correlation") for k in kernels}
        for corr, e in by_corr.items():  # a launch whose kernel record never arrived
            if LAUNCH_CALL.search(str(e["name"])) and corr not in kernel_corrs:
                si = step_at(e["ts"])
                if si is not None:
                    lost[si] = lost.get(si, 0) + 1
        spans = _device_spans(gpu_step_evs, steps)
        for k in kernels:
            corr = (k.get("args") or {}).get("correlation")
            launch = by_corr.get(corr) if corr is not None else None
            si = step_at(launch["ts"]) if launch is not None else None
            if si is None and launch is None:
                si = spans.step_of(k)
            raw = str(k["name"])
            par = parents.get(id(launch), ()) if launch is not None else ()
            ln = Launch(normalize(raw), raw, k["dur"], -1 if si is None else si,
                        tuple(normalize(p) for p in par))
            if si is None:
                unattributed += 1
                outside.append(ln)
                continue
            launches.append(ln)
    meta = {k: obj.get(k) for k in ("vllm_version", "host_name", "distributedInfo",
                                    "deviceProperties", "schemaVersion") if k in obj}
    if "deviceProperties" in meta and isinstance(meta["deviceProperties"], list):
        meta["deviceProperties"] = [{k: d.get(k) for k in ("id", "name", "totalGlobalMem")}
                                    for d in meta["deviceProperties"] if isinstance(d, dict)]
    started, started_source = start_time(path, obj, steps)
    return RankTrace(path, rank, mode, steps, launches, unattributed, meta, outside,
                     world_size_of(obj), rank_source, empty, evidence, lost, started,
                     started_source)


TIME_IN_NAME = re.compile(r"(?<!\d)(\d{10}|\d{13}|\d{16}|\d{19})(?!\d)")


def start_time(path: Path, obj: dict[str, Any], steps: list[Step]) -> tuple[float | None, str]:
    """When the trace's first engine step started, in seconds since the epoch.

    kineto and torch write event ``ts`` in microseconds relative to ``baseTimeNanoseconds``
    (torch/profiler/_chrome_trace_export.py; kineto output_json.cpp), and that base moves in
    jumps, so only ``base + ts`` orders traces from different server starts. Without it: the
    export time torch puts in the file name (``tensorboard_trace_handler``:
    ``<worker_name>.<time.time_ns()>.pt.trace.json[.gz]``; digits read as s/ms/us/ns by their
    count); else None (the caller falls back to the file's mtime)."""
    base = obj.get("baseTimeNanoseconds")
    first = steps[0].ts if steps else 0.0
    if isinstance(base, int) and not isinstance(base, bool) and base > 0:
        return base / 1e9 + first / 1e6, "baseTimeNanoseconds + ts"
    hits = TIME_IN_NAME.findall(path.name)
    if hits:
        digits = hits[-1]
        return int(digits) / 10 ** (len(digits) - 10), "file name"
    return None, ""


class _DeviceSpans:
    """Device-side step ranges (``gpu_user_annotation``: kineto writes one per device queue
    for each host annotation, with the same name), per (pid, tid) = (device, queue). The n-th
    span named N on a queue is the n-th host step named N; a kernel without a launch record
    belongs to the span of its own queue that contains it."""

    def __init__(self, per_queue: dict[tuple[Any, Any], list[tuple[float, float, int]]]):
        self.per_queue = per_queue
        self.starts = {q: [s[0] for s in v] for q, v in per_queue.items()}

    def step_of(self, k: dict[str, Any]) -> int | None:
        q = (k.get("pid"), k.get("tid"))
        spans = self.per_queue.get(q)
        if not spans:
            return None
        j = bisect.bisect_right(self.starts[q], k["ts"] + 1e-3) - 1
        if j >= 0 and k["ts"] <= spans[j][1] + 1e-3:
            return spans[j][2]
        return None


def _device_spans(gpu_step_evs: list[tuple[dict[str, Any], Any]],
                  steps: list[Step]) -> _DeviceSpans:
    host_by_name: dict[str, list[int]] = defaultdict(list)
    for s in steps:
        host_by_name[s.name].append(s.index)
    queues: dict[tuple[Any, Any], list[dict[str, Any]]] = defaultdict(list)
    for e, _ in gpu_step_evs:
        queues[(e.get("pid"), e.get("tid"))].append(e)
    per_queue: dict[tuple[Any, Any], list[tuple[float, float, int]]] = {}
    for q, evs in queues.items():
        seen: Counter[str] = Counter()
        out = []
        for e in sorted(evs, key=lambda e: e["ts"]):
            name = str(e["name"])
            hosts = host_by_name.get(name, [])
            if seen[name] < len(hosts):
                out.append((e["ts"], e["ts"] + e["dur"], hosts[seen[name]]))
            seen[name] += 1
        per_queue[q] = out
    return _DeviceSpans(per_queue)


def gpu_evidence(obj: dict[str, Any], events: list[dict[str, Any]]) -> list[str]:
    """What in a trace says a GPU ran, kernels aside: devices in ``deviceProperties`` (torch
    writes the CUDA/HIP devices there), HIP/CUDA runtime events, device-side annotations."""
    out = []
    props = obj.get("deviceProperties")
    if isinstance(props, list) and props:
        names = sorted({str(d.get("name")) for d in props if isinstance(d, dict)})
        out.append(f"deviceProperties lists {len(props)} device(s) ({', '.join(names)[:60]})")
    runtime = sum(1 for e in events if e.get("cat") in RUNTIME_CATS)
    if runtime:
        out.append(f"{runtime} HIP/CUDA runtime event(s)")
    dev_ann = sum(1 for e in events if e.get("cat") == "gpu_user_annotation")
    if dev_ann:
        out.append(f"{dev_ann} gpu_user_annotation event(s)")
    return out


# -- a directory of traces ----------------------------------------------------------------------

def find_trace_files(directory: str | os.PathLike) -> list[Path]:
    d = Path(directory)
    if not d.is_dir():
        raise UsageError(f"trace directory {d} does not exist or is not a directory")
    return sorted(p for p in d.rglob("*") if p.is_file() and p.name.endswith(TRACE_SUFFIXES)
                  and not p.name.startswith(NOT_TRACES))


RUN_GAP_S = 120.0  # rank traces of one run start within this (one collective /start_profile)


@dataclass
class TraceSet:
    ranks: list[RankTrace]
    ignored: list[dict[str, str]]  # files that are not worker traces (front-end, empty, dupes)
    world_size: int | None = None  # from the traces' distributedInfo (None: not recorded)
    skipped_runs: list[dict[str, Any]] = field(default_factory=list)  # older runs, not judged
    run_started: float | None = None  # the judged run's start (s since the epoch)


def iso_time(t: float | None) -> str:
    import datetime as dt

    if t is None:
        return "unknown time"
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def group_runs(traces: list[RankTrace]) -> list[list[RankTrace]]:
    """Split worker traces into runs, oldest first: sorted by absolute start time, a trace opens
    a new run when its rank is already in the current run, its world size differs, or it
    started more than RUN_GAP_S after the run's first trace."""
    runs: list[list[RankTrace]] = []
    for t in sorted(traces, key=lambda t: (t.started or 0.0, t.rank)):
        cur = runs[-1] if runs else None
        if cur is None or t.rank in {x.rank for x in cur} \
                or (t.world_size or 0) != (cur[0].world_size or 0) \
                or (t.started or 0.0) - (cur[0].started or 0.0) > RUN_GAP_S:
            runs.append([t])
        else:
            cur.append(t)
    return runs


def load_trace_dir(directory: str | os.PathLike, normalize: Normalizer | None = None,
                   mode: str = "auto", files: list[Path] | None = None) -> TraceSet:
    """Parse the worker traces in ``directory``, group them into runs and keep the newest run
    (older runs are listed in ``skipped_runs``; a rank missing from the newest run is never
    taken from an older one)."""
    files = files if files is not None else find_trace_files(directory)
    if not files:
        raise UsageError(f"no trace files (*.json or *.json.gz) in {directory}; did the server "
                         "run with --profiler-config / K3_PROFILER_DIR and was /stop_profile "
                         "called?")
    workers: list[RankTrace] = []
    ignored: list[dict[str, str]] = []
    rankless: list[str] = []
    for f in files:
        obj = load_json(f)
        has_rank = rank_of(f, obj) is not None
        rt = parse_rank_trace(f, normalize, mode, obj)
        del obj
        if not rt.steps:
            why = ("no engine-step annotations (front-end trace)" if not has_rank
                   else "no engine-step annotations")
            if rt.empty_steps:
                why = f"only engine steps without a forward ({rt.empty_steps})"
            ignored.append({"path": str(f), "why": why})
            continue
        if not has_rank:
            rankless.append(f.name)
            continue
        if rt.started is None:
            rt.started, rt.started_source = f.stat().st_mtime, "file mtime"
        workers.append(rt)
    if rankless:
        raise UsageError(f"cannot tell the rank of {len(rankless)} worker trace(s) "
                         f"({', '.join(rankless[:4])}): no distributedInfo.rank and no rank in "
                         "the file name; they are not merged. Keep the profiler's file names "
                         "(<ts>-rank-<r>...) or its metadata")
    if not workers:
        raise UsageError(f"no worker trace with engine steps in {directory} "
                         f"({len(files)} file(s) looked at: {', '.join(p.name for p in files)})")
    runs = group_runs(workers)
    newest = sorted(runs[-1], key=lambda t: t.rank)
    started = runs[-1][0].started
    skipped = []
    for run in runs[:-1]:
        skipped.append({"started": iso_time(run[0].started), "ranks": sorted(t.rank for t in run),
                        "world_size": run[0].world_size,
                        "files": [str(t.path) for t in run],
                        "how": f"start from {run[0].started_source}",
                        "why": f"an older run (the judged run started {iso_time(started)})"})
    sizes = {t.world_size for t in newest if t.world_size is not None}
    return TraceSet(newest, ignored, sizes.pop() if sizes else None, skipped, started)
