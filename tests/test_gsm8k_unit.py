"""gsm8k without a server: data checks, the lm-eval command line, and the gate on stored results.

The stored results below have the shape lm-eval 0.4.13 writes (captured from a real run against
the CPU stand-in: results_<ts>.json + samples_gsm8k_<ts>.jsonl under lm_eval/<model>/); the
verdicts are checked through the real CLI (`k3rocm gsm8k --rescore RUN_DIR`).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, free_port, make_exit_code, run_cli

from k3rocm.checks.gsm8k import command, data, results
from k3rocm.checks.gsm8k.lmeval_launch import apply_reasoning_fallback
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


# ---------------------------------------------------------------------------------- data


def test_local_data_dir_is_checked_and_described(data_dir):
    src = data.resolve(str(data_dir), None)
    assert src.kind == "local-jsonl" and src.builder == "json" and src.test_items == 4
    assert src.files == {"train": "/data/gsm8k/train.jsonl", "test": "/data/gsm8k/test.jsonl"}
    prov = src.provenance()
    assert prov["files"]["test"]["sha256"] == data.sha256_file(data_dir / "test.jsonl")


@pytest.mark.parametrize("line, fragment", [
    ("not json", "is not JSON"),
    (json.dumps({"question": "q"}), "needs string fields question and answer"),
    (json.dumps({"question": "q", "answer": "no marker 4"}), "does not end in '#### <number>'"),
])
def test_bad_item_names_file_and_line(data_dir, line, fragment):
    with open(data_dir / "test.jsonl", "a") as fh:
        fh.write(line + "\n")
    with pytest.raises(UsageError, match=fragment) as exc:
        data.resolve(str(data_dir), None)
    assert "test.jsonl:5" in str(exc.value)


def test_too_few_fewshot_items(data_dir):
    write_items(data_dir / "train.jsonl", 3)
    with pytest.raises(UsageError, match="5-shot needs at least 5"):
        data.resolve(str(data_dir), None)


def test_no_data_anywhere_says_how_to_provide_it(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    with pytest.raises(UsageError) as exc:
        data.resolve(None, str(tmp_path / "empty-hf"))
    msg = str(exc.value)
    assert "\n" not in msg and "--data-dir" in msg and "huggingface-cli download openai/gsm8k" \
        in msg


def test_hf_hub_snapshot_is_used_offline(tmp_path):
    repo = tmp_path / "hf" / "hub" / data.HF_REPO_DIR
    rev = "e53f048856ff4f594e959d75785d2c2d37b678ee"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    snap = repo / "snapshots" / rev / "main"
    snap.mkdir(parents=True)
    blobs = repo / "blobs"
    blobs.mkdir()
    for split in ("train", "test"):  # the hub cache layout: snapshot links into blobs/
        (blobs / split).write_bytes(b"PAR1")
        (snap / f"{split}-00000-of-00001.parquet").symlink_to(f"../../../blobs/{split}")
    src = data.resolve(None, str(tmp_path / "hf"))
    assert src.kind == "hf-hub-parquet" and src.builder == "parquet"
    assert src.host_dir == repo.resolve()
    assert src.files["test"] == f"/hf/hub/{data.HF_REPO_DIR}/snapshots/{rev}/main/" \
        "test-00000-of-00001.parquet"
    assert "dataset_path: parquet" in data.task_yaml(src)


def test_datasets_arrow_cache_uses_the_shipped_task_as_is(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    d = tmp_path / "hf" / "datasets" / data.ARROW_DIR / "main" / "0.0.0" / "abc"
    d.mkdir(parents=True)
    (d / "gsm8k-test.arrow").write_bytes(b"x")
    src = data.resolve(None, str(tmp_path / "hf"))
    assert src.kind == "hf-datasets-cache" and src.builder is None
    assert data.task_yaml(src) == data.TASK_FILE.read_text()
    s = command.Gsm8kSettings(**SERVED)
    argv = command.lm_eval_argv(s)
    assert argv[argv.index("--include_path") + 1] == "/out/tasks"
    assert command.container_env(s, src)["HF_HOME"] == "/hf"
    assert command.container_env(s, src)["HF_DATASETS_OFFLINE"] == "1"


# ------------------------------------------------------------------- the seed's task config

# Typed from the task config the upstream PR printed (vLLM PR #52494: lm-eval task `gsm8k`, metadata
# version 3.0), not read from our YAML.
SEED_DOC_TO_TEXT = ("Question: {{question}}\nEnd your response with the answer on the last line, "
                    "formatted as: #### [number]\nAnswer:")
SEED_METRIC = {"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
               "ignore_case": True, "ignore_punctuation": False,
               "regexes_to_ignore": [",", "\\$", "(?s).*#### ", "\\.$"]}
SEED_FILTERS = [
    {"name": "strict-match", "filter": [
        {"function": "regex", "regex_pattern": r"#### (\-?[0-9\.\,]+)"},
        {"function": "take_first"}]},
    {"name": "flexible-extract", "filter": [
        {"function": "regex", "group_select": -1, "regex_pattern": r"(-?[$0-9.,]{2,})|(-?[0-9]+)"},
        {"function": "take_first"}]},
]


def test_shipped_task_is_the_seeds_field_by_field():
    t = yaml.safe_load(data.TASK_FILE.read_text())
    assert t["task"] == "gsm8k"  # results keyed results.gsm8k, as the gate reads them
    assert t["doc_to_text"] == SEED_DOC_TO_TEXT
    assert t["doc_to_target"] == "{{answer}}"
    assert t["output_type"] == "generate_until"
    assert t["generation_kwargs"] == {"until": ["</s>", "<|im_end|>"], "do_sample": False,
                                      "temperature": 0.0}
    assert "Question:" not in t["generation_kwargs"]["until"]  # lm-eval 0.4.13's built-in adds it
    assert t["num_fewshot"] == 5
    assert t["fewshot_split"] == "train" and t["training_split"] == "train"
    assert t["test_split"] == "test"
    assert t["metric_list"] == [SEED_METRIC]
    assert t["filter_list"] == SEED_FILTERS
    assert t["metadata"] == {"version": 3.0}
    assert (t["dataset_path"], t["dataset_name"]) == ("openai/gsm8k", "main")
    assert t["repeats"] == 1
    known = {"task", "doc_to_text", "doc_to_target", "output_type", "generation_kwargs",
             "num_fewshot", "fewshot_split", "training_split", "test_split", "metric_list",
             "filter_list", "metadata", "dataset_path", "dataset_name", "repeats"}
    assert set(t) == known, set(t) ^ known  # nothing else slipped in (a tag, a fewshot_config)


def test_run_task_file_changes_only_the_data_source(data_dir):
    shipped = yaml.safe_load(data.TASK_FILE.read_text())
    run = yaml.safe_load(data.task_yaml(data.resolve(str(data_dir), None)))
    assert run["dataset_path"] == "json" and "dataset_name" not in run
    assert run["dataset_kwargs"] == {"data_files": {"train": "/data/gsm8k/train.jsonl",
                                                    "test": "/data/gsm8k/test.jsonl"}}
    keep = {k: v for k, v in shipped.items() if not k.startswith("dataset_")}
    assert {k: v for k, v in run.items() if not k.startswith("dataset_")} == keep


# ------------------------------------------------------------------------------- command
SERVED = {"url": "http://127.0.0.1:8000", "model": "m"}  # what the deployment resolves


def test_chat_command_line():
    s = command.Gsm8kSettings(url="http://10.0.0.5:8000", model="moonshotai/Kimi-K3",
                              concurrency=32, max_gen_tokens=8192, limit=50)
    argv = command.lm_eval_argv(s)
    assert argv[:3] == ["/opt/clients/bin/python", "/out/lmeval_plugin/k3rocm_lmeval.py", "run"]
    opts = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert argv[argv.index("--model") + 1] == "local-chat-completions"  # lm-eval's own
    margs = dict(kv.split("=", 1) for kv in argv[argv.index("--model_args") + 1].split(","))
    assert margs == {"model": "moonshotai/Kimi-K3",
                     "base_url": "http://10.0.0.5:8000/v1/chat/completions",
                     "num_concurrent": "32", "max_retries": "3", "timeout": "1800",
                     "max_gen_toks": "8192", "tokenized_requests": "False"}
    assert opts["--tasks"] == "gsm8k" and opts["--num_fewshot"] == "5"
    # Sampling comes from the task file only, so lm-eval prints the seed's generation_kwargs.
    assert "--gen_kwargs" not in argv
    assert "--apply_chat_template" in argv
    assert argv[argv.index("--include_path") + 1] == "/out/tasks"
    assert argv[argv.index("--limit") + 1] == "50"
    assert "--log_samples" in argv


def test_completions_command_line():
    s = command.Gsm8kSettings(**SERVED, mode="completions")
    argv = command.lm_eval_argv(s)
    assert argv[argv.index("--model") + 1] == "local-completions"
    margs = argv[argv.index("--model_args") + 1]
    assert "base_url=http://127.0.0.1:8000/v1/completions" in margs
    assert "tokenizer_backend=None" in margs and "tokenized_requests=False" in margs
    assert "--apply_chat_template" not in argv and "--limit" not in argv


@pytest.mark.parametrize("kw, fragment", [
    ({"url": "127.0.0.1:8000"}, "--url"),
    ({"url": "http://h:8000/v1"}, "has a path"),
    ({"concurrency": 0}, "--concurrency 0"),
    ({"max_gen_tokens": 0}, "--max-gen-tokens 0"),
    ({"timeout": 86401}, "--timeout 86401 is out of range; use 1..86400 seconds"),
    ({"threshold": 1.5}, "--threshold 1.5 is out of range; use 0 < x <= 1"),
    ({"limit": 0}, "--limit 0"),
    ({"model": " "}, "--model ' ' is empty"),
    ({"mode": "completions", "reasoning_fallback": True}, "--reasoning-fallback needs --mode chat"),
])
def test_settings_validation(kw, fragment):
    with pytest.raises(UsageError, match=re.escape(fragment)):
        command.Gsm8kSettings(**kw)


def test_dry_run_prints_the_command_and_contacts_nothing(data_dir):
    port = free_port()  # nothing listens here: a contact attempt would fail the run
    p = run_cli("gsm8k", "--dry-run", "--url", f"http://127.0.0.1:{port}", "--model", "m",
                "--data-dir", str(data_dir), "--limit", "3")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("/opt/clients/bin/python ")
    assert f"base_url=http://127.0.0.1:{port}/v1/chat/completions" in lines[0]
    assert "--limit 3" in lines[0]


def test_dry_run_without_data_prints_the_same_command(data_dir, tmp_path):
    """Before `make gsm8k-data` the command is already known: it does not name the data."""
    common = ("gsm8k", "--dry-run", "--url", "http://127.0.0.1:8000", "--model", "m")
    without = run_cli(*common, "--hf-home", str(tmp_path / "empty"),
                      env={"HF_DATASETS_CACHE": str(tmp_path / "empty")})
    assert without.returncode == 0, without.stderr
    assert "data: none yet (no GSM8K data found" in without.stderr
    assert "make gsm8k-data" in without.stderr
    with_data = run_cli(*common, "--data-dir", str(data_dir))
    assert with_data.returncode == 0 and without.stdout == with_data.stdout
    assert "--include_path /out/tasks --tasks gsm8k" in without.stdout


def test_reasoning_fallback_is_off_unless_asked():
    argv = command.lm_eval_argv(command.Gsm8kSettings(**SERVED))
    assert argv[argv.index("--model") + 1] == "local-chat-completions"
    argv = command.lm_eval_argv(command.Gsm8kSettings(**SERVED, reasoning_fallback=True))
    assert argv[argv.index("--model") + 1] == "k3-chat-completions"
    p = run_cli("gsm8k", "--dry-run", "--mode", "completions", "--reasoning-fallback")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "needs --mode chat" in p.stderr


def test_fetch_data_when_already_cached_needs_nothing(tmp_path):
    hf = tmp_path / "hf"
    snap = hf / "hub" / data.HF_REPO_DIR / "snapshots" / "abc" / "main"
    snap.mkdir(parents=True)
    for split in ("train", "test"):
        (snap / f"{split}-00000-of-00001.parquet").write_bytes(b"PAR1")
    # No Docker engine at that address: the cached data set must not need one.
    p = run_cli("gsm8k", "--fetch-data", "--hf-home", str(hf),
                env={"DOCKER_HOST": f"unix://{tmp_path}/no.sock"})
    assert p.returncode == 0, p.stderr
    assert p.stderr.startswith("gsm8k-data: already there: hf-hub-parquet at ")


def test_fetch_data_without_docker_exits_3_with_one_line(tmp_path):
    p = run_cli("gsm8k", "--fetch-data", "--hf-home", str(tmp_path / "hf"),
                env={"DOCKER_HOST": f"unix://{tmp_path}/no.sock"})
    # The exit-code table (k3rocm.errors): no Docker engine is an engine problem, 3.
    assert p.returncode == 3 and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith("k3rocm: error: cannot reach the Docker engine")


def test_make_gsm8k_dry_run(data_dir):
    env = {"PYTHONPATH": str(REPO / "src")}
    p = subprocess.run(["make", "-s", "-o", sys.executable, "gsm8k", "DRY_RUN=1",
                        f"PY={sys.executable}", f"GSM8K_DATA={data_dir}",
                        "GSM8K_ARGS=--model m --concurrency 3"],
                       cwd=REPO, capture_output=True, text=True, timeout=60,
                       env={**_clean_env(), **env})
    assert make_exit_code(p) == 0, p.stderr
    assert "num_concurrent=3" in p.stdout and "--include_path /out/tasks" in p.stdout


def test_make_exit_code_is_the_recipes_not_makes(tmp_path):
    """Through make, k3rocm's 3 (no Docker engine) reaches a test as make's 2, which is our
    "bad input": conftest.make_exit_code gives the recipe's 3; a make failure that ran no
    recipe (no such target) is not read as any k3rocm code."""
    p = subprocess.run(["make", "-s", "-o", sys.executable, "gsm8k-data", f"PY={sys.executable}",
                        f"GSM8K_ARGS=--hf-home {tmp_path / 'hf'}"],
                       cwd=REPO, capture_output=True, text=True, timeout=60,
                       env={**_clean_env(), "PYTHONPATH": str(REPO / "src"),
                            "DOCKER_HOST": f"unix://{tmp_path}/no.sock"})
    assert p.returncode == 2 and make_exit_code(p) == 3, p.stderr
    assert "k3rocm: error: cannot reach the Docker engine" in p.stderr
    p = subprocess.run(["make", "-s", "no-such-target-k3"], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    with pytest.raises(AssertionError, match="without a recipe's exit code"):
        make_exit_code(p)


def _clean_env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("K3_")}


def test_missing_data_exits_2_with_one_line(tmp_path):
    p = run_cli("gsm8k", "--hf-home", str(tmp_path / "nothing"), "--url", "http://127.0.0.1:9",
                env={"HF_DATASETS_CACHE": str(tmp_path / "nothing")})
    assert p.returncode == 2
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("k3rocm: error: no GSM8K data found"), p.stderr
    assert "Traceback" not in p.stderr


def test_unreachable_server_exits_3_with_one_line(data_dir):
    port = free_port()
    p = run_cli("gsm8k", "--url", f"http://127.0.0.1:{port}", "--data-dir", str(data_dir))
    assert p.returncode == 3
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and f"nothing listening at http://127.0.0.1:{port}" in err[0], p.stderr
    assert "`make up`" in err[0] and "--url" in err[0], p.stderr


def test_bad_setting_exits_2_before_anything(data_dir):
    p = run_cli("gsm8k", "--concurrency", "0", "--data-dir", str(data_dir), "--dry-run")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "--concurrency 0" in p.stderr


# ------------------------------------------------------------------- reasoning fallback


def test_reasoning_fallback_rewrites_only_empty_contents(tmp_path):
    log = tmp_path / "fb.jsonl"
    resp = {"id": "c1", "choices": [
        {"index": 0, "message": {"content": None, "reasoning": "so 3+4=7\n#### 7"},
         "finish_reason": "stop"},
        {"index": 1, "message": {"content": "  ", "reasoning_content": "#### 8"}},
        {"index": 2, "message": {"content": "#### 9", "reasoning_content": "ignored"}},
        {"index": 3, "message": {"content": None}},
    ]}
    fixed = apply_reasoning_fallback([resp], str(log))
    contents = [c["message"]["content"] for c in fixed[0]["choices"]]
    assert contents == ["so 3+4=7\n#### 7", "#### 8", "#### 9", None]
    assert resp["choices"][0]["message"]["content"] is None  # the input is not mutated
    logged = [json.loads(x) for x in log.read_text().splitlines()]
    assert [(x["index"], x["field"]) for x in logged] == [(0, "reasoning"),
                                                          (1, "reasoning_content")]


# ----------------------------------------------------------- gate on stored results files


def stored_run(root: Path, strict: float, flex: float, *, original: int = 1319,
               effective: int | None = None, limit: int | None = None,
               fallback_docs: tuple[int, ...] = (),
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
            "alias": "gsm8k", "name": "gsm8k", "sample_len": effective,
            "exact_match,strict-match": strict, "exact_match_stderr,strict-match": se(strict),
            "exact_match,flexible-extract": flex,
            "exact_match_stderr,flexible-extract": se(flex)}},
        "group_subtasks": {"gsm8k": []}, "n-shot": {"gsm8k": 5},
        "versions": {"gsm8k": 3.0}, "higher_is_better": {"gsm8k": {"exact_match": True}},
        "n-samples": {"gsm8k": {"original": original, "effective": effective}},
        "config": {"model": model,
                   "model_args": {"model": "moonshotai/Kimi-K3", "num_concurrent": 16},
                   "batch_size": 1, "limit": limit,
                   "gen_kwargs": {"temperature": 0, "do_sample": False, "max_gen_toks": 4096}},
        "lm_eval_version": "0.4.13", "date": 1796231968.0,
        "total_evaluation_time_seconds": "812.4",
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
            for filt in ("strict-match", "flexible-extract"):
                fh.write(json.dumps({"doc_id": doc, "filter": filt, "resps": [[text]],
                                     "filtered_resps": [str(doc)], "exact_match": 1.0}) + "\n")
    with open(run / "reasoning_fallback.jsonl", "w") as fh:
        for line in fb_lines:
            fh.write(json.dumps(line) + "\n")
    return run


def rescore(run: Path, *extra: str) -> tuple[int, dict, str]:
    p = run_cli("gsm8k", "--rescore", str(run), *extra)
    assert "Traceback" not in p.stderr
    return p.returncode, json.loads(p.stdout), p.stderr.strip()


def test_gate_pass(tmp_path):
    code, v, msg = rescore(stored_run(tmp_path, 0.9629, 0.9651))
    assert code == 0 and v["status"] == "pass" and v["comparable"]
    assert msg.startswith("gsm8k: PASS: strict-match 0.9629 +- 0.0052, flexible-extract 0.9651")
    assert "reference 0.9644 +- 0.0051" in msg
    assert v["metrics"]["strict-match"]["stderr"] == pytest.approx(0.0052, abs=1e-4)


def test_gate_fail_when_either_filter_is_below(tmp_path):
    code, v, msg = rescore(stored_run(tmp_path, 0.9310, 0.9651))
    assert code == 1 and v["status"] == "below_gate" and not v["passed"]
    assert msg.startswith("gsm8k: FAIL: below the gate 0.94 (strict-match)")
    assert v["metrics"]["flexible-extract"]["reaches_gate"]
    assert not v["metrics"]["strict-match"]["reaches_gate"]


def test_threshold_is_configurable(tmp_path):
    code, v, _ = rescore(stored_run(tmp_path, 0.9310, 0.9351), "--threshold", "0.92")
    assert code == 0 and v["threshold"] == 0.92


def test_limit_run_is_not_comparable_and_does_not_pass(tmp_path):
    run = stored_run(tmp_path, 0.98, 0.98, effective=100, limit=100)
    code, v, msg = rescore(run)
    assert code == 1 and v["status"] == "not_comparable" and not v["comparable"]
    assert "--limit 100: 100 of 1319 test items" in v["not_comparable_reasons"]
    assert msg.startswith("gsm8k: NOT A PASS:") and "--allow-limit" in msg
    code, v, msg = rescore(run, "--allow-limit")
    assert code == 0 and v["status"] == "pass" and not v["comparable"]
    assert "not comparable: --limit 100" in msg


def test_small_test_set_is_not_comparable(tmp_path):
    code, v, _ = rescore(stored_run(tmp_path, 1.0, 1.0, original=5))
    assert code == 1 and v["status"] == "not_comparable"
    assert v["not_comparable_reasons"] == ["the test set has 5 items, GSM8K's test split has 1319"]


def test_reasoning_fallback_is_counted(tmp_path):
    run = stored_run(tmp_path, 0.9629, 0.9651, fallback_docs=(3, 17, 1200),
                     model="k3-chat-completions")
    code, v, msg = rescore(run)
    assert code == 0
    assert v["reasoning_fallback"] == {"enabled": True, "count": 3, "of": 1319,
                                       "responses_logged": 3, "doc_ids": [3, 17, 1200]}
    assert msg.endswith("DEVIATION from the reference protocol: 3 answer(s) scored from the "
                        "reasoning text (content empty, --reasoning-fallback)")
    assert v["comparable"] and not v["like_reference"] and len(v["deviations_from_reference"]) == 1
    md = results.markdown(v)
    assert "| strict-match | 0.9629 | ± 0.0052 | 0.9644 ± 0.0051 | >= 0.94 | reaches gate |" in md
    assert ("Reasoning fallback: on (a deviation from the reference protocol); answers scored from "
            "reasoning_content (content was empty): 3 of 1319") in md


def test_reference_protocol_run_is_like_reference(tmp_path):
    code, v, msg = rescore(stored_run(tmp_path, 0.9629, 0.9651))
    assert code == 0 and v["like_reference"] and v["deviations_from_reference"] == []
    assert v["reasoning_fallback"]["enabled"] is False and "DEVIATION" not in msg


def test_rescore_without_results_exits_2(tmp_path):
    (tmp_path / "run" / "lm_eval").mkdir(parents=True)
    p = run_cli("gsm8k", "--rescore", str(tmp_path / "run"))
    assert p.returncode == 2 and p.stderr.startswith("k3rocm: error: no lm-eval results file")


# ----------------------------------------------------------- truncated answers, paired A/B


def test_finish_reasons_are_logged_for_chat_and_completions(tmp_path):
    from k3rocm.checks.gsm8k.lmeval_launch import log_finish_reasons

    log = tmp_path / "finish.jsonl"
    # OpenAI shapes: chat choices carry message.content, completions choices carry text
    log_finish_reasons([{"choices": [{"index": 0, "message": {"content": "#### 7"},
                                      "finish_reason": "stop"}]},
                        {"choices": [{"index": 0, "message": {"content": "Let me think"},
                                      "finish_reason": "length"}]}], str(log))
    log_finish_reasons({"choices": [{"index": 0, "text": " 12\n\n", "finish_reason": "length"}]},
                       str(log))
    assert [json.loads(x) for x in log.read_text().splitlines()] == [
        {"finish_reason": "stop", "text": "#### 7"},
        {"finish_reason": "length", "text": "Let me think"},
        {"finish_reason": "length", "text": " 12\n\n"}]


def test_truncated_answers_are_reported_apart_from_wrong_ones(tmp_path):
    run = stored_run(tmp_path, 0.9629, 0.9651, original=20)
    samples = results.load_run(run)[1]
    cut = [results._first_response(s) for s in samples if s["doc_id"] in (3, 7)]
    finishes = [{"finish_reason": "length" if results._first_response(s) in cut else "stop",
                 "text": results._first_response(s)} for s in samples
                if s["filter"] == "strict-match"]
    with open(run / "finish_reasons.jsonl", "w") as fh:
        fh.writelines(json.dumps(f) + "\n" for f in finishes)
    code, v, msg = rescore(run, "--allow-limit")
    t = v["truncated"]
    assert t["count"] == 2 and t["of"] == 20 and t["rate"] == pytest.approx(0.1)
    assert t["doc_ids"] == [3, 7] and t["accuracy_without_truncated"] == 1.0
    assert results.truncation(samples, [{"finish_reason": "length", "text": x} for x in
                                        {results._first_response(s) for s in samples}],
                              32)["accuracy_without_truncated"] is None  # all cut off
    assert "2 of 20 answer(s) cut off at the generation limit" in msg
    old = stored_run(tmp_path / "old", 0.9629, 0.9651)
    assert rescore(old)[1]["truncated"]["recorded"] is False


def test_mcnemar_exact_and_the_noninferiority_margin_with_its_power():
    from k3rocm.checks.bench import stats

    # exact two-sided McNemar: 2 P(X <= 2 | 10, 1/2) = 2 * 56 / 1024
    assert stats.mcnemar_exact(2, 8) == pytest.approx(2 * 56 / 1024)
    assert stats.mcnemar_exact(0, 0) == 1.0
    a = [True] * 1272 + [False] * 47       # 0.9644 of 1319
    b = list(a)
    for i in range(10):                    # 10 items flip each way: same accuracy
        b[i], b[1272 + i] = False, True
    r = stats.paired_accuracy(a, b, margin=0.01)
    assert r["diff"] == 0 and r["b_only"] == r["a_only"] == 10
    assert r["mcnemar"] == "no difference detected" and r["non_inferior"]
    bad = [x and i >= 40 for i, x in enumerate(a)]  # 40 items lost: -3 points
    r = stats.paired_accuracy(a, bad, margin=0.01)
    assert r["mcnemar"] == "B less accurate" and r["mcnemar_p"] < 1e-9
    assert not r["non_inferior"]
    # the rate the verdict itself passes at n = 1319 with 2% discordant items (exact for its
    # bound): a 1-point margin 81.7% (the normal approximation said 82.2%), half a point 37%
    assert stats.noninferiority_pass_rate(1319, 0.01, 0.02) == pytest.approx(0.8169, abs=2e-4)
    assert stats.noninferiority_pass_rate(1319, 0.005, 0.02) == pytest.approx(0.3705, abs=2e-4)


def test_binomial_tails_keep_their_values_and_do_not_overflow():
    """math.comb * p**i overflows a float from ~1030 items on: gsm8k-ab must still compare
    once B loses >= 306 of A's 1319 right answers."""
    from fractions import Fraction
    from math import comb

    from k3rocm.checks.bench import stats

    for k in (0, 17, 29):  # exact rational values at n = 60
        want = 2 * sum(comb(60, i) * Fraction(1, 2) ** 60 for i in range(k + 1))
        assert stats.mcnemar_exact(k, 60 - k) == pytest.approx(min(1.0, float(want)), rel=1e-10)
    assert stats.binom_upper(5, 1000) == pytest.approx(0.010484076911415278, rel=1e-8)
    # n = 1319: finite, in [0, 1]
    assert stats.binom_upper(306, 1319) == pytest.approx(0.2519 - 0.2320 + 306 / 1319, abs=1e-3)
    assert 0 < stats.mcnemar_exact(0, 306) < 1e-90
    a = [True] * 1272 + [False] * 47
    r = stats.paired_accuracy(a, [x and i >= 306 for i, x in enumerate(a)], 0.012)
    assert r["a_only"] == 306 and r["mcnemar"] == "B less accurate" and not r["non_inferior"]


