"""The gsm8k settings (each field is the ``k3rocm gsm8k`` flag of its name) and the exact lm-eval
command line they give; pure: ``--dry-run`` prints :func:`lm_eval_argv`, a run executes it."""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlparse

from pydantic import field_validator, model_validator

from k3rocm.deploy.engine import CLIENT_IMAGE
from k3rocm.errors import UsageError
from k3rocm.options import Options, ServerFlags, like, option

REFERENCE = {"exact_match": 0.9644, "stderr": 0.0051,
             "source": "vLLM PR #52494 (Kimi-K3, MI355X TP=8), lm-eval gsm8k 5-shot, "
                       "strict-match and flexible-extract"}
NUM_FEWSHOT = 5
CLIENT_PYTHON = "/opt/clients/bin/python"
OUT_MOUNT = "/out"
TASKS_MOUNT = f"{OUT_MOUNT}/tasks"  # <run>/tasks/gsm8k.yaml
LAUNCHER_NAME = "k3rocm_lmeval.py"  # copied into <run>/lmeval_plugin/
CHAT_MODEL = "local-chat-completions"  # lm-eval's own, as vLLM PR #52494 ran
FALLBACK_CHAT_MODEL = "k3-chat-completions"  # + reasoning fallback (lmeval_launch.py)
COMPLETIONS_MODEL = "local-completions"
EVAL, IO = "evaluation", "data and output"  # --help groups


class Gsm8kSettings(Options):
    """What lm-eval is run with (``url``/``model`` None until resolved from the deployment)."""

    url: str | None = like(ServerFlags, "url", group="server")
    model: str | None = like(ServerFlags, "model", "served model name (default "
                             "$K3_SERVED_MODEL_NAME, or the only model the server lists)",
                             group="server")
    mode: Literal["chat", "completions"] = option(
        "chat", "chat: /v1/chat/completions with the chat template, few-shot as turns; "
        "completions: /v1/completions with the raw 5-shot prompt", group=EVAL)
    reasoning_fallback: bool = option(
        False, "score the reasoning text when an answer's content is empty (NOT the reference "
        "protocol: counted and reported as a deviation; default off)", group=EVAL)
    concurrency: int = option(32, "requests in flight", group=EVAL, ge=1, le=1024)
    max_gen_tokens: int = option(4096, "max generated tokens per answer; reasoning models need "
                                 "many", group=EVAL, ge=1, le=262144)
    timeout: int = option(1800, "per-request timeout, seconds", group=EVAL, ge=1, le=86400,
                          unit=" seconds")
    max_retries: int = option(3, "per-request retries", group=EVAL, ge=0, le=100)
    limit: int | None = option(None, "evaluate only the first N test items (marks the run not "
                               "comparable)", group=EVAL, ge=1)
    threshold: float = option(0.94, "gate on exact_match of both strict-match and "
                              "flexible-extract", group=EVAL, gt=0, le=1)
    allow_limit: bool = option(False, "let a --limit run (or a test set other than GSM8K's 1319 "
                               "items) pass", group=EVAL)
    client_image: str = option(CLIENT_IMAGE, "image with lm-eval in /opt/clients", group=IO)
    seed: int = 1234  # fixed: not a flag

    @field_validator("url")
    @classmethod
    def _root_url(cls, v: str | None) -> str | None:
        u = urlparse(v or "")
        if v is not None and (u.scheme not in ("http", "https") or not u.hostname):
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
    """The other ``k3rocm gsm8k`` flags: server container, data, output, modes."""

    server_container: str | None = like(ServerFlags, "server_container", group="server")
    data_dir: str | None = option(None, "directory with train.jsonl and test.jsonl (question, "
                                  "answer ending '#### N')", group=IO)
    hf_home: str | None = option(None, "HF cache holding openai/gsm8k (default $HF_HOME, "
                                 "$K3_CACHE_DIR/huggingface, ~/.cache/huggingface)", group=IO)
    results_dir: Path | None = like(ServerFlags, "results", flag="--results-dir", group=IO)
    dry_run: bool = like(ServerFlags, "dry_run", "print the exact lm_eval command line and exit "
                         "0 (no server contact; also before the data set is there)", group=IO)
    fetch_data: bool = option(False, "download openai/gsm8k once into the HF cache (--hf-home) "
                              "with the client image's huggingface_hub, then exit (needs HF hub "
                              "access; `make gsm8k-data`)", group=IO)
    rescore: str | None = option(None, "re-apply the gate to a stored run directory and print "
                                 "the verdict", group=IO, metavar="RUN_DIR")


def lm_eval_argv(s: Gsm8kSettings) -> list[str]:
    """The command run in the client container (lm-eval's CLI via our launcher); independent of
    the data source (that is in the run's task file)."""
    chat = s.mode == "chat"
    # max_gen_toks as a model argument (TemplateAPI's default is 256), not --gen_kwargs: the
    # task's generation_kwargs stay exactly the reference's in the config lm-eval prints.
    margs = [f"model={s.model}",
             f"base_url={s.url.rstrip('/')}/v1/{'chat/completions' if chat else 'completions'}",
             f"num_concurrent={s.concurrency}", f"max_retries={s.max_retries}",
             f"timeout={s.timeout}", f"max_gen_toks={s.max_gen_tokens}",
             "tokenized_requests=False"] + ([] if chat else ["tokenizer_backend=None"])
    for a in margs:
        if "," in a.split("=", 1)[1]:
            raise UsageError(f"model argument {a!r} contains a comma, which lm-eval's "
                             "--model_args cannot carry; rename the model or URL")
    model = (FALLBACK_CHAT_MODEL if s.reasoning_fallback else CHAT_MODEL) if chat \
        else COMPLETIONS_MODEL
    return [CLIENT_PYTHON, f"{OUT_MOUNT}/lmeval_plugin/{LAUNCHER_NAME}", "run",
            "--model", model, "--model_args", ",".join(margs), "--include_path", TASKS_MOUNT,
            "--tasks", "gsm8k", "--num_fewshot", str(NUM_FEWSHOT), "--batch_size", "1",
            "--seed", str(s.seed),
            *(["--apply_chat_template", "--fewshot_as_multiturn", "true"] if chat else []),
            *(["--limit", str(s.limit)] if s.limit is not None else []),
            "--output_path", f"{OUT_MOUNT}/lm_eval", "--log_samples"]
