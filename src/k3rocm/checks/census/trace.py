"""Read vLLM worker profiler traces (chrome-trace JSON, plain or gzip) and count launches per step.

Steps are the ``execute_context_<n>(<tok>)_generation_<m>(<tok>)`` annotations. GPU trace: every
kernel counts in the step holding its host launch (same correlation id), else its queue's
``gpu_user_annotation`` span; time = device time. CPU trace: every ``cpu_op``; time = host time.
Each launch keeps the names of the operators it is nested in.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import re
from array import array
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3rocm.checks.census.names import normalize
from k3rocm.checks.census.stream import events
from k3rocm.errors import UsageError, tagged_log

STEP_SIMPLE = re.compile(r"^execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
STEP_DETAILED = re.compile(r"^execute_\d+_context_(\d+)\(sq(\d+)\D.*?_generation_(\d+)\(sq(\d+)\D")
RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)(?:\D|$)")
TRACE_SUFFIXES = (".json", ".json.gz")
RUNTIME_CATS = {"cuda_runtime", "cuda_driver", "hip_runtime", "hip_driver", "runtime"}
# host calls that launch exactly one kernel (not graph launches)
LAUNCH_CALL = re.compile(r"^(hip|cuda)(Ext)?(Module)?LaunchKernel|^(hip|cu)LaunchKernel")
NOT_TRACES = ("k3rocm-decisions-", "provenance.json", "census.json")


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
        """A "generation" step with more tokens than its requests decode: a recomputed
        prompt (prefill)."""
        return self.tokens_per_request is not None and \
            self.gen_tokens > self.gen_reqs * self.tokens_per_request

    @property
    def decode_only(self) -> bool:
        return self.ctx_reqs == 0 and self.gen_reqs > 0 and not self.recompute

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
    count: int = 1  # launches with this name, step and parents (dur is their total)


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
    gpu_evidence: list[str] = field(default_factory=list)  # what says a GPU ran
    lost_launches: dict[int, int] = field(default_factory=dict)  # step -> launches w/o kernel
    started: float | None = None  # absolute start (s since the epoch) of the first step
    started_source: str = ""  # baseTimeNanoseconds + ts | file name | file mtime
    sequence: list[list[str]] = field(default_factory=list)  # GPU: per step, device order

    @property
    def n_launches(self) -> int:
        return sum(ln.count for ln in self.launches)

    def per_step_counts(self) -> list[Counter[str]]:
        out: list[Counter[str]] = [Counter() for _ in self.steps]
        for ln in self.launches:
            out[ln.step][ln.name] += ln.count
        return out

    def kernel_table(self) -> list[dict[str, Any]]:
        agg: dict[str, list[Any]] = {}  # name -> [launches, us, steps]
        for ln in self.launches:
            a = agg.setdefault(ln.name, [0, 0.0, set()])
            a[0] += ln.count
            a[1] += ln.dur
            a[2].add(ln.step)
        n = max(len(self.steps), 1)
        rows = [{"name": k, "launches": c, "per_step": round(c / n, 3), "steps_with": len(st),
                 "total_us": round(us, 3), "mean_us": round(us / c, 3)}
                for k, (c, us, st) in agg.items()]
        rows.sort(key=lambda r: (-r["total_us"], r["name"]))
        return rows

    def summary(self) -> dict[str, Any]:
        return {"path": str(self.path), "rank": self.rank, "mode": self.mode,
                "steps": len(self.steps),
                "decode_steps": sum(1 for s in self.steps if s.decode_only),
                "launches": self.n_launches, "unattributed": self.unattributed,
                "empty_steps_ignored": self.empty_steps, "world_size": self.world_size,
                "rank_source": self.rank_source, "gpu_evidence": self.gpu_evidence,
                "lost_launches": sum(self.lost_launches.values()), "started": self.started,
                "started_source": self.started_source, "meta": self.meta}


def decode_tokens_per_request(steps: list[Step]) -> int | None:
    """Tokens per decode request (1 + speculative): the most common ceil(tokens / requests)
    over steps without context requests."""
    per = Counter(-(-s.gen_tokens // s.gen_reqs) for s in steps
                  if s.ctx_reqs == 0 and s.gen_reqs > 0)
    return max(per.items(), key=lambda kv: (kv[1], kv[0]), default=(None,))[0]


def rank_and_source(path: Path, obj: dict[str, Any]) -> tuple[int | None, str]:
    """``distributedInfo.rank``, else the file name (``rank-<r>``); (None, "")."""
    info = obj.get("distributedInfo")
    if isinstance(info, dict) and isinstance(info.get("rank"), int) \
            and not isinstance(info.get("rank"), bool):
        return int(info["rank"]), "distributedInfo"
    m = RANK_IN_NAME.search(path.name)
    return (int(m.group(1)), "file name") if m else (None, "")


def parse_rank_trace(path: str | os.PathLike, progress: Any = None) -> RankTrace:
    """Stream-parse one worker trace; a malformed event is a one-line UsageError naming the
    file. ``progress(n)`` every million events."""
    path = Path(path)
    header: dict[str, Any] = {}
    col = _Collector()
    try:
        for n, e in enumerate(events(path, header), 1):
            col.add(e)
            if progress is not None and n % 1_000_000 == 0:
                progress(n)
        return col.finish(path, header)
    except UsageError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        why = " ".join(str(exc).split())[:160]
        raise UsageError(f"trace {path} is malformed ({exc.__class__.__name__}: {why}); "
                         "a complete event needs a numeric ts/dur, a string name, integer or "
                         "string pid/tid, args an object with an integer correlation; "
                         "re-collect the trace") from None


def _num(e: dict[str, Any], key: str, default: float | None = None) -> float:
    v = e.get(key, default)
    if v is None:
        v = 0.0
    if v.__class__ is float:
        return v
    if isinstance(v, (int, float, str)) and not isinstance(v, bool):
        with contextlib.suppress(ValueError):
            return float(v)
    raise ValueError(f"event {str(e.get('name'))[:60]!r} has a non-numeric {key} {v!r}")


def _corr(e: dict[str, Any]) -> int:
    c = (e.get("args") or {}).get("correlation")
    if c is None:
        return -1
    if c.__class__ is not int:
        raise ValueError(f"event {str(e.get('name'))[:60]!r} has a non-integer "
                         f"args.correlation {c!r}")
    return c


_SCALAR = (int, str, type(None))


def _where(e: dict[str, Any]) -> tuple[Any, Any]:
    pid, tid = e.get("pid"), e.get("tid")
    for key, v in (("pid", pid), ("tid", tid)):
        if v.__class__ not in _SCALAR:
            raise ValueError(f"event {str(e.get('name'))[:60]!r} has a {key} {v!r} that is "
                             "not an integer or string")
    return pid, tid


class _Collector:
    """What one pass over the events keeps, in flat arrays of interned names: step
    annotations, CPU operators, runtime calls and kernels."""

    def __init__(self) -> None:
        self.names: dict[str, int] = {}  # name -> id (ids in insertion order)
        self.threads: dict[tuple[Any, Any], int] = {}
        self.steps: list[tuple[float, float, str, tuple[int, int, int, int]]] = []
        self.gsteps: list[tuple[Any, Any, float, float, str]] = []
        self.cpu_thr, self.cpu_ts, self.cpu_end = array("l"), array("d"), array("d")
        self.cpu_name = array("l")
        self.rt_thr, self.rt_ts, self.rt_corr = array("l"), array("d"), array("q")
        self.rt_launch = bytearray()
        self.k_name, self.k_ts, self.k_dur = array("l"), array("d"), array("d")
        self.k_corr, self.k_queue = array("q"), array("l")

    def _name(self, name: str) -> int:
        return self.names.setdefault(name, len(self.names))

    def _thread(self, key: tuple[Any, Any]) -> int:
        return self.threads.setdefault(key, len(self.threads))

    def add(self, e: Any) -> None:
        if e.__class__ is not dict or e.get("ph") != "X" or "ts" not in e or "name" not in e:
            return
        args = e.get("args")
        if args is not None and args.__class__ is not dict:
            raise ValueError(f"event {str(e['name'])[:60]!r} has args that are not an object")
        ts = _num(e, "ts")
        dur = _num(e, "dur", 0.0)
        cat = e.get("cat")
        name = e["name"]
        if name.__class__ is not str:
            raise ValueError(f"event with ts {ts} has a name {str(name)[:60]!r} that is not "
                             "a string")
        if cat == "kernel":
            self.k_name.append(self._name(name))
            self.k_ts.append(ts)
            self.k_dur.append(dur)
            self.k_corr.append(_corr(e))
            self.k_queue.append(self._thread(_where(e)))
        elif cat == "cpu_op":
            self.cpu_thr.append(self._thread(_where(e)))
            self.cpu_ts.append(ts)
            self.cpu_end.append(ts + dur)
            self.cpu_name.append(self._name(name))
        elif cat in RUNTIME_CATS:
            self.rt_thr.append(self._thread(_where(e)))
            self.rt_ts.append(ts)
            self.rt_corr.append(_corr(e))
            self.rt_launch.append(1 if LAUNCH_CALL.search(name) else 0)
        elif cat in ("user_annotation", "gpu_user_annotation"):
            m = STEP_SIMPLE.match(name) or STEP_DETAILED.match(name)
            if m is None:
                return
            parsed = tuple(map(int, m.groups()))
            if cat == "user_annotation":
                self.steps.append((ts, dur, name, parsed))
            else:
                self.gsteps.append((*_where(e), ts, dur, name))

    def _parents(self) -> tuple[array, array, list[tuple[int, ...]]]:
        """Per CPU operator and runtime call: the id of its tuple of enclosing operator names
        (outermost first), by one sweep per thread in time order."""
        ids: dict[tuple[int, int], int] = {}  # (parent id, name) -> id
        tuple_list: list[tuple[int, ...]] = [()]
        cpu_par = array("l", bytes(8 * len(self.cpu_ts)))
        rt_par = array("l", bytes(8 * len(self.rt_ts)))
        cthr, cts, cend, cname = self.cpu_thr, self.cpu_ts, self.cpu_end, self.cpu_name
        rthr, rts_ = self.rt_thr, self.rt_ts
        cpu = sorted(range(len(cts)), key=lambda i: (cthr[i], cts[i], cts[i] - cend[i]))
        rts = sorted(range(len(rts_)), key=lambda i: (rthr[i], rts_[i]))
        nr = len(rts)
        j = 0
        stack: list[tuple[float, int]] = []  # (end, id of the tuple up to this operator)
        thread = -1
        for i in cpu:
            th, ts = cthr[i], cts[i]
            if th != thread:
                while j < nr and rthr[rts[j]] < th:  # calls of threads without operators
                    j += 1
                stack, thread = [], th
            while j < nr and rthr[rts[j]] == th and rts_[rts[j]] < ts:
                r = rts[j]
                while stack and rts_[r] >= stack[-1][0]:
                    stack.pop()
                rt_par[r] = stack[-1][1] if stack else 0
                j += 1
            while stack and ts >= stack[-1][0]:
                stack.pop()
            parent = cpu_par[i] = stack[-1][1] if stack else 0
            key = (parent, cname[i])
            tid = ids.get(key)
            if tid is None:
                tid = ids[key] = len(tuple_list)
                tuple_list.append((*tuple_list[parent], cname[i]))
            stack.append((cend[i], tid))
        while j < nr:  # calls after the thread's last operator
            r = rts[j]
            if rthr[r] == thread:
                while stack and rts_[r] >= stack[-1][0]:
                    stack.pop()
                rt_par[r] = stack[-1][1] if stack else 0
            j += 1
        return cpu_par, rt_par, tuple_list

    def finish(self, path: Path, header: dict[str, Any]) -> RankTrace:
        rank, rank_source = rank_and_source(path, header)
        self.steps.sort(key=lambda t: t[0])
        empty = sum(1 for *_, p in self.steps if p[0] == 0 and p[2] == 0)
        # engine steps without a forward (no requests) are ignored
        kept = [t for t in self.steps if not (t[3][0] == 0 and t[3][2] == 0)]
        steps = [Step(i, name, ts, dur, *p) for i, (ts, dur, name, p) in enumerate(kept)]
        per_req = decode_tokens_per_request(steps)
        for st in steps:
            st.tokens_per_request = per_req
        step_at = _span_at([(st.ts, st.ts + st.dur, st.index) for st in steps])
        mode = "gpu" if self.k_ts else "cpu"  # GPU kernels when traced, else CPU operators
        cpu_par, rt_par, par_tuples = self._parents()
        # (name, step, parents) -> [n, us]
        agg: defaultdict[tuple[int, int, int], list[float]] = defaultdict(lambda: [0, 0.0])
        lost: dict[int, int] = {}
        if mode == "cpu":
            for i in range(len(self.cpu_ts)):
                a = agg[(self.cpu_name[i], step_at(self.cpu_ts[i]), cpu_par[i])]
                a[0] += 1
                a[1] += self.cpu_end[i] - self.cpu_ts[i]
        else:
            kcorrs = set(self.k_corr)
            for i, c in enumerate(self.rt_corr):  # a one-kernel launch whose kernel never came
                if c >= 0 and self.rt_launch[i] and c not in kcorrs:
                    si = step_at(self.rt_ts[i])
                    if si >= 0:
                        lost[si] = lost.get(si, 0) + 1
            del kcorrs
            # correlation id -> its first runtime call (fed last to first: the first stays)
            last = len(self.rt_corr) - 1
            rt_of = dict(zip(self.rt_corr[::-1], range(last, -1, -1), strict=True))
            step_of = _device_spans(self.gsteps, steps)
            queue_of = {v: k for k, v in self.threads.items()}
            k_step = array("l", bytes(8 * len(self.k_ts)))
            for k in range(len(self.k_ts)):
                c = self.k_corr[k]
                r = rt_of.get(c, -1) if c >= 0 else -1
                if r >= 0:
                    si, par = step_at(self.rt_ts[r]), rt_par[r]
                else:
                    si, par = step_of(queue_of[self.k_queue[k]], self.k_ts[k]), 0
                k_step[k] = si
                a = agg[(self.k_name[k], si, par)]
                a[0] += 1
                a[1] += self.k_dur[k]
        launches: list[Launch] = []
        outside: list[Launch] = []
        norm_par: dict[int, tuple[str, ...]] = {}
        name_list = list(self.names)
        sequence: list[list[str]] = [[] for _ in steps]
        if mode == "gpu":
            kts, knm = self.k_ts, self.k_name
            for k in sorted(range(len(kts)), key=kts.__getitem__):
                if k_step[k] >= 0:
                    sequence[k_step[k]].append(normalize(name_list[knm[k]]))
            del k_step
        for (nid, si, pid), (n, us) in agg.items():
            par = norm_par.get(pid)
            if par is None:
                par = norm_par[pid] = tuple(normalize(name_list[x]) for x in par_tuples[pid])
            raw = name_list[nid]
            (outside if si < 0 else launches).append(
                Launch(normalize(raw), raw, us, si, par, int(n)))
        evidence = _evidence(header, len(self.rt_ts), len(self.gsteps))
        meta = {k: header.get(k) for k in ("vllm_version", "host_name", "distributedInfo",
                                           "deviceProperties", "schemaVersion")
                if k in header}
        if isinstance(meta.get("deviceProperties"), list):
            meta["deviceProperties"] = [{k: d.get(k) for k in ("id", "name", "totalGlobalMem")}
                                        for d in meta["deviceProperties"]
                                        if isinstance(d, dict)]
        started, started_source = start_time(path, header, steps)
        info = header.get("distributedInfo")
        ws = info.get("world_size") if isinstance(info, dict) else None
        return RankTrace(path, -1 if rank is None else rank, mode, steps, launches,
                         sum(ln.count for ln in outside), meta, outside,
                         ws if type(ws) is int and ws > 0 else None,
                         rank_source, empty, evidence, lost, started, started_source, sequence)


TIME_IN_NAME = re.compile(r"(?<!\d)(\d{10}|\d{13}|\d{16}|\d{19})(?!\d)")


def start_time(path: Path, obj: dict[str, Any], steps: list[Step]) -> tuple[float | None, str]:
    """When the first engine step started (s since the epoch): ``baseTimeNanoseconds`` + ts
    (the base jumps between server starts), else the export time in the file name
    (``tensorboard_trace_handler``: ``<worker>.<time_ns>.pt.trace.json``), else None."""
    base = obj.get("baseTimeNanoseconds")
    first = steps[0].ts if steps else 0.0
    if isinstance(base, int) and not isinstance(base, bool) and base > 0:
        return base / 1e9 + first / 1e6, "baseTimeNanoseconds + ts"
    hits = TIME_IN_NAME.findall(path.name)
    if hits:
        digits = hits[-1]
        return int(digits) / 10 ** (len(digits) - 10), "file name"
    return None, ""


def _device_spans(gsteps: list[tuple[Any, Any, float, float, str]],
                  steps: list[Step]) -> Callable[[tuple[Any, Any], float], int]:
    """``step_of(queue, ts)`` by the ``gpu_user_annotation`` ranges per device queue: the
    n-th span named N on a queue is the n-th host step named N (else -1)."""
    host_by_name: dict[str, list[int]] = defaultdict(list)
    for st in steps:
        host_by_name[st.name].append(st.index)
    per_queue: defaultdict[tuple[Any, Any], list[tuple[float, float, int]]] = defaultdict(list)
    seen: Counter[tuple[tuple[Any, Any], str]] = Counter()
    for pid, tid, ts, dur, name in sorted(gsteps, key=lambda g: g[2:]):  # in time order
        q, hosts = (pid, tid), host_by_name.get(name, [])
        if seen[q, name] < len(hosts):
            per_queue[q].append((ts, ts + dur, hosts[seen[q, name]]))
        seen[q, name] += 1
    at = {q: _span_at(v) for q, v in per_queue.items()}
    return lambda queue, ts: at[queue](ts) if queue in at else -1


def _span_at(spans: list[tuple[float, float, int]]) -> Callable[[float], int]:
    """``at(ts)``: the value of the (start, end, value) span holding ``ts``, else -1."""
    starts = [s[0] for s in spans]

    def at(ts: float) -> int:
        i = bisect.bisect_right(starts, ts + 1e-3) - 1
        return spans[i][2] if i >= 0 and ts <= spans[i][1] + 1e-3 else -1

    return at


def _evidence(header: dict[str, Any], runtime: int, device_annotations: int) -> list[str]:
    """What says a GPU ran, kernels aside: devices, runtime events, device annotations."""
    out = []
    props = header.get("deviceProperties")
    if isinstance(props, list) and props:
        names = sorted({str(d.get("name")) for d in props if isinstance(d, dict)})
        out.append(f"deviceProperties lists {len(props)} device(s) ({', '.join(names)[:60]})")
    if runtime:
        out.append(f"{runtime} HIP/CUDA runtime event(s)")
    if device_annotations:
        out.append(f"{device_annotations} gpu_user_annotation event(s)")
    return out


def find_trace_files(directory: str | os.PathLike) -> list[Path]:
    d = Path(directory)
    if not d.is_dir():
        raise UsageError(f"trace directory {d} does not exist or is not a directory")
    return sorted(p for p in d.rglob("*") if p.is_file() and p.name.endswith(TRACE_SUFFIXES)
                  and not p.name.startswith(NOT_TRACES))


PROGRESS_BYTES = 20_000_000  # files above this size report progress on stderr
RUN_GAP_S = 120.0  # rank traces of one run start within this (one collective /start_profile)


@dataclass
class TraceSet:
    ranks: list[RankTrace]
    ignored: list[dict[str, str]]  # files that are not worker traces
    world_size: int | None = None  # from distributedInfo
    skipped_runs: list[dict[str, Any]] = field(default_factory=list)  # older runs
    run_started: float | None = None


_progress = tagged_log("census")


def iso_time(t: float | None) -> str:
    import datetime as dt

    return "unknown time" if t is None else \
        dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def group_runs(traces: list[RankTrace]) -> list[list[RankTrace]]:
    """Worker traces in runs, oldest first: a trace opens a new run when its rank is already
    in the run, its world size differs, or it started RUN_GAP_S after the run's first."""
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