def test_the_pass_rate_is_exact_for_the_verdicts_own_bound():
    """noninferiority_pass_rate against brute force at n = 40: every (a_only, b_only, same)
    outcome of the multinomial, weighted exactly, judged by paired_accuracy itself."""
    from math import comb

    from k3rocm.checks.bench import stats

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
    """The default margin is the smallest on a 0.05-point grid with which identical arms pass
    >= 90% at 98% agreement on 1319 items (a 1-point margin: 81.7%, i.e. 18% false fails, and
    57% at 96%); the price, a false pass for a 1-point drop, is stated: 13.9%."""
    from k3rocm.checks.bench import stats
    from k3rocm.checks.gsm8k import ab

    rate = stats.noninferiority_pass_rate
    d = 1 - ab.DESIGN_AGREEMENT
    assert ab.DESIGN_POWER == 0.90 and ab.DESIGN_AGREEMENT == 0.98
    assert rate(1319, ab.DEFAULT_MARGIN, d) >= ab.DESIGN_POWER
    assert rate(1319, ab.DEFAULT_MARGIN - 0.0005, d) < ab.DESIGN_POWER
    assert rate(1319, ab.DEFAULT_MARGIN, d, ab.DROP) == pytest.approx(0.139, abs=0.001)
    assert 1 - rate(1319, 0.01, d) == pytest.approx(0.183, abs=0.001)
    assert 1 - rate(1319, 0.01, 0.04) == pytest.approx(0.429, abs=0.001)


