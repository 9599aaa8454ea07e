"""The gate on lm-eval's gsm8k output (results file, samples, fallback and finish logs) of a run
directory, and the summary (JSON + markdown); ``k3rocm gsm8k --rescore DIR`` reruns it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from k3rocm.checks.gsm8k.data import GSM8K_TEST_ITEMS
from k3rocm.checks.steps import read_json
from k3rocm.errors import UsageError

REFERENCE = {"exact_match": 0.9644, "stderr": 0.0051,
             "source": "vLLM PR #52494 (Kimi-K3, MI355X TP=8), lm-eval gsm8k 5-shot, "
                       "strict-match and flexible-extract"}
NUM_FEWSHOT = 5
FALLBACK_CHAT_MODEL = "k3-chat-completions"  # + reasoning fallback (lmeval_launch.py)
FILTERS = ("strict-match", "flexible-extract")
TASK = "gsm8k"


def read_jsonl(path: Path | None) -> list[dict]:
    if path is None or not path.is_file():
        return []
    # split on newlines only: answers may hold U+2028 and friends (written ensure_ascii=False)
    return [json.loads(ln) for ln in path.read_text(encoding="utf-8").split("\n") if ln.strip()]


def _err(m: dict) -> str:
    return "n/a" if m["stderr"] is None else f"{m['stderr']:.4f}"


def _first_response(sample: dict) -> str | None:
    resps = sample.get("resps")
    while isinstance(resps, list) and resps:
        resps = resps[0]
    return resps if isinstance(resps, str) else None


def item_correct(samples: list[dict], filt: str = "strict-match") -> dict[Any, bool]:
    """Per test item (doc_id): right or wrong under one filter (for the paired A/B)."""
    return {s.get("doc_id"): float(s.get("exact_match") or 0) >= 1.0 for s in samples
            if s.get("filter") == filt}


def truncation(samples: list[dict], finishes: list[dict] | None,
               max_gen_tokens: int | None) -> dict[str, Any]:
    """Answers cut off at the generation limit (finish_reason "length"), apart from wrong ones."""
    if finishes is None:
        return {"recorded": False, "note": "finish reasons not recorded"}
    cut = [f.get("text") for f in finishes if f.get("finish_reason") == "length"]
    docs = {s.get("doc_id") for s in samples if _first_response(s) in set(cut)}
    right = item_correct(samples)
    rest = [ok for d, ok in right.items() if d not in docs]
    n = len(finishes)
    return {"recorded": True, "count": len(cut), "of": n, "rate": len(cut) / n if n else None,
            "max_gen_tokens": max_gen_tokens, "doc_ids": sorted(d for d in docs if d is not None),
            "scored_right": sum(1 for d in docs if right.get(d)),
            "accuracy_without_truncated": sum(rest) / len(rest) if rest else None}


def evaluate(results: dict, samples: list[dict], fallbacks: list[dict], *, threshold: float,
             allow_limit: bool, finishes: list[dict] | None = None,
             max_gen_tokens: int | None = None) -> dict[str, Any]:
    """The verdict as a dict (pure: no files)."""
    res = (results.get("results") or {}).get(TASK)
    if not isinstance(res, dict):
        raise UsageError(f"lm-eval results have no '{TASK}' entry "
                         f"(tasks: {', '.join(results.get('results') or {}) or 'none'})")
    metrics = {}
    for filt in FILTERS:
        value, err = res.get(f"exact_match,{filt}"), res.get(f"exact_match_stderr,{filt}")
        if not isinstance(value, (int, float)):
            raise UsageError(f"lm-eval results have no exact_match for filter {filt!r} "
                             f"(keys: {', '.join(sorted(res))})")
        metrics[filt] = {"exact_match": float(value),
                         "stderr": float(err) if isinstance(err, (int, float)) else None,
                         "reaches_gate": float(value) >= threshold}
    n = (results.get("n-samples") or {}).get(TASK) or {}
    original, effective = n.get("original"), n.get("effective")
    config = results.get("config") or {}
    limit = config.get("limit")
    if isinstance(limit, float) and limit.is_integer():  # lm-eval stores --limit 50 as 50.0
        limit = int(limit)
    n_shot = (results.get("n-shot") or {}).get(TASK)

    reasons = []
    if limit is not None:
        reasons.append(f"--limit {limit}: {effective} of {original} test items")
    elif isinstance(original, int) and isinstance(effective, int) and effective < original:
        reasons.append(f"only {effective} of {original} test items evaluated")
    if isinstance(original, int) and original != GSM8K_TEST_ITEMS:
        reasons.append(f"the test set has {original} items, GSM8K's test split has "
                       f"{GSM8K_TEST_ITEMS}")
    if n_shot is not None and n_shot != NUM_FEWSHOT:
        reasons.append(f"{n_shot}-shot, the reference is {NUM_FEWSHOT}-shot")
    comparable = not reasons
    gate_met = all(m["reaches_gate"] for m in metrics.values())
    passed = gate_met and (comparable or allow_limit)

    # the fallback log has one line per response scored on its reasoning text
    fb_texts = {f.get("text") for f in fallbacks if isinstance(f.get("text"), str)}
    doc_ids = {s.get("doc_id") for s in samples if _first_response(s) in fb_texts}
    empty = {s.get("doc_id") for s in samples if not (_first_response(s) or "").strip()}
    fallback_on = config.get("model") == FALLBACK_CHAT_MODEL
    scores = ", ".join(f"{f} {metrics[f]['exact_match']:.4f} +- {_err(metrics[f])}"
                       for f in FILTERS)
    ref = f"reference {REFERENCE['exact_match']:.4f} +- {REFERENCE['stderr']:.4f}"
    if not gate_met:
        low = " and ".join(f for f in FILTERS if not metrics[f]["reaches_gate"])
        status, code = "below_gate", 1
        message = f"gsm8k: FAIL: below the gate {threshold:g} ({low}): {scores}; {ref}"
    elif not passed:
        status, code = "not_comparable", 1
        message = (f"gsm8k: NOT A PASS: {scores} reach the gate {threshold:g} but the run is not "
                   f"comparable ({'; '.join(reasons)}); rerun without --limit on the full test "
                   "set, or add --allow-limit to accept it")
    else:
        status, code = "pass", 0
        message = f"gsm8k: PASS: {scores} >= gate {threshold:g}; {ref}"
    if reasons and status != "not_comparable":
        message += f"; not comparable: {'; '.join(reasons)}"
    if doc_ids:
        message += (f"; DEVIATION from the reference protocol: {len(doc_ids)} answer(s) scored "
                    "from the reasoning text (content empty, --reasoning-fallback)")
    elif empty and not fallback_on and config.get("model") != "local-completions":
        message += (f"; {len(empty)} empty answer(s) scored as wrong (a reasoning model's answer "
                    "may be in reasoning_content: see --reasoning-fallback in docs/gsm8k.md)")
    trunc = truncation(samples, finishes, max_gen_tokens)
    if trunc.get("count"):
        message += (f"; {trunc['count']} of {trunc['of']} answer(s) cut off at the generation "
                    f"limit ({max_gen_tokens or '?'} tokens; scored wrong unless the answer came "
                    "first: see summary 'truncated')")
    deviations = [f"{len(doc_ids)} answer(s) scored from the reasoning text because the content "
                  "was empty (--reasoning-fallback; the reference protocol scores the content "
                  "only)"] if doc_ids else []
    return {
        "truncated": trunc, "status": status, "passed": passed, "exit_code": code,
        "message": message, "threshold": threshold,
        "gate": "exact_match of both strict-match and flexible-extract >= threshold",
        "reference": REFERENCE, "metrics": metrics,
        "items": {"evaluated": effective, "test_set": original, "num_fewshot": n_shot},
        "limit": limit, "comparable": comparable, "not_comparable_reasons": reasons,
        "deviations_from_reference": deviations, "like_reference": comparable and not deviations,
        "allow_limit": allow_limit,
        "reasoning_fallback": {"enabled": fallback_on, "count": len(doc_ids),
                               "of": len({s.get("doc_id") for s in samples}) or effective,
                               "responses_logged": len(fallbacks),
                               "doc_ids": sorted(d for d in doc_ids if d is not None)},
        "empty_responses": len(empty),
        "lm_eval": {"version": results.get("lm_eval_version"), "model": config.get("model"),
                    "model_args": config.get("model_args"),
                    "gen_kwargs": config.get("gen_kwargs"), "date": results.get("date"),
                    "total_evaluation_time_seconds":
                        results.get("total_evaluation_time_seconds")},
        "task_config": (results.get("configs") or {}).get(TASK),  # as lm-eval resolved it
    }


def markdown(summary: dict) -> str:
    if "metrics" not in summary:  # no verdict: an error or Ctrl-C
        return (f"# GSM8K accuracy gate\n\n**{summary['status'].upper()}** - "
                f"{summary['message']}\n\n```\n{summary['run']['command']}\n```\n")
    ref, items, fb = summary["reference"], summary["items"], summary["reasoning_fallback"]
    t = summary.get("truncated") or {}
    acc = t.get("accuracy_without_truncated")
    trunc = (f"{t['count']} of {t['of']} answers ({(t['rate'] or 0):.1%}) at max_gen_tokens "
             f"{t.get('max_gen_tokens')}; {t['scored_right']} of the matched ones scored right; "
             f"strict-match accuracy without them {'n/a' if acc is None else f'{acc:.4f}'}"
             if t.get("recorded") else t.get("note") or "not recorded")
    lines = [
        "# GSM8K accuracy gate", "",
        f"**{summary['status'].upper().replace('_', ' ')}** - {summary['message']}", "",
        f"lm-eval gsm8k, {items.get('num_fewshot')}-shot, greedy; gate: "
        f"{summary['gate']} ({summary['threshold']:g}).", "",
        "| filter | exact_match | stderr | reference | gate | result |",
        "|---|---|---|---|---|---|",
        *(f"| {filt} | {m['exact_match']:.4f} | ± {_err(m)} | {ref['exact_match']:.4f} ± "
          f"{ref['stderr']:.4f} | >= {summary['threshold']:g} | "
          f"{'reaches gate' if m['reaches_gate'] else 'below gate'} |"
          for filt, m in summary["metrics"].items()), "",
        f"- Items evaluated: {items.get('evaluated')} of {items.get('test_set')}"
        f" (limit: {summary['limit']})",
        f"- Comparable with the reference: {'yes' if summary['comparable'] else 'no'}"
        + ("" if summary["comparable"] else f" ({'; '.join(summary['not_comparable_reasons'])})"),
        "- Reasoning fallback: "
        + ("on (a deviation from the reference protocol)" if fb.get("enabled") else "off")
        + f"; answers scored from reasoning_content (content was empty): {fb['count']} of "
        f"{fb['of']}",
        f"- Empty responses: {summary['empty_responses']}",
        f"- Cut off at the generation limit: {trunc}",
        "- Server setup comparable with the reference run's (vLLM PR #52494): "
        + ((summary.get("upstream_comparison") or {}).get("text") or "not judged"),
        f"- Reference: {ref['source']}",
    ]
    if tc := summary.get("task_config") or {}:
        lines += ["", "Task config as lm-eval ran it (summary.json `task_config`): "
                  f"`doc_to_text` {json.dumps(tc.get('doc_to_text'))}, `until` "
                  f"{json.dumps((tc.get('generation_kwargs') or {}).get('until'))}, "
                  f"`num_fewshot` {tc.get('num_fewshot')}, `fewshot_split` "
                  f"{tc.get('fewshot_split')}, version {(tc.get('metadata') or {}).get('version')}"]
    if run := summary.get("run") or {}:
        lines += ["", "## Run", ""] + [
            f"- {k}: `{run[k]}`" for k in ("server_url", "model", "mode", "concurrency",
                                           "max_gen_tokens", "data", "client_image",
                                           "wall_seconds") if k in run]
        if run.get("command"):
            lines += ["", "```", run["command"], "```"]
    return "\n".join(lines) + "\n"


def read_summary(run_dir: Path) -> dict:
    return read_json(run_dir / "summary.json")


def load_run(run_dir: Path) -> tuple[dict, list[dict], list[dict], Path, Path | None]:
    """lm-eval's results, its samples (the file of the same timestamp, else the last by name) and
    the fallback log; the two files' paths."""
    found = sorted((run_dir / "lm_eval").rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise UsageError(f"no lm-eval results file (results_*.json) under {run_dir / 'lm_eval'}")
    rfile = found[-1]
    stamp = rfile.stem[len("results_"):]
    sfile = max(rfile.parent.glob(f"samples_{TASK}_*.jsonl"), default=None,
                key=lambda p: (p.stem == f"samples_{TASK}_{stamp}", p.name))
    return (json.loads(rfile.read_text()), read_jsonl(sfile),
            read_jsonl(run_dir / "reasoning_fallback.jsonl"), rfile, sfile)


def judge(run_dir: Path, *, threshold: float, allow_limit: bool,
          max_gen_tokens: int | None) -> dict[str, Any]:
    """The verdict on a stored run directory, with the lm-eval files it read."""
    res, samples, fallbacks, rfile, sfile = load_run(run_dir)
    finishes = run_dir / "finish_reasons.jsonl"
    summary = evaluate(res, samples, fallbacks, threshold=threshold, allow_limit=allow_limit,
                       finishes=read_jsonl(finishes) if finishes.is_file() else None,
                       max_gen_tokens=max_gen_tokens)
    summary["files"] = {"results": str(rfile.relative_to(run_dir)),
                        "samples": str(sfile.relative_to(run_dir)) if sfile else None}
    return summary
