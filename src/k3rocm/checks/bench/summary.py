"""aiperf 0.13.0 artifacts -> one summary per sweep point, checked against the per-request
records; perf.csv (ROCm/MAD columns) and report.md.

Latency statistics come from ``profile_export_aiperf.json`` and are recomputed from
``profile_export.jsonl`` (profiling phase, numpy percentiles); throughput is tokens / the
profiling phase of ``phase_manifest.json``. ``itl`` is aiperf's inter_token_latency (vLLM
bench's TPOT), ``icl`` its inter_chunk_latency (vLLM bench's ITL).
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

from k3rocm.rundir import table

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
_NUM = (int, float)


def stat_of(values: Sequence[float], stat: str) -> float:
    """avg, or pXX by linear interpolation (numpy's default, aiperf's method); nan for none."""
    if not values:
        return math.nan
    if stat == "avg":
        return sum(values) / len(values)
    import numpy as np  # on first use: the CLI imports this module

    return float(np.percentile(values, float(stat.removeprefix("p"))))


# --- per-request records

def read_records(point_dir: Path) -> list[dict]:
    try:
        lines = (point_dir / "profile_export.jsonl").read_text().splitlines()
    except OSError:
        return []
    out = []
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
        if md.get("benchmark_phase", md.get("phase_kind")) == "profiling":
            (bad if r.get("error") else ok).append(r)
    return ok, bad


def _value(record: dict, tag: str) -> Any:
    m = (record.get("metrics") or {}).get(tag)
    return m.get("value") if isinstance(m, dict) else None


def request_values(records: Iterable[dict], tag: str) -> list[float]:
    """Per-request values of a metric (lists, e.g. inter_chunk_latency, are pooled)."""
    out: list[float] = []
    for r in records:
        v = _value(r, tag)
        if isinstance(v, list):
            out.extend(float(x) for x in v)
        elif isinstance(v, _NUM):
            out.append(float(v))
    return out


def profiling_window(point_dir: Path) -> tuple[int, int] | None:
    """(start, end) wall-clock ns of the profiling phase (phase_manifest.json)."""
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
    window = profiling_window(point_dir)
    dur = (window[1] - window[0]) / 1e9 if window else None
    osl = sum(request_values(ok, "output_sequence_length"))
    isl = sum(request_values(ok, "input_sequence_length"))
    return {"requests_ok": len(ok), "requests_failed": len(bad), "metrics": {
        key: {s: stat_of(vals, s) for s in STATS} for key, (tag, _, _) in LATENCY_METRICS.items()
        if (vals := request_values(ok, tag))},
        "duration_s": dur, "output_tps": osl / dur if dur else None,
        "total_tps": (osl + isl) / dur if dur else None,
        "request_tps": len(ok) / dur if dur else None}


# --- sweep points

def _agg(d: dict, tag: str, stat: str) -> float | None:
    v = (d.get(tag) or {}).get(stat)
    return float(v) if isinstance(v, _NUM) else None


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
    errors = point["errors"] = agg.get("error_summary") or []
    n_err = sum(int(e.get("count", 1)) for e in errors if isinstance(e, dict)) or len(errors)
    completed = _agg(agg, "request_count", "avg") or 0
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

# Tokens per chunk above (tokens one engine step streams) x this: the point is "bunched".
BUNCHED_TOLERANCE = 1.1
BUNCHED_NOTE = "stream bunched: ITL/TTFT not per token"


def tokens_per_step(server: dict | None) -> tuple[int, str]:
    """(tokens one engine step can stream per request, where that was read): the speculative
    config in the server's log, else its rendered argv / K3_MTP_K; 1 when none says."""
    from k3rocm.deploy.provenance import served_as

    spec = ((server or {}).get("served_config") or {}).get("speculative")
    if spec is not None:
        k = spec["num_spec_tokens"]
        return 1 + k, (f"the server's log: speculative {spec['method']} num_spec_tokens={k}"
                       if k else "the server's log: speculative_config=None")
    k, how = served_as(server).speculative
    return 1 + k, how


