"""Read aiperf's artifacts into one summary per sweep point, check it against the per-request
records, and render perf.csv (ROCm/MAD columns) and markdown tables.

Where the numbers come from (aiperf 0.13.0, one directory per sweep point
``concurrency_<c>__requests_<n>/``, or the artifact dir itself for a single point):

* latency statistics: ``profile_export_aiperf.json`` (aiperf's own aggregate), cross-checked
  against a recomputation from ``profile_export.jsonl`` (profiling-phase records without error;
  percentiles by linear interpolation, as aiperf and numpy compute them);
* throughput: total output tokens / the profiling phase's duration from ``phase_manifest.json``.

Metric meanings: ``itl`` is aiperf's ``inter_token_latency`` = per request
(latency - TTFT) / (output tokens - 1), i.e. vLLM bench's TPOT; ``icl`` is aiperf's
``inter_chunk_latency`` (every gap between streamed chunks pooled), i.e. vLLM bench's ITL.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

# our name -> (aiperf tag, label, unit)
LATENCY_METRICS: dict[str, tuple[str, str, str]] = {
    "ttft": ("time_to_first_token", "TTFT", "ms"),
    "itl": ("inter_token_latency", "ITL (TPOT)", "ms"),
    "e2el": ("request_latency", "E2E latency", "ms"),
    "icl": ("inter_chunk_latency", "inter-chunk latency", "ms"),
    "tps_user": ("output_token_throughput_per_user", "tokens/s per user", "tokens/s/user"),
}
STATS = ("avg", "p50", "p90", "p99")
MAD_COLUMNS = ["model", "benchmark", "tp", "inp", "out", "num_prompts", "max_concurrency", "cmd",
               "performance", "metric", "unit"]
_POINT_RE = re.compile(r"^concurrency_(\d+)__requests_(\d+)$")


def stat_of(values: Sequence[float], stat: str) -> float:
    """avg, or pXX by linear interpolation (numpy's default, aiperf's method); nan for none."""
    if not values:
        return math.nan
    if stat == "avg":
        return sum(values) / len(values)
    import numpy as np  # on first use: the CLI imports this module

    return float(np.percentile(values, float(stat.removeprefix("p"))))  # p50 -> 50


# --- per-request records


def read_records(point_dir: Path) -> list[dict]:
    out = []
    try:
        lines = (point_dir / "profile_export.jsonl").read_text().splitlines()
    except OSError:
        return []
    for line in filter(str.strip, lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a record cut short by an interrupt
    return out


def profiling_records(records: Iterable[dict]) -> tuple[list[dict], list[dict]]:
    """(successful, failed) records of the profiling phase."""
    ok, bad = [], []
    for r in records:
        md = r.get("metadata") or {}
        if md.get("benchmark_phase", md.get("phase_kind")) != "profiling":
            continue
        (bad if r.get("error") else ok).append(r)
    return ok, bad


def _value(record: dict, tag: str) -> Any:
    """One record's value of a metric (None when it has none)."""
    m = (record.get("metrics") or {}).get(tag)
    return m.get("value") if isinstance(m, dict) else None


def request_values(records: Iterable[dict], tag: str) -> list[float]:
    """Per-request values of a metric (lists, e.g. inter_chunk_latency, are pooled)."""
    out: list[float] = []
    for r in records:
        v = _value(r, tag)
        if isinstance(v, list):
            out.extend(float(x) for x in v)
        elif isinstance(v, (int, float)):
            out.append(float(v))
    return out


def profiling_window(point_dir: Path) -> tuple[int, int] | None:
    """(start, end) of the point's profiling phase, wall-clock ns (aiperf's time.time_ns), from
    ``phase_manifest.json``; None without one."""
    try:
        phases = json.loads((point_dir / "phase_manifest.json").read_text()).get("phases", [])
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return next(((ph["start_ns"], ph["end_ns"]) for ph in phases
                 if ph.get("phase_kind") == "profiling" and ph.get("end_ns")
                 and ph.get("start_ns")), None)


def recompute_from_records(point_dir: Path) -> dict[str, Any]:
    """Every summary number, recomputed from profile_export.jsonl (+ the phase duration)."""
    ok, bad = profiling_records(read_records(point_dir))
    out: dict[str, Any] = {"requests_ok": len(ok), "requests_failed": len(bad), "metrics": {
        key: {s: stat_of(vals, s) for s in STATS} for key, (tag, _, _) in LATENCY_METRICS.items()
        if (vals := request_values(ok, tag))}}
    window = profiling_window(point_dir)
    dur = (window[1] - window[0]) / 1e9 if window else None
    osl = sum(request_values(ok, "output_sequence_length"))
    isl = sum(request_values(ok, "input_sequence_length"))
    out.update(duration_s=dur, output_tps=osl / dur if dur else None,
               total_tps=(osl + isl) / dur if dur else None,
               request_tps=len(ok) / dur if dur else None)
    return out