def load_trace_dir(directory: str | os.PathLike, files: list[Path] | None = None) -> TraceSet:
    """The newest run of worker traces in ``directory`` (older ones in ``skipped_runs``)."""
    files = files if files is not None else find_trace_files(directory)
    if not files:
        raise UsageError(f"no trace files (*.json or *.json.gz) in {directory}; did the server "
                         "run with --profiler-config / K3_PROFILER_DIR and was /stop_profile "
                         "called?")
    workers: list[RankTrace] = []
    ignored: list[dict[str, str]] = []
    rankless: list[str] = []
    for f in files:
        big = f.stat().st_size > PROGRESS_BYTES
        if big:
            _progress(f"parsing {f.name} ({f.stat().st_size / 1e6:.0f} MB)")
        rt = parse_rank_trace(f, progress=(lambda n, f=f: _progress(
            f"{f.name}: {n / 1e6:.0f} M events")) if big else None)
        has_rank = bool(rt.rank_source)
        if not rt.steps:
            why = (f"only engine steps without a forward ({rt.empty_steps})" if rt.empty_steps
                   else "no engine-step annotations" + ("" if has_rank else " (front-end trace)"))
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
    skipped = [{"started": iso_time(run[0].started), "ranks": sorted(t.rank for t in run),
                "world_size": run[0].world_size, "files": [str(t.path) for t in run],
                "how": f"start from {run[0].started_source}",
                "why": f"an older run (the judged run started {iso_time(started)})"}
               for run in runs[:-1]]
    sizes = {t.world_size for t in newest if t.world_size is not None}
    return TraceSet(newest, ignored, sizes.pop() if sizes else None, skipped, started)
