"""gsm8k without a server: data checks, the lm-eval command line, and the gate on stored results
(lm-eval 0.4.13's file shapes, judged through `k3rocm gsm8k --rescore`)."""

from __future__ import annotations

import json
import re
import shutil
from math import comb
from pathlib import Path

import pytest
import yaml
from conftest import free_port, make, make_exit_code

from k3rocm.checks.bench import stats
from k3rocm.checks.gsm8k import ab, cli, data, results
from k3rocm.checks.gsm8k.lmeval_launch import apply_reasoning_fallback, log_finish_reasons
from k3rocm.cli import parse
from k3rocm.errors import UsageError


def write_items(path: Path, n: int, offset: int = 0) -> None:
    with open(path, "w") as fh:
        for i in range(offset, offset + n):
            a, b = i + 2, 3 * i + 1
            fh.write(json.dumps({
                "question": f"Tom has {a} apples and buys {b} more. How many apples now?",
                "answer": f"Tom has {a}+{b}=<<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}",
            }) + "\n")


@pytest.fixture
def data_dir(tmp_path) -> Path:
    d = tmp_path / "gsm8k"
    d.mkdir()
    write_items(d / "train.jsonl", 8)
    write_items(d / "test.jsonl", 4, offset=100)
    return d


def test_local_data_dir_and_the_run_task_file(data_dir):
    src = data.resolve(str(data_dir), None)
    assert src.kind == "local-jsonl" and src.test_items == 4
    assert src.provenance()["files"]["test"]["sha256"] == data.sha256_file(data_dir / "test.jsonl")
    shipped = yaml.safe_load(data.TASK_FILE.read_text())
    run = yaml.safe_load(data.task_yaml(src))  # only the data source differs
    assert run.pop("dataset_path") == "json" and "dataset_name" not in run
    assert run.pop("dataset_kwargs") == {"data_files": {"train": "/data/gsm8k/train.jsonl",
                                                        "test": "/data/gsm8k/test.jsonl"}}
    assert run == {k: v for k, v in shipped.items() if not k.startswith("dataset_")}


@pytest.mark.parametrize("line, fragment", [
    ("not json", "test.jsonl:5 is not JSON"),
    (json.dumps({"question": "q"}), "test.jsonl:5 needs string fields question and answer"),
    (json.dumps({"question": "q", "answer": "4"}), "test.jsonl:5 answer does not end in '####"),
    (None, "5-shot needs at least 5"),
])
def test_bad_items(data_dir, line, fragment):
    if line is None:
        write_items(data_dir / "train.jsonl", 3)
    else:
        with open(data_dir / "test.jsonl", "a") as fh:
            fh.write(line + "\n")
    with pytest.raises(UsageError, match=re.escape(fragment)):
        data.resolve(str(data_dir), None)


def test_hf_hub_snapshot_then_arrow_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    with pytest.raises(UsageError, match="no GSM8K data found.*huggingface-cli download openai/"):
        data.resolve(None, str(tmp_path / "hf"))
    repo = tmp_path / "hf" / "hub" / data.HF_REPO_DIR
    rev = "e53f048856ff4f594e959d75785d2c2d37b678ee"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    snap = repo / "snapshots" / rev / "main"
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for split in ("train", "test"):  # the hub cache layout: snapshot links into blobs/
        (repo / "blobs" / split).write_bytes(b"PAR1")
        (snap / f"{split}-00000-of-00001.parquet").symlink_to(f"../../../blobs/{split}")
    src = data.resolve(None, str(tmp_path / "hf"))
    assert src.kind == "hf-hub-parquet" and src.host_dir == repo.resolve()
    assert src.files["test"] == f"/hf/hub/{data.HF_REPO_DIR}/snapshots/{rev}/main/" \
        "test-00000-of-00001.parquet"
    assert "dataset_path: parquet" in data.task_yaml(src)
    arrow = tmp_path / "hf2" / "datasets" / data.ARROW_DIR / "main" / "0.0.0" / "abc"
    arrow.mkdir(parents=True)
    (arrow / "gsm8k-test.arrow").write_bytes(b"x")
    src = data.resolve(None, str(tmp_path / "hf2"))
    assert src.kind == "hf-datasets-cache" and data.task_yaml(src) == data.TASK_FILE.read_text()