# --- sweep points


def _agg(d: dict, tag: str, stat: str) -> float | None:
    v = (d.get(tag) or {}).get(stat)
    return float(v) if isinstance(v, (int, float)) else None


# summary key -> aiperf tag whose average it is
_POINT_AVGS = {"output_tps": "output_token_throughput", "total_tps": "total_token_throughput",
               "request_tps": "request_throughput", "duration_s": "benchmark_duration",
               "isl_avg": "input_sequence_length", "osl_avg": "output_sequence_length",
               "osl_mismatch_count": "osl_mismatch_count"}


def summarize_point(point_dir: Path | None, concurrency: int, request_count: int,
                    rel_tol: float = 1e-6) -> dict[str, Any]:
    """One sweep point: status ok/failed (with the reason), metrics, and the jsonl check."""
    point: dict[str, Any] = {"concurrency": concurrency, "request_count": request_count,
                             "status": "failed", "reason": None,
                             "dir": str(point_dir) if point_dir else None}
    if point_dir is None or not point_dir.is_dir():
        point["reason"] = "not run (aiperf stopped before this point)"
        return point
    agg_path = point_dir / "profile_export_aiperf.json"
    rec = recompute_from_records(point_dir)
    point.update(requests_ok=rec["requests_ok"], requests_failed=rec["requests_failed"])
    if not agg_path.is_file():
        point["reason"] = (f"incomplete: aiperf wrote no summary ({rec['requests_ok']} of "
                           f"{request_count} requests finished)")
        point["partial"] = rec
        return point
    try:
        agg = json.loads(agg_path.read_text())
    except json.JSONDecodeError as exc:
        point["reason"] = f"unreadable {agg_path.name}: {exc}"
        return point
    point["metrics"] = {key: {s: _agg(agg, tag, s) for s in STATS}
                        for key, (tag, _, _) in LATENCY_METRICS.items() if tag in agg}
    point.update({key: _agg(agg, tag, "avg") for key, tag in _POINT_AVGS.items()})
    errors = agg.get("error_summary") or []
    n_err = sum(int(e.get("count", 1)) for e in errors if isinstance(e, dict)) or len(errors)
    completed = _agg(agg, "request_count", "avg") or 0
    point["errors"] = errors
    point["jsonl_check"] = check_against_records(point, rec, rel_tol)
    if agg.get("was_cancelled"):
        point["reason"] = "cancelled (interrupted or aborted by aiperf)"
    elif n_err or rec["requests_failed"]:
        first = errors[0] if errors else {}
        detail = (first.get("error_details") or {}) if isinstance(first, dict) else {}
        msg = detail.get("message") or detail.get("type") or str(first)[:160]
        point["reason"] = f"{max(n_err, rec['requests_failed'])} request error(s): {msg}"
    elif completed < request_count:
        point["reason"] = f"only {completed:.0f} of {request_count} requests completed"
    elif agg.get("is_complete") is False:
        point["reason"] = "aiperf marked the point incomplete"
    else:
        point["status"] = "ok"
    return point


def check_against_records(point: dict, rec: dict, rel_tol: float) -> dict[str, Any]:
    """Compare the summary's numbers with the per-request recomputation."""
    def close(a, b) -> bool:
        if a is None or b is None:
            return a is None and b is None
        return math.isclose(a, b, rel_tol=rel_tol, abs_tol=1e-9)

    pairs = [(f"{key}.{s}", v, rec["metrics"].get(key, {}).get(s))
             for key, stats in point.get("metrics", {}).items() for s, v in stats.items()]
    pairs += [(key, point.get(key), rec.get(key)) for key in ("output_tps", "total_tps")]
    mismatches = [f"{name}: summary {v} vs records {r}" for name, v, r in pairs if not close(v, r)]
    return {"compared": len(pairs), "ok": not mismatches, "mismatches": mismatches}


# --- is the stream per token?

# A streamed chunk may carry at most this many tokens times the tokens one engine step can deliver
# (1, or 1 + num_speculative_tokens with speculative decoding) before the point is "bunched".
BUNCHED_TOLERANCE = 1.1
BUNCHED_NOTE = "stream bunched: ITL/TTFT not per token"