def stream_shape(point_dir: Path | None) -> dict[str, Any] | None:
    """Chunks and tokens per streamed request (profiling phase; a chunk is one streamed
    response: inter_chunk_latency has one gap per pair)."""
    if point_dir is None:
        return None
    ok = [r for r in profiling_records(read_records(point_dir))[0]
          if isinstance(_value(r, "output_sequence_length"), _NUM)]
    if not ok:
        return None
    chunks = [len(g) + 1 if isinstance(g := _value(r, "inter_chunk_latency"), list) else 1
              for r in ok]
    tokens = request_values(ok, "output_sequence_length")
    gen_ms = [float(lat) - float(ttft) for r in ok
              if isinstance(lat := _value(r, "request_latency"), _NUM)
              and isinstance(ttft := _value(r, "time_to_first_token"), _NUM)]
    itl = request_values(ok, "inter_token_latency")
    return {"requests": len(chunks), "chunks_per_request": sum(chunks) / len(chunks),
            "chunks_p50": stat_of(chunks, "p50"),
            "osl_avg": sum(tokens) / len(tokens), "tokens_per_chunk": sum(tokens) / sum(chunks),
            "gen_ms_p50": stat_of(gen_ms, "p50") if gen_ms else None,
            "itl_p50": stat_of(itl, "p50") if itl else None}


def judge_stream(shape: dict[str, Any] | None, per_step: int = 1,
                 per_step_source: str = "") -> dict[str, Any] | None:
    """``shape`` plus ``bunched`` (and a ``note`` saying why): chunks carry more tokens than an
    engine step delivers, or ITL ~0 with more than one token (``--stream-interval`` > 1, a
    buffering proxy): ITL and TTFT then describe chunks, not tokens."""
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


# Counters aiperf scrapes from /metrics (server_metrics_export.json: metrics[name]["series"]
# [i]["stats"]["total"]; vLLM 0.32.0 v1/metrics/loggers.py, v1/spec_decode/metrics.py).
SERVER_COUNTERS = {"prefix_cache_hits": "vllm:prefix_cache_hits",
                   "prefix_cache_queries": "vllm:prefix_cache_queries",
                   "spec_draft_tokens": "vllm:spec_decode_num_draft_tokens",
                   "spec_accepted_tokens": "vllm:spec_decode_num_accepted_tokens"}
# The chat template on top of the synthetic ISL (stand-in: 64 -> 79 tokens): never fewer.
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
    if n := point.get("osl_mismatch_count"):
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
    """Every expected point, in order (missing or broken: failed), with its ``stream`` shape
    and, given ``expect`` ({isl, osl, prefix_caching}), its input ``flags``."""
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

# (MAD metric, our key, stat, unit); throughput from the point itself
MAD_METRICS = [("throughput_tot", "total_tps", None, "tokens/s"),
               ("throughput_gen", "output_tps", None, "tokens/s"),
               ("median_ttft", "ttft", "p50", "ms"), ("median_tpot", "itl", "p50", "ms"),
               ("median_itl", "icl", "p50", "ms"), ("median_e2el", "e2el", "p50", "ms")]


def _m(point: dict, key: str, stat: str) -> float | None:
    return ((point.get("metrics") or {}).get(key) or {}).get(stat)


def perf_csv(points: Sequence[dict], *, model: str, benchmark: str, tp: Any, inp: int, out: int,
             cmd: str) -> str:
    """MAD's columns plus ``status``; a failed point keeps its rows with an empty performance
    and status ``failed: <reason>``."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow([*MAD_COLUMNS, "status"])
    for p in points:
        ok = p["status"] == "ok"
        for metric, key, stat, unit in MAD_METRICS:
            v = (p.get(key) if stat is None else _m(p, key, stat)) if ok else None
            w.writerow([model, benchmark, "" if tp is None else tp, inp, out,
                        p["request_count"], p["concurrency"], cmd,
                        "" if v is None else f"{v:.6g}", metric, unit,
                        "ok" if ok else f"failed: {p.get('reason')}"])
    return buf.getvalue()


def fmt(v: float | None, spec: str = ".2f", scale: float = 1, suffix: str = "") -> str:
    """``v * scale`` formatted by ``spec`` (+ ``suffix``); "n/a" for a missing or NaN value."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v * scale:{spec}}{suffix}"