# The task config vLLM PR #52494 printed (lm-eval task `gsm8k`, metadata version 3.0), typed from
# the PR, not read from our YAML.
REFERENCE_DOC_TO_TEXT = ("Question: {{question}}\nEnd your response with the answer on the last "
                         "line, formatted as: #### [number]\nAnswer:")
REFERENCE_METRIC = {"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                    "ignore_case": True, "ignore_punctuation": False,
                    "regexes_to_ignore": [",", "\\$", "(?s).*#### ", "\\.$"]}
REFERENCE_FILTERS = [
    {"name": "strict-match", "filter": [
        {"function": "regex", "regex_pattern": r"#### (\-?[0-9\.\,]+)"},
        {"function": "take_first"}]},
    {"name": "flexible-extract", "filter": [
        {"function": "regex", "group_select": -1, "regex_pattern": r"(-?[$0-9.,]{2,})|(-?[0-9]+)"},
        {"function": "take_first"}]},
]


def test_shipped_task_is_the_references():
    assert yaml.safe_load(data.TASK_FILE.read_text()) == {
        "task": "gsm8k", "doc_to_text": REFERENCE_DOC_TO_TEXT, "doc_to_target": "{{answer}}",
        "output_type": "generate_until", "num_fewshot": 5, "repeats": 1,
        "generation_kwargs": {"until": ["</s>", "<|im_end|>"], "do_sample": False,
                              "temperature": 0.0},
        "fewshot_split": "train", "training_split": "train", "test_split": "test",
        "metric_list": [REFERENCE_METRIC], "filter_list": REFERENCE_FILTERS,
        "metadata": {"version": 3.0}, "dataset_path": "openai/gsm8k", "dataset_name": "main"}


SERVED = {"url": "http://127.0.0.1:8000", "model": "m"}  # what the deployment resolves