def tokens_per_step(server: dict | None) -> tuple[int, str]:
    """How many tokens one engine step can stream per request: from the speculative config the
    server logged (provenance.served_config), else its argv (``--speculative-config``) or its
    ``K3_MTP_K``, as rendered; 1 when none says."""
    from k3rocm.deploy.provenance import served_as

    spec = ((server or {}).get("served_config") or {}).get("speculative")
    if spec is not None:
        k = spec["num_spec_tokens"]
        return 1 + k, (f"the server's log: speculative {spec['method']} num_spec_tokens={k}"
                       if k else "the server's log: speculative_config=None")
    k, how = served_as(server).speculative
    return 1 + k, how


def stream_shape(point_dir: Path | None) -> dict[str, Any] | None:
    """Chunks and tokens per streamed request, from profile_export.jsonl (profiling phase):
    a chunk is one streamed response (aiperf's inter_chunk_latency has one gap per pair)."""
    if point_dir is None:
        return None
    num = (int, float)
    ok = [r for r in profiling_records(read_records(point_dir))[0]
          if isinstance(_value(r, "output_sequence_length"), num)]
    if not ok:
        return None
    chunks = [len(g) + 1 if isinstance(g := _value(r, "inter_chunk_latency"), list) else 1
              for r in ok]
    tokens = request_values(ok, "output_sequence_length")
    gen_ms = [float(lat) - float(ttft) for r in ok
              if isinstance(lat := _value(r, "request_latency"), num)
              and isinstance(ttft := _value(r, "time_to_first_token"), num)]
    itl = [float(v) for r in ok if isinstance(v := _value(r, "inter_token_latency"), num)]
    osl_avg = sum(tokens) / len(tokens)
    return {"requests": len(chunks), "chunks_per_request": sum(chunks) / len(chunks),
            "chunks_p50": stat_of(chunks, "p50"),
            "osl_avg": osl_avg, "tokens_per_chunk": sum(tokens) / sum(chunks),
            "gen_ms_p50": stat_of(gen_ms, "p50") if gen_ms else None,
            "itl_p50": stat_of(itl, "p50") if itl else None}


def judge_stream(shape: dict[str, Any] | None, per_step: int = 1,
                 per_step_source: str = "") -> dict[str, Any] | None:
    """``shape`` plus ``bunched`` (and a one-line ``note`` saying why) when chunks carry more
    tokens than an engine step delivers, or ITL is ~0 while more than one token came back:
    real servers do it too (``--stream-interval`` > 1, detokenizer hold-back, a proxy that
    buffers), and then ITL and TTFT describe chunks, not tokens."""
    if not shape:
        return None
    why = []
    if shape["tokens_per_chunk"] > per_step * BUNCHED_TOLERANCE:
        why.append(f"{shape['tokens_per_chunk']:.2f} tokens per chunk ("
                   f"{shape['chunks_per_request']:.1f} chunks for {shape['osl_avg']:.0f} tokens "
                   f"per request; one engine step streams at most {per_step})")
    itl = shape.get("itl_p50")
    if shape["osl_avg"] > 1 and itl is not None and itl < 0.01:
        why.append(f"ITL p50 {itl:.4f} ms with {shape['osl_avg']:.0f} output tokens")
    return {**shape, "tokens_per_step": per_step, "tokens_per_step_from": per_step_source,
            "bunched": bool(why), "note": f"{BUNCHED_NOTE}: " + "; ".join(why) if why else None}


# Server counters aiperf 0.13.0 scrapes from the server's /metrics during the profiling phase
# (server_metrics_export.json, "hybrid" format: metrics[name]["series"][i]["stats"]["total"],
# the counter's increase; aiperf strips prometheus' "_total"). Names: vLLM 0.32.0
# v1/metrics/loggers.py (prefix cache) and v1/spec_decode/metrics.py (MTP / speculative).
SERVER_COUNTERS = {"prefix_cache_hits": "vllm:prefix_cache_hits",
                   "prefix_cache_queries": "vllm:prefix_cache_queries",
                   "spec_draft_tokens": "vllm:spec_decode_num_draft_tokens",
                   "spec_accepted_tokens": "vllm:spec_decode_num_accepted_tokens"}
# Server-counted prompt tokens hold the chat template on top of the synthetic ISL (measured on
# the stand-in: ISL 64 -> 79 with the smoke model's template): a few dozen tokens, never fewer.
ISL_TEMPLATE_TOKENS = 64


