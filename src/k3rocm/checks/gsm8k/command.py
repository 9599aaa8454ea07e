"""The gsm8k settings, their validation, and the exact lm-eval command line they give.

Everything here is pure (no server, no Docker): ``--dry-run`` prints what :func:`lm_eval_argv`
returns, and the real run executes exactly that argv in the client container.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlparse

from pydantic import field_validator, model_validator

from k3rocm.checks.gsm8k.data import HF_MOUNT, DataSource
from k3rocm.deploy.engine import CLIENT_IMAGE
from k3rocm.errors import UsageError
from k3rocm.options import Options, ServerFlags, like, option

REFERENCE = {"exact_match": 0.9644, "stderr": 0.0051,
             "source": "vLLM PR #52494 (Kimi-K3, MI355X TP=8), lm-eval gsm8k 5-shot, "
                       "strict-match and flexible-extract"}
DEFAULT_THRESHOLD = 0.94
NUM_FEWSHOT = 5
CLIENT_PYTHON = "/opt/clients/bin/python"
OUT_MOUNT = "/out"
LAUNCHER_NAME = "k3rocm_lmeval.py"  # copied into <run>/lmeval_plugin/
CHAT_MODEL = "local-chat-completions"  # lm-eval's own, as vLLM PR #52494 ran
FALLBACK_CHAT_MODEL = "k3-chat-completions"  # + reasoning fallback, registered by lmeval_launch.py
COMPLETIONS_MODEL = "local-completions"
TASKS_MOUNT = f"{OUT_MOUNT}/tasks"  # <run>/tasks/gsm8k.yaml, the reference task config
EVALUATION, DATA_AND_OUTPUT = "evaluation", "data and output"  # --help groups


class Gsm8kSettings(Options):
    """What lm-eval is run with; each field is also the ``k3rocm gsm8k`` flag of its name
    (``url`` and ``model``: None until resolved from the deployment)."""

    url: str | None = like(ServerFlags, "url", group="server")
    model: str | None = like(ServerFlags, "model", "served model name (default "
                             "$K3_SERVED_MODEL_NAME, or the only model the server lists)",
                             group="server")
    mode: Literal["chat", "completions"] = option(
        "chat", "chat: /v1/chat/completions with the chat template, few-shot as turns; "
        "completions: /v1/completions with the raw 5-shot prompt", group=EVALUATION)
    reasoning_fallback: bool = option(
        False, "score the reasoning text when an answer's content is empty (NOT the reference "
        "protocol: counted and reported as a deviation; default off)", group=EVALUATION)
    concurrency: int = option(32, "requests in flight", group=EVALUATION, ge=1, le=1024)
    max_gen_tokens: int = option(4096, "max generated tokens per answer; reasoning models need "
                                 "many", group=EVALUATION, ge=1, le=262144)
    timeout: int = option(1800, "per-request timeout, seconds", group=EVALUATION, ge=1,
                          le=86400, unit=" seconds")
    max_retries: int = option(3, "per-request retries", group=EVALUATION, ge=0, le=100)
    limit: int | None = option(None, "evaluate only the first N test items (marks the run not "
                               "comparable)", group=EVALUATION, ge=1)
    threshold: float = option(DEFAULT_THRESHOLD, "gate on exact_match of both strict-match and "
                              "flexible-extract", group=EVALUATION, gt=0, le=1)
    allow_limit: bool = option(False, "let a --limit run (or a test set other than GSM8K's 1319 "
                               "items) pass", group=EVALUATION)
    client_image: str = option(CLIENT_IMAGE, "image with lm-eval in /opt/clients",
                               group=DATA_AND_OUTPUT)
    seed: int = 1234  # fixed: not a flag

    @field_validator("url")
    @classmethod
    def _root_url(cls, v: str | None) -> str | None:
        u = urlparse(v or "")
        if v is None:
            return v
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError("is not an http(s) URL; e.g. http://127.0.0.1:8000")
        if u.path not in ("", "/"):
            raise ValueError("has a path; give the server root (e.g. http://127.0.0.1:8000), "
                             "/v1/... is added")
        return v

    @field_validator("model")
    @classmethod
    def _named(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("is empty; give the served model name (K3_SERVED_MODEL_NAME)")
        return v

    @model_validator(mode="after")
    def _fallback_needs_chat(self) -> Gsm8kSettings:
        if self.reasoning_fallback and self.mode != "chat":
            raise ValueError("--reasoning-fallback needs --mode chat (completions have no "
                             "reasoning field)")
        return self


class Gsm8kRun(Options):
    """The flags of ``k3rocm gsm8k`` beyond what lm-eval is run with: server, data, output."""

    server_container: str | None = like(ServerFlags, "server_container", group="server")
    data_dir: str | None = option(None, "directory with train.jsonl and test.jsonl (question, "
                                  "answer ending '#### N')", group=DATA_AND_OUTPUT)
    hf_home: str | None = option(None, "HF cache holding openai/gsm8k (default $HF_HOME, "
                                 "$K3_CACHE_DIR/huggingface, ~/.cache/huggingface)",
                                 group=DATA_AND_OUTPUT)
    results_dir: Path | None = like(ServerFlags, "results", flag="--results-dir",
                                    group=DATA_AND_OUTPUT)
    dry_run: bool = like(ServerFlags, "dry_run", "print the exact lm_eval command line and exit "
                         "0 (no server contact; also before the data set is there)",
                         group=DATA_AND_OUTPUT)
    fetch_data: bool = option(False, "download openai/gsm8k once into the HF cache (--hf-home) "
                              "with the client image's huggingface_hub, then exit (needs HF hub "
                              "access; `make gsm8k-data`)", group=DATA_AND_OUTPUT)
    rescore: str | None = option(None, "re-apply the gate to a stored run directory and print "
                                 "the verdict", group=DATA_AND_OUTPUT, metavar="RUN_DIR")


def model_args(s: Gsm8kSettings) -> str:
    # max_gen_toks as a model argument (lm-eval's TemplateAPI default is 256), not --gen_kwargs:
    # the task's generation_kwargs stay exactly the reference's in the config lm-eval prints.
    endpoint = "chat/completions" if s.mode == "chat" else "completions"
    args = [f"model={s.model}", f"base_url={s.url.rstrip('/')}/v1/{endpoint}",
            f"num_concurrent={s.concurrency}",
            f"max_retries={s.max_retries}", f"timeout={s.timeout}",
            f"max_gen_toks={s.max_gen_tokens}", "tokenized_requests=False"]
    if s.mode == "completions":  # prompts go as text: no tokenizer needed on the client
        args.append("tokenizer_backend=None")
    for a in args:
        if "," in a.split("=", 1)[1]:
            raise UsageError(f"model argument {a!r} contains a comma, which lm-eval's "
                             "--model_args cannot carry; rename the model or URL")
    return ",".join(args)


def lm_eval_argv(s: Gsm8kSettings) -> list[str]:
    """The exact command run in the client container (lm-eval's CLI via our launcher).

    It does not depend on where the items come from (that is in the run's task file), so the
    dry run prints it even before the data set is there."""
    argv = [CLIENT_PYTHON, f"{OUT_MOUNT}/lmeval_plugin/{LAUNCHER_NAME}", "run",
            "--model", COMPLETIONS_MODEL if s.mode != "chat" else
            FALLBACK_CHAT_MODEL if s.reasoning_fallback else CHAT_MODEL,
            "--model_args", model_args(s),
            "--include_path", TASKS_MOUNT,
            "--tasks", "gsm8k",
            "--num_fewshot", str(NUM_FEWSHOT),
            "--batch_size", "1",
            "--seed", str(s.seed)]
    if s.mode == "chat":
        argv += ["--apply_chat_template", "--fewshot_as_multiturn", "true"]
    if s.limit is not None:
        argv += ["--limit", str(s.limit)]
    argv += ["--output_path", f"{OUT_MOUNT}/lm_eval", "--log_samples"]
    return argv


def container_env(s: Gsm8kSettings, data: DataSource | None) -> dict[str, str]:
    return {
        "HOME": "/tmp",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_UPDATE_DOWNLOAD_COUNTS": "0",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "K3_GSM8K_FALLBACK_LOG": f"{OUT_MOUNT}/reasoning_fallback.jsonl",
        "K3_GSM8K_CLIENT_INFO": f"{OUT_MOUNT}/client_info.json",
        "K3_GSM8K_FINISH_LOG": f"{OUT_MOUNT}/finish_reasons.jsonl",
        # the json/parquet builders write their arrow cache into the container, not the host
        "HF_HOME": HF_MOUNT if data is not None and data.kind == "hf-datasets-cache"
        else "/tmp/hf",
    }