def _samples(right: list[bool]) -> list[dict]:
    """lm-eval 0.4.13 samples lines: one per (doc, filter) with exact_match."""
    return [{"doc_id": d, "filter": f, "resps": [[f"#### {d}"]], "exact_match": float(ok)}
            for d, ok in enumerate(right) for f in results.FILTERS]


def test_gsm8k_ab_pairs_the_items_and_gates_on_non_inferiority():
    from k3rocm.checks.gsm8k import ab

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


def test_make_gsm8k_ab_dry_run_and_bad_input():
    p = subprocess.run(["make", "-s", "gsm8k-ab", "DRY_RUN=1", "CPU=1", f"PY={sys.executable}"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert make_exit_code(p) == 0, p.stderr
    lines = p.stdout.splitlines()
    assert [ln.split()[4] for ln in lines if ln.startswith("# slot")] == ["A:", "B:"]
    assert sum("k3rocm_lmeval.py run" in ln for ln in lines) == 2
    p = run_cli("ab", "--measure", "gsm8k", "--dry-run", "--no-gpu", "--repeats", "2")
    assert p.returncode == 2 and "use --repeats 1" in p.stderr.strip().splitlines()[-1]
    p = run_cli("ab", "--measure", "bench", "--dry-run", "--no-gpu", "--margin", "0.02")
    assert p.returncode == 2 and "--margin is not used by --measure bench" in p.stderr


def test_gsm8k_ab_without_discordant_items_does_not_claim_power():
    from k3rocm.checks.gsm8k import ab

    comp = ab.compare(_samples([False] * 5), _samples([False] * 5), 0.01)  # the stand-in
    assert comp["filters"]["strict-match"]["power_full"] is None
    assert "power of the margin n/a (no discordant items)" in comp["headline"]


def test_no_discordant_items_is_no_proof_on_a_handful_of_items():
    """Zero items differing between arms gives the Wald interval zero width at any n: five
    identical answers must not read "non-inferior" within 1 point; 1319 identical answers
    may (the exact upper bound on the rate of items only A gets right is ~3/n)."""
    from k3rocm.checks.bench.stats import binom_upper, paired_accuracy

    five = paired_accuracy([True, False] * 2 + [False], [True, False] * 2 + [False], 0.01)
    assert five["non_inferior"] is False and five["lower_bound"] < -0.4
    full = paired_accuracy([True] * 1200 + [False] * 119, [True] * 1200 + [False] * 119, 0.01)
    assert full["non_inferior"] is True
    assert binom_upper(0, 1319) == pytest.approx(1 - 0.05 ** (1 / 1319), rel=1e-6)


def _gsm8k_ab_live(tmp_path, monkeypatch, server_logs: dict[str, str]):
    """gsm8k-ab's live path without Docker: the shared start and the one slot loop of
    checks/ab (fakes for the engine and the arm servers; `k3rocm gsm8k`'s own run is replaced by
    the run directory it leaves, lm-eval 0.4.13 shapes; each arm's server log is the text
    ``server_logs[arm]``). Returns (exit code, run directory, label/image of the start)."""
    import argparse
    import contextlib
    from types import SimpleNamespace

    from k3rocm.checks.ab import arms as armlib
    from k3rocm.checks.ab import cli as abcli
    from k3rocm.checks.gsm8k import ab
    from k3rocm.checks.gsm8k import run as gsm8k_run

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

    def fake_execute(client, s, src, argv, api_key, results_dir, server_container, dep):
        # the run record's deployment is the arm's (its switches), not this shell's
        executed.append((Path(results_dir).name, dep.rendered.env["K3_FUSE_QK_NORM"]))
        stored_run(Path(results_dir), 0.95, 0.95)
        return 0

    monkeypatch.setattr(armlib, "start", fake_start)
    monkeypatch.setattr(armlib.Run, "server", fake_server)
    monkeypatch.setattr(gsm8k_run, "execute", fake_execute)
    monkeypatch.setattr(ab.data, "resolve", lambda *a: SimpleNamespace())
    p = argparse.ArgumentParser()
    abcli.add_arguments(p, measure="gsm8k")
    args = p.parse_args(["--no-gpu", "--results", str(tmp_path), "--models-dir", str(tmp_path)])
    abcli.fill_repeats(args)
    code = ab.run(args)
    assert started == [("gsm8k-ab", args.client_image)]
    assert executed == [("00-A", "0"), ("01-B", "1")]
    return code, tmp_path / "20260101T000000Z-gsm8k-ab"


RECORDS = Path(__file__).parent / "data" / "census" / "records"


def test_gsm8k_ab_runs_each_arm_in_the_one_loop(tmp_path, monkeypatch):
    """Each arm's run lands in ``<run>/NN-<arm>/``, the server log beside it, the report pairs
    the items, and the fusions arm B's overlay decided (decision records as the overlay writes
    them) are what it asked; arm A's stock log has no records, which the report notes."""
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
    assert comp["arms"]["A"]["run_dir"] == str(run / "00-A" / "20261202T171915Z-gsm8k")
    assert "| strict-match | 1319 |" in (run / "comparison.md").read_text()


def test_gsm8k_ab_whose_on_arm_ran_without_a_fusion_is_invalid(tmp_path, monkeypatch):
    """Arm B asked both fusions on, but its server turned the decode Q-prep fusion off at load:
    equal accuracy then compares stock with stock, so no verdict (exit 1), and the report says
    why. (Before, gsm8k-ab did not read the decision records and said NON-INFERIOR.)"""
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