def server_counters(point_dir: Path | None) -> dict[str, Any] | None:
    """Prefix-cache hit rate and MTP acceptance of one point from the scraped counters."""
    try:
        doc = json.loads((point_dir / "server_metrics_export.json").read_text())
    except (OSError, TypeError, json.JSONDecodeError):
        return None
    metrics = doc.get("metrics") or {}
    out: dict[str, Any] = {}
    for key, name in SERVER_COUNTERS.items():
        series = (metrics.get(name) or {}).get("series")
        out[key] = (sum(float((s.get("stats") or {}).get("total") or 0) for s in series)
                    if series else None)
    q, h = out["prefix_cache_queries"], out["prefix_cache_hits"]
    out["prefix_cache_hit_rate"] = h / q if q and h is not None else None
    d, a = out["spec_draft_tokens"], out["spec_accepted_tokens"]
    out["mtp_acceptance_rate"] = a / d if d and a is not None else None
    return out


def input_flags(point: dict, isl: int, osl: int, prefix_caching: bool | None) -> list[str]:
    """What makes a point's inputs other than the workload asked for (empty: clean)."""
    flags = []
    n = point.get("osl_mismatch_count")
    if n:
        flags.append(f"OSL: {n:.0f} request(s) off the requested {osl} tokens (aiperf "
                     "osl_mismatch_count)")
    if point.get("osl_avg") is not None and abs(point["osl_avg"] - osl) > 0.5:
        flags.append(f"OSL: server counted {point['osl_avg']:.1f} output tokens on average, "
                     f"not {osl}")
    got, slack = point.get("isl_avg"), max(ISL_TEMPLATE_TOKENS, 0.02 * isl)
    if got is not None and not isl <= got <= isl + slack:
        flags.append(f"ISL: server counted {got:.0f} input tokens on average for {isl} asked "
                     f"(expected {isl}..{isl + int(slack)} with the chat template)")
    hits = (point.get("server_metrics") or {}).get("prefix_cache_hits")
    if prefix_caching is False and hits:
        flags.append(f"prefix cache: {hits:.0f} token hit(s) while the workload needs prefix "
                     "caching off")
    elif prefix_caching is False and hits is None:
        flags.append("prefix cache: hits not scraped from the server (cannot check 0)")
    return flags


def summarize(artifact_dir: Path, points: Sequence[tuple[int, int]], per_step: int = 1,
              per_step_source: str = "", expect: dict[str, Any] | None = None
              ) -> list[dict[str, Any]]:
    """Every expected point, in order; a missing or broken one is recorded as failed. Each
    point's ``stream`` says whether the stream was per token (``per_step``: tokens one engine
    step streams, see :func:`tokens_per_step`); with ``expect`` ({isl, osl, prefix_caching})
    its ``flags`` say where the inputs were not what the workload asked for."""
    children = artifact_dir.iterdir() if artifact_dir.is_dir() else ()
    dirs = {(int(m[1]), int(m[2])): c for c in children
            if (m := _POINT_RE.match(c.name)) and c.is_dir()}
    if len(points) == 1 and not dirs and any(
            (artifact_dir / f).exists()
            for f in ("profile_export.jsonl", "profile_export_aiperf.json")):
        dirs = {points[0]: artifact_dir}  # single-point runs write straight into artifact_dir
    out = []
    for c, n in points:
        d = dirs.get((c, n))
        point = summarize_point(d, c, n)
        point.update(stream=judge_stream(stream_shape(d), per_step, per_step_source),
                     server_metrics=server_counters(d))
        if expect and point.get("metrics"):
            point["flags"] = input_flags(point, **expect)
        out.append(point)
    return out


# --- perf.csv (ROCm/MAD columns) and markdown

MAD_METRICS = [  # (MAD metric, how to get it from a point, unit)
    ("throughput_tot", lambda p: p.get("total_tps"), "tokens/s"),
    ("throughput_gen", lambda p: p.get("output_tps"), "tokens/s"),
    ("median_ttft", lambda p: _m(p, "ttft", "p50"), "ms"),
    ("median_tpot", lambda p: _m(p, "itl", "p50"), "ms"),
    ("median_itl", lambda p: _m(p, "icl", "p50"), "ms"),
    ("median_e2el", lambda p: _m(p, "e2el", "p50"), "ms"),
]


def _m(point: dict, key: str, stat: str) -> float | None:
    return ((point.get("metrics") or {}).get(key) or {}).get(stat)