def _opt(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_command_lines():
    argv = cli.lm_eval_argv(cli.Gsm8kSettings(
        url="http://10.0.0.5:8000", model="moonshotai/Kimi-K3", max_gen_tokens=8192, limit=50))
    assert argv[:3] == ["/opt/clients/bin/python", "/out/lmeval_plugin/k3rocm_lmeval.py", "run"]
    assert _opt(argv, "--model") == "local-chat-completions"  # lm-eval's own
    assert dict(kv.split("=", 1) for kv in _opt(argv, "--model_args").split(",")) == {
        "model": "moonshotai/Kimi-K3", "base_url": "http://10.0.0.5:8000/v1/chat/completions",
        "num_concurrent": "32", "max_retries": "3", "timeout": "1800", "max_gen_toks": "8192",
        "tokenized_requests": "False"}
    assert (_opt(argv, "--tasks"), _opt(argv, "--num_fewshot"), _opt(argv, "--include_path"),
            _opt(argv, "--limit")) == ("gsm8k", "5", "/out/tasks", "50")
    # sampling only from the task file: lm-eval prints the reference's generation_kwargs
    assert "--gen_kwargs" not in argv and {"--apply_chat_template", "--log_samples"} <= set(argv)
    argv = cli.lm_eval_argv(cli.Gsm8kSettings(**SERVED, reasoning_fallback=True))
    assert _opt(argv, "--model") == "k3-chat-completions"
    argv = cli.lm_eval_argv(cli.Gsm8kSettings(**SERVED, mode="completions"))
    assert _opt(argv, "--model") == "local-completions"
    assert "base_url=http://127.0.0.1:8000/v1/completions" in _opt(argv, "--model_args")
    assert "tokenizer_backend=None" in _opt(argv, "--model_args")
    assert "--apply_chat_template" not in argv and "--limit" not in argv


@pytest.mark.parametrize("kw, fragment", [
    ({"url": "127.0.0.1:8000"}, "--url"),
    ({"url": "http://h:8000/v1"}, "has a path"),
    ({"max_gen_tokens": 0}, "--max-gen-tokens 0"),
    ({"timeout": 86401}, "--timeout 86401 is out of range; use 1..86400 seconds"),
    ({"threshold": 1.5}, "--threshold 1.5 is out of range; use 0 < x <= 1"),
    ({"limit": 0}, "--limit 0"),
    ({"model": " "}, "--model ' ' is empty"),
    ({"model": "a,b"}, "--model 'a,b' contains a comma, which lm-eval's --model_args cannot"),
    ({"mode": "completions", "reasoning_fallback": True}, "--reasoning-fallback needs --mode chat"),
])
def test_settings_validation(kw, fragment):
    with pytest.raises(UsageError, match=re.escape(fragment)):
        cli.Gsm8kSettings(**kw)


def test_dry_run_prints_the_command_with_or_without_data(k3, data_dir, tmp_path):
    """The same command line without data and with it; nothing contacted (a free port)."""
    server = ["--dry-run", "--url", f"http://127.0.0.1:{(port := free_port())}", "--model", "m"]
    code, out, err = k3("gsm8k", *server, "--hf-home", str(tmp_path / "empty"),
                        env={"HF_DATASETS_CACHE": str(tmp_path / "empty")})
    assert code == 0 and "data: none yet (no GSM8K data found" in err, err
    assert k3("gsm8k", *server, "--data-dir", str(data_dir))[:2] == (0, out)
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("/opt/clients/bin/python ")
    assert f"base_url=http://127.0.0.1:{port}/v1/chat/completions" in lines[0]


@pytest.mark.parametrize("argv, code, fragment", [
    (["--concurrency", "0", "--dry-run"], 2, "--concurrency 0"),
    (["--hf-home", "{tmp}/nothing"], 2, "k3rocm: error: no GSM8K data found"),
    (["--data-dir", "{data}"], 3, "nothing listening at http://127.0.0.1:"),
])
def test_bad_input_and_no_server_exit_with_one_line(k3, data_dir, tmp_path, argv, code,
                                                    fragment):
    argv = [a.format(tmp=tmp_path, data=data_dir) for a in argv]
    got, _, err = k3("gsm8k", "--url", f"http://127.0.0.1:{free_port()}", *argv,
                     env={"HF_DATASETS_CACHE": str(tmp_path / "nothing")})
    assert got == code and err.count("\n") == 1 and fragment in err, err


def test_make_gsm8k_data_cached_or_without_docker(k3, tmp_path):
    """Cached: nothing to do, no Docker engine needed. Not cached, no engine: exit 3 (make's 2;
    conftest.make_exit_code reads the recipe's), and a make failure without a recipe is not
    read as any k3rocm code."""
    hf, nosock = tmp_path / "hf", f"unix://{tmp_path}/no.sock"
    p = make("gsm8k-data", f"GSM8K_ARGS=--hf-home {hf}", DOCKER_HOST=nosock)
    assert p.returncode == 2 and make_exit_code(p) == 3, p.stderr
    assert "k3rocm: error: cannot reach the Docker engine" in p.stderr
    snap = hf / "hub" / data.HF_REPO_DIR / "snapshots" / "abc" / "main"
    snap.mkdir(parents=True)
    for split in ("train", "test"):
        (snap / f"{split}-00000-of-00001.parquet").write_bytes(b"PAR1")
    code, _, err = k3("gsm8k", "--fetch-data", "--hf-home", str(hf), env={"DOCKER_HOST": nosock})
    assert code == 0 and "gsm8k-data: already there: hf-hub-parquet at " in err
    with pytest.raises(AssertionError, match="without a recipe's exit code"):
        make_exit_code(make("no-such-target-k3"))


def test_reasoning_fallback_and_finish_reasons_logs(tmp_path):
    log = tmp_path / "fb.jsonl"
    resp = {"id": "c1", "choices": [
        {"index": 0, "message": {"content": None, "reasoning": "so 3+4=7\n#### 7"},
         "finish_reason": "stop"},
        {"index": 1, "message": {"content": "  ", "reasoning_content": "#### 8"}},
        {"index": 2, "message": {"content": "#### 9", "reasoning_content": "ignored"}},
        {"index": 3, "message": {"content": None}},
    ]}
    fixed = apply_reasoning_fallback([resp], str(log))
    assert [c["message"]["content"] for c in fixed[0]["choices"]] == [
        "so 3+4=7\n#### 7", "#### 8", "#### 9", None]
    assert resp["choices"][0]["message"]["content"] is None  # the input is not mutated
    assert [(x["index"], x["field"]) for x in map(json.loads, log.read_text().splitlines())] \
        == [(0, "reasoning"), (1, "reasoning_content")]
    log = tmp_path / "finish.jsonl"  # chat choices carry message.content, completions text
    log_finish_reasons([{"choices": [{"message": {"content": "#### 7"}, "finish_reason": "stop"}]},
                        {"choices": [{"message": {"content": "Let me"},
                                      "finish_reason": "length"}]}], str(log))
    log_finish_reasons({"choices": [{"text": " 12\n", "finish_reason": "length"}]}, str(log))
    assert [json.loads(x) for x in log.read_text().splitlines()] == [
        {"finish_reason": "stop", "text": "#### 7"}, {"finish_reason": "length", "text": "Let me"},
        {"finish_reason": "length", "text": " 12\n"}]


def stored_run(root: Path, strict: float, flex: float, *, original: int = 1319,
               effective: int | None = None, limit: int | None = None,
               fallback_docs: tuple[int, ...] = (), empty_docs: tuple[int, ...] = (),
               model: str = "local-chat-completions") -> Path:
    """A run directory as `k3rocm gsm8k` leaves it, with lm-eval 0.4.13's file shapes."""
    effective = original if effective is None else effective
    run = root / "20261202T171915Z-gsm8k"
    out = run / "lm_eval" / "moonshotai__Kimi-K3"
    out.mkdir(parents=True)
    stamp = "2026-12-02T17-19-28.635470"

    def se(p: float) -> float:
        return (p * (1 - p) / max(effective - 1, 1)) ** 0.5

    res = {
        "results": {"gsm8k": {
            "alias": "gsm8k", "exact_match,strict-match": strict,
            "exact_match_stderr,strict-match": se(strict), "exact_match,flexible-extract": flex,
            "exact_match_stderr,flexible-extract": se(flex)}},
        "n-shot": {"gsm8k": 5}, "versions": {"gsm8k": 3.0},
        "n-samples": {"gsm8k": {"original": original, "effective": effective}},
        "config": {"model": model, "model_args": {"model": "moonshotai/Kimi-K3"},
                   "batch_size": 1, "limit": limit},
        "lm_eval_version": "0.4.13", "date": 1796231968.0,
    }
    (out / f"results_{stamp}.json").write_text(json.dumps(res))
    fb_lines = []
    with open(out / f"samples_gsm8k_{stamp}.jsonl", "w") as fh:
        for doc in range(effective):
            text = f"The answer is {doc}.\n#### {doc}"
            if doc in fallback_docs:
                text = f"Reasoning about item {doc}... so it is {doc}.\n#### {doc}"
                fb_lines.append({"id": f"chatcmpl-{doc}", "index": 0, "content": None,
                                 "field": "reasoning", "finish_reason": "stop", "text": text})
            # lm-eval 0.4.13 logs a null content as "" (filtered "[invalid]", scored 0)
            text, got, em = ("", "[invalid]", 0.0) if doc in empty_docs else (text, str(doc), 1.0)
            for filt in ("strict-match", "flexible-extract"):
                fh.write(json.dumps({"doc_id": doc, "filter": filt, "resps": [[text]],
                                     "filtered_resps": [got], "exact_match": em}) + "\n")
    (run / "reasoning_fallback.jsonl").write_text("".join(json.dumps(x) + "\n" for x in fb_lines))
    return run


def rescore(k3, run: Path, *extra: str) -> tuple[int, dict, str]:
    code, out, err = k3("gsm8k", "--rescore", str(run), *extra)
    return code, json.loads(out), err.strip()


@pytest.mark.parametrize("strict, flex, kw, extra, code, status, fragment", [
    (0.9629, 0.9651, {}, (), 0, "pass", "gsm8k: PASS: strict-match 0.9629 +- 0.0052, "
     "flexible-extract 0.9651 +- 0.0051 >= gate 0.94; reference 0.9644 +- 0.0051"),
    (0.9310, 0.9651, {}, (), 1, "below_gate", "gsm8k: FAIL: below the gate 0.94 (strict-match)"),
    (0.9310, 0.9351, {}, ("--threshold", "0.92"), 0, "pass", ">= gate 0.92"),
    (1.0, 1.0, {"original": 5}, (), 1, "not_comparable",
     "the test set has 5 items, GSM8K's test split has 1319"),
    (0.98, 0.98, {"effective": 100, "limit": 100}, (), 1, "not_comparable",
     "gsm8k: NOT A PASS: "),
    (0.98, 0.98, {"effective": 100, "limit": 100}, ("--allow-limit",), 0, "pass",
     "not comparable: --limit 100: 100 of 1319 test items"),
])
def test_gate(k3, tmp_path, strict, flex, kw, extra, code, status, fragment):
    c, v, msg = rescore(k3, stored_run(tmp_path, strict, flex, **kw), *extra)
    assert (c, v["status"], v["passed"]) == (code, status, code == 0), msg
    assert fragment in msg
    assert v["comparable"] == (not kw) and v["like_reference"] == (not kw)
    assert v["metrics"]["flexible-extract"]["reaches_gate"]


def test_reasoning_fallback_is_counted_as_a_deviation(k3, tmp_path):
    run = stored_run(tmp_path, 0.9629, 0.9651, fallback_docs=(3, 17, 1200),
                     model="k3-chat-completions")
    code, v, msg = rescore(k3, run)
    assert code == 0
    assert v["reasoning_fallback"] == {"enabled": True, "count": 3, "of": 1319,
                                       "responses_logged": 3, "doc_ids": [3, 17, 1200]}
    assert msg.endswith("DEVIATION from the reference protocol: 3 answer(s) scored from the "
                        "reasoning text (content empty, --reasoning-fallback)")
    assert v["comparable"] and not v["like_reference"] and len(v["deviations_from_reference"]) == 1
    md = results.markdown(v)
    assert "| strict-match | 0.9629 | ± 0.0052 | 0.9644 ± 0.0051 | >= 0.94 | reaches gate |" in md
    assert "Reasoning fallback: on (a deviation from the reference protocol)" in md


@pytest.mark.parametrize("model, counted", [("local-chat-completions", True),
                                            ("local-completions", False)])
def test_an_empty_content_is_an_empty_answer_counted(k3, tmp_path, model, counted):
    """The reference protocol (no --reasoning-fallback): a reasoning model's empty content is an
    empty answer, scored wrong and counted; the message points to --reasoning-fallback. The
    samples are as lm-eval 0.4.13 logged a null content from vLLM 0.32's reasoning parser."""
    code, v, msg = rescore(k3, stored_run(tmp_path, 0.9, 0.9, original=20, empty_docs=(4, 9),
                                      model=model), "--allow-limit")
    assert v["empty_responses"] == 2 and v["reasoning_fallback"]["count"] == 0
    assert not v["reasoning_fallback"]["enabled"] and v["lm_eval"]["model"] == model
    assert ("2 empty answer(s) scored as wrong" in msg) == counted, msg
    assert ("see --reasoning-fallback" in msg) == counted


def test_rescore_without_results_exits_2(k3, tmp_path):
    (tmp_path / "run" / "lm_eval").mkdir(parents=True)
    code, _, err = k3("gsm8k", "--rescore", str(tmp_path / "run"))
    assert code == 2 and err.startswith("k3rocm: error: no lm-eval results file")


def test_truncated_answers_are_reported_apart_from_wrong_ones(k3, tmp_path):
    run = stored_run(tmp_path, 0.9629, 0.9651, original=20)
    assert rescore(k3, run)[1]["truncated"]["recorded"] is False  # no finish log
    samples = results.load_run(run)[1]
    texts = {s["doc_id"]: results._first_response(s) for s in samples}
    (run / "finish_reasons.jsonl").write_text("".join(
        json.dumps({"finish_reason": "length" if d in (3, 7) else "stop", "text": t}) + "\n"
        for d, t in texts.items()))
    code, v, msg = rescore(k3, run, "--allow-limit")
    t = v["truncated"]
    assert t["count"] == 2 and t["of"] == 20 and t["rate"] == pytest.approx(0.1)
    assert t["doc_ids"] == [3, 7] and t["accuracy_without_truncated"] == 1.0
    assert "2 of 20 answer(s) cut off at the generation limit" in msg
    all_cut = [{"finish_reason": "length", "text": x} for x in texts.values()]
    assert results.truncation(samples, all_cut, 32)["accuracy_without_truncated"] is None


def test_the_pass_rate_is_exact_for_the_verdicts_own_bound():
    """Against brute force at n = 40: every outcome, weighted exactly, judged by
    paired_accuracy itself."""
    n, d, drop, margin = 40, 0.2, 0.05, 0.1
    pa, pb = (d + drop) / 2, (d - drop) / 2
    want = 0.0
    for ao in range(n + 1):
        for bo in range(n + 1 - ao):
            w = comb(n, ao) * comb(n - ao, bo) * pa ** ao * pb ** bo * (1 - d) ** (n - ao - bo)
            a = [True] * ao + [False] * bo + [True] * (n - ao - bo)
            b = [False] * ao + [True] * bo + [True] * (n - ao - bo)
            want += w * stats.paired_accuracy(a, b, margin)["non_inferior"]
    assert stats.noninferiority_pass_rate(n, margin, d, drop) == pytest.approx(want, abs=1e-9)


def test_the_default_margin_comes_from_its_stated_power():
    """The smallest margin on a 0.05-point grid with which identical arms pass >= 90% at 98%
    agreement on 1319 items; its false-pass price for a 1-point drop: 13.9%."""
    rate = stats.noninferiority_pass_rate
    d = 1 - ab.DESIGN_AGREEMENT
    assert ab.DESIGN_POWER == 0.90 and ab.DESIGN_AGREEMENT == 0.98
    assert rate(1319, ab.DEFAULT_MARGIN, d) >= ab.DESIGN_POWER
    assert rate(1319, ab.DEFAULT_MARGIN - 0.0005, d) < ab.DESIGN_POWER
    assert rate(1319, ab.DEFAULT_MARGIN, d, ab.DROP) == pytest.approx(0.139, abs=0.001)
    assert 1 - rate(1319, 0.01, 0.04) == pytest.approx(0.429, abs=0.001)


def _samples(right: list[bool]) -> list[dict]:
    return [{"doc_id": d, "filter": f, "resps": [[f"#### {d}"]], "exact_match": float(ok)}
            for d, ok in enumerate(right) for f in results.FILTERS]


def test_gsm8k_ab_pairs_the_items_and_gates_on_non_inferiority():
    a = [True] * 1272 + [False] * 47
    same = list(a)
    for i in range(12):
        same[i], same[1272 + i] = False, True
    comp = ab.compare(_samples(a), _samples(same), margin=0.01)
    r = comp["filters"]["strict-match"]
    assert comp["verdict"] == "NON-INFERIOR" and r["n"] == 1319 and r["mcnemar_p"] == 1.0
    assert r["b_only"] == r["a_only"] == 12 and 0.8 < r["power_full"] < 0.9
    assert "McNemar exact p=1" in comp["headline"] and "at n=1319" in comp["headline"]
    # the price of the margin, printed: how often a B one point less accurate passes here
    assert 0.04 < r["false_pass"] < 0.08 and r["false_pass_drop"] == 0.01  # margin 1 point
    assert f"a B 1 point less accurate would pass {r['false_pass']:.0%}" in comp["headline"]
    md = ab.markdown(ab.compare(_samples(a), _samples(same), margin=ab.DEFAULT_MARGIN))
    assert "false pass at -1 point" in md and "pass >= 90% of the time at 98% agreement" in md
    broken = [x and i >= 400 for i, x in enumerate(a)]  # B loses 400 items: no OverflowError
    comp = ab.compare(_samples(a), _samples(broken), margin=0.012)
    assert comp["verdict"] == "NOT SHOWN NON-INFERIOR" and "400 only in A" in comp["headline"]
    worse = [x and i >= 30 for i, x in enumerate(a)]  # B loses 30 items: -2.3 points
    comp = ab.compare(_samples(a), _samples(worse), margin=0.01)
    assert comp["verdict"] == "NOT SHOWN NON-INFERIOR"
    assert comp["filters"]["strict-match"]["mcnemar"] == "B less accurate"
    assert "| strict-match | 1319 |" in ab.markdown(comp)
    with pytest.raises(UsageError, match="different items"):
        ab.compare(_samples(a), _samples(a[:100]), 0.01)


def test_make_gsm8k_ab_dry_run_and_bad_input(k3):
    p = make("gsm8k-ab", "DRY_RUN=1", "CPU=1")
    assert make_exit_code(p) == 0, p.stderr
    lines = p.stdout.splitlines()
    assert [ln.split()[4] for ln in lines if ln.startswith("# slot")] == ["A:", "B:"]
    assert sum("k3rocm_lmeval.py run" in ln for ln in lines) == 2
    code, _, err = k3("ab", "--measure", "gsm8k", "--dry-run", "--no-gpu", "--repeats", "2")
    assert code == 2 and "use --repeats 1" in err.strip().splitlines()[-1]


def test_no_discordant_items_is_no_proof_on_a_handful_of_items():
    """Five identical answers (the stand-in) are no proof within 1 point, nor a power; 1319
    may be."""
    comp = ab.compare(_samples([False] * 5), _samples([False] * 5), 0.01)
    assert comp["filters"]["strict-match"]["power_full"] is None
    assert comp["filters"]["strict-match"]["non_inferior"] is False
    assert comp["filters"]["strict-match"]["lower_bound"] < -0.4
    assert "power of the margin n/a (no discordant items)" in comp["headline"]
    full = stats.paired_accuracy([True] * 1200 + [False] * 119, [True] * 1200 + [False] * 119, 0.01)
    assert full["non_inferior"] is True


def _gsm8k_ab_live(tmp_path, monkeypatch, server_logs: dict[str, str]):
    """gsm8k-ab's live path without Docker: the one slot loop of checks/ab with fake arm servers
    (server log ``server_logs[arm]``) and `k3rocm gsm8k`'s run replaced by a stored run."""
    import contextlib
    from types import SimpleNamespace

    from k3rocm.checks.ab import arms as armlib
    from k3rocm.checks.ab import cli as abcli
    from k3rocm.checks.gsm8k import ab, cli

    monkeypatch.delenv("COMPOSE_FILE", raising=False)
    started, executed = [], []

    def fake_start(arms, results, label, runs_per_slot=1, client_image=None, dep=None):
        started.append((label, client_image))
        d = results / f"20260101T000000Z-{label}"
        d.mkdir(parents=True)
        return armlib.Run(arms, SimpleNamespace(), "img", "sha256:0", "m", None, d)

    @contextlib.contextmanager
    def fake_server(self, slot, arm, log_path):  # info as Run.server yields it
        yield (SimpleNamespace(container=lambda client: SimpleNamespace(name=f"c{slot}")),
               {"server": f"k3ab-x-{slot:02d}{arm.lower()}", "server_ready_s": 1.0,
                "deployment": armlib.arm_deployment(self.arms, arm)})
        log_path.write_text(server_logs[arm])

    def fake_execute(client, s, src, dep, run_dir, server_container):
        # the run record's deployment is the arm's (its switches), not this shell's
        executed.append((run_dir.parent.name, dep.rendered.env["K3_FUSE_QK_NORM"]))
        shutil.copytree(stored_run(tmp_path / f"stored-{len(executed)}", 0.95, 0.95), run_dir,
                        dirs_exist_ok=True)
        return 0

    monkeypatch.setattr(armlib, "start", fake_start)
    monkeypatch.setattr(armlib.Run, "server", fake_server)
    monkeypatch.setattr(cli, "execute", fake_execute)
    monkeypatch.setattr(ab.data, "resolve", lambda *a: SimpleNamespace())
    args = parse(["ab", "--measure", "gsm8k", "--no-gpu", "--results", str(tmp_path),
                  "--models-dir", str(tmp_path)])
    code = abcli.run(args)
    assert started == [("gsm8k-ab", args.client_image)]
    assert executed == [("00-A", "0"), ("01-B", "1")]
    return code, tmp_path / "20260101T000000Z-gsm8k-ab"


RECORDS = Path(__file__).parent / "data" / "census" / "records"


def test_gsm8k_ab_runs_each_arm_in_the_one_loop(tmp_path, monkeypatch):
    """Each arm's run in ``<run>/NN-<arm>/`` beside its server log; arm B's decision records say
    what it asked; arm A's stock log has none, which the report notes."""
    logs = {"A": (RECORDS / "server-stock.log").read_text(),
            "B": (RECORDS / "server-on.log").read_text()}
    code, run = _gsm8k_ab_live(tmp_path, monkeypatch, logs)
    assert code == 0
    assert (run / "00-A" / "server.log").is_file() and (run / "01-B" / "server.log").is_file()
    comp = json.loads((run / "comparison.json").read_text())
    assert comp["slots"] == ["A", "B"] and comp["verdict"] == "NON-INFERIOR"
    assert comp["fusion_problems"] == [  # a note, not a refusal (as in bench-ab)
        "slot 0 (arm A): no overlay decision records in its server log (fusion state "
        "unverified)"]
    a_dir = Path(comp["arms"]["A"]["run_dir"])  # the gsm8k run directory the driver created
    assert a_dir.parent == run / "00-A" and a_dir.name.endswith("-gsm8k"), a_dir
    assert (a_dir / "lm_eval" / "moonshotai__Kimi-K3").is_dir()  # what lm-eval wrote there
    assert "| strict-match | 1319 |" in (run / "comparison.md").read_text()


def test_gsm8k_ab_whose_on_arm_ran_without_a_fusion_is_invalid(tmp_path, monkeypatch):
    """Arm B's server turned decode Q-prep off at load: no verdict (exit 1), and why."""
    logs = {"A": (RECORDS / "server-stock.log").read_text(),
            "B": (RECORDS / "server-qprep-off-after-load.log").read_text()}
    code, run = _gsm8k_ab_live(tmp_path, monkeypatch, logs)
    comp = json.loads((run / "comparison.json").read_text())
    assert code == 1 and comp["verdict"] == "INVALID"
    assert comp["fusion_problems"][1].startswith("slot 1 (arm B): decode_qprep asked on, the "
                                                  "overlay decided")
    md = (run / "comparison.md").read_text()
    assert "**INVALID** - an arm's fusions are not what it asked" in md
    assert "- fusion check: slot 1 (arm B): decode_qprep asked on" in md