def rate(v: float | None) -> str:
    return fmt(v, ".1%")


def markdown_report(points: Sequence[dict], title: str, protocol_lines: Sequence[str]) -> str:
    def f(v, digits=2):
        return fmt(v, f".{digits}f")

    bunched = [p for p in points if (p.get("stream") or {}).get("bunched")]
    lines = [f"# {title}", "", *[f"- {x}" for x in protocol_lines], "", *table(
        ["concurrency", "requests", "status", "TTFT p50 ms", "ITL p50 ms", "E2E p50 ms",
         "output tok/s", "tok/s/user p50"], "rrlrrrrr",
        ([p["concurrency"], p["request_count"],
          p["status"] + (" (stream bunched)" if p in bunched else ""), f(_m(p, "ttft", "p50")),
          f(_m(p, "itl", "p50"), 3), f(_m(p, "e2el", "p50")), f(p.get("output_tps")),
          f(_m(p, "tps_user", "p50"))] for p in points))]
    for p in bunched:
        lines += ["", f"**c={p['concurrency']}: {p['stream']['note']}.** The latency figures of "
                      "this point describe chunks, not tokens."]
    lines += [x for p in points for fl in p.get("flags") or []
              for x in ("", f"**c={p['concurrency']} inputs: {fl}.**")]
    lines += ["", *table(["concurrency", "ISL avg (server)", "OSL avg (server)", "OSL mismatches",
                          "prefix-cache hit rate", "MTP acceptance"], "rrrrrr",
                         ([p["concurrency"], f(p.get("isl_avg"), 1), f(p.get("osl_avg"), 1),
                           f(p.get("osl_mismatch_count"), 0),
                           rate((p.get("server_metrics") or {}).get("prefix_cache_hit_rate")),
                           rate((p.get("server_metrics") or {}).get("mtp_acceptance_rate"))]
                          for p in points))]
    for p in points:
        lines += ["", f"## concurrency {p['concurrency']} ({p['request_count']} requests): "
                      f"{p['status']}", ""]
        if st := p.get("stream"):
            lines += [f"Stream: {st['chunks_per_request']:.1f} chunks per request for "
                      f"{st['osl_avg']:.1f} output tokens ({st['tokens_per_chunk']:.2f} tokens "
                      f"per chunk; an engine step streams at most {st['tokens_per_step']}: "
                      f"{st['tokens_per_step_from']}): "
                      + ("**bunched**" if st["bunched"] else "per token"), ""]
        if p["status"] != "ok":
            lines += [f"**FAILED**: {p.get('reason')}", ""]
            if not p.get("metrics"):
                continue
        lines += table(["metric", "p50", "p90", "p99", "avg"], "lrrrr", [
            *([label if key == "tps_user" else f"{label} ({unit})",
               *(f(_m(p, key, s), digits) for s in ("p50", "p90", "p99", "avg"))]
              for key, digits in (("ttft", 3), ("itl", 3), ("e2el", 3), ("tps_user", 2))
              for _, label, unit in [LATENCY_METRICS[key]]),
            ["output tokens/s (all users)", "", "", "", f(p.get("output_tps"))]])
        if chk := p.get("jsonl_check"):
            verdict = ("all equal" if chk.get("ok")
                       else "MISMATCH: " + "; ".join(chk["mismatches"][:3]))
            lines += ["", f"Checked against profile_export.jsonl: {chk.get('compared')} "
                          f"numbers, {verdict}."]
    return "\n".join(lines) + "\n"