def perf_csv(points: Sequence[dict], *, model: str, benchmark: str, tp: Any, inp: int, out: int,
             cmd: str) -> str:
    """MAD's columns plus a trailing ``status``; a failed point keeps its rows with an empty
    performance and status ``failed: <reason>`` (never dropped)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow([*MAD_COLUMNS, "status"])
    for p in points:
        ok = p["status"] == "ok"
        for metric, get, unit in MAD_METRICS:
            v = get(p) if ok else None
            w.writerow([model, benchmark, tp if tp is not None else "", inp, out,
                        p["request_count"], p["concurrency"], cmd,
                        "" if v is None else f"{v:.6g}", metric, unit,
                        "ok" if ok else f"failed: {p.get('reason')}"])
    return buf.getvalue()


def fmt(v: float | None, spec: str = ".2f", scale: float = 1, suffix: str = "") -> str:
    """``v * scale`` formatted by ``spec`` (+ ``suffix``); "n/a" for a missing or NaN value."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v * scale:{spec}}{suffix}"


def _fmt(v: float | None, digits: int = 2) -> str:
    return fmt(v, f".{digits}f")


def rate(v: float | None) -> str:
    return fmt(v, ".1%")


def markdown_report(points: Sequence[dict], title: str, protocol_lines: Sequence[str]) -> str:
    lines = [f"# {title}", ""]
    lines += [f"- {x}" for x in protocol_lines]
    lines += ["", "| concurrency | requests | status | TTFT p50 ms | ITL p50 ms | E2E p50 ms | "
              "output tok/s | tok/s/user p50 |", "|---:|---:|---|---:|---:|---:|---:|---:|"]
    bunched = [p for p in points if (p.get("stream") or {}).get("bunched")]
    for p in points:
        status = p["status"] + (" (stream bunched)" if p in bunched else "")
        lines.append(f"| {p['concurrency']} | {p['request_count']} | {status} | "
                     f"{_fmt(_m(p, 'ttft', 'p50'))} | {_fmt(_m(p, 'itl', 'p50'), 3)} | "
                     f"{_fmt(_m(p, 'e2el', 'p50'))} | {_fmt(p.get('output_tps'))} | "
                     f"{_fmt(_m(p, 'tps_user', 'p50'))} |")
    for p in bunched:
        lines += ["", f"**c={p['concurrency']}: {p['stream']['note']}.** The latency figures of "
                      "this point describe chunks, not tokens."]
    for p in points:
        for f in p.get("flags") or []:
            lines += ["", f"**c={p['concurrency']} inputs: {f}.**"]
    lines += ["", "| concurrency | ISL avg (server) | OSL avg (server) | OSL mismatches | "
              "prefix-cache hit rate | MTP acceptance |", "|---:|---:|---:|---:|---:|---:|"]
    for p in points:
        sm = p.get("server_metrics") or {}
        lines.append(f"| {p['concurrency']} | {_fmt(p.get('isl_avg'), 1)} | "
                     f"{_fmt(p.get('osl_avg'), 1)} | {_fmt(p.get('osl_mismatch_count'), 0)} | "
                     f"{rate(sm.get('prefix_cache_hit_rate'))} | "
                     f"{rate(sm.get('mtp_acceptance_rate'))} |")
    for p in points:
        lines += ["", f"## concurrency {p['concurrency']} ({p['request_count']} requests): "
                      f"{p['status']}", ""]
        st = p.get("stream")
        if st:
            lines += [f"Stream: {st['chunks_per_request']:.1f} chunks per request for "
                      f"{st['osl_avg']:.1f} output tokens ({st['tokens_per_chunk']:.2f} tokens "
                      f"per chunk; an engine step streams at most {st['tokens_per_step']}: "
                      f"{st['tokens_per_step_from']}): "
                      + ("**bunched**" if st["bunched"] else "per token"), ""]
        if p["status"] != "ok":
            lines += [f"**FAILED**: {p.get('reason')}", ""]
            if not p.get("metrics"):
                continue
        lines += ["| metric | p50 | p90 | p99 | avg |", "|---|---:|---:|---:|---:|"]
        for key, digits in (("ttft", 3), ("itl", 3), ("e2el", 3), ("tps_user", 2)):
            _, label, unit = LATENCY_METRICS[key]
            cells = " | ".join(_fmt(_m(p, key, s), digits) for s in ("p50", "p90", "p99", "avg"))
            lines.append(f"| {label if key == 'tps_user' else f'{label} ({unit})'} | {cells} |")
        lines.append(f"| output tokens/s (all users) | | | | {_fmt(p.get('output_tps'))} |")
        chk = p.get("jsonl_check") or {}
        if chk:
            verdict = ("all equal" if chk.get("ok")
                       else "MISMATCH: " + "; ".join(chk["mismatches"][:3]))
            lines += ["", f"Checked against profile_export.jsonl: {chk.get('compared')} "
                          f"numbers, {verdict}."]
    return "\n".join(lines) + "\n"
