"""The gsm8k settings, their validation, and the exact lm-eval command line they give.

Everything here is pure (no server, no Docker): ``--dry-run`` prints what :func:`lm_eval_argv`
returns, and the real run executes exactly that argv in the client container.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlparse

from k3rocm.checks.gsm8k.data import HF_MOUNT, DataSource
from k3rocm.deploy.engine import CLIENT_IMAGE
from k3rocm.errors import UsageError

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


@dataclass(frozen=True)
class Gsm8kSettings:
    url: str = "http://127.0.0.1:8000"
    model: str = "moonshotai/Kimi-K3"
    mode: str = "chat"  # chat | completions
    concurrency: int = 32
    max_gen_tokens: int = 4096
    timeout: int = 1800
    max_retries: int = 3
    threshold: float = DEFAULT_THRESHOLD
    limit: int | None = None
    allow_limit: bool = False
    client_image: str = CLIENT_IMAGE
    seed: int = 1234
    reasoning_fallback: bool = False  # a deviation from the reference protocol: off unless asked


def validate(s: Gsm8kSettings) -> None:
    u = urlparse(s.url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise UsageError(f"--url {s.url!r} is not an http(s) URL; e.g. http://127.0.0.1:8000")
    if u.path not in ("", "/"):
        raise UsageError(f"--url {s.url!r} has a path; give the server root "
                         "(e.g. http://127.0.0.1:8000), /v1/... is added")
    if s.mode not in ("chat", "completions"):
        raise UsageError(f"--mode {s.mode!r} is not valid; use chat or completions")
    if s.reasoning_fallback and s.mode != "chat":
        raise UsageError("--reasoning-fallback needs --mode chat (completions have no reasoning "
                         "field)")
    for flag, value, lo, hi, unit in (("--concurrency", s.concurrency, 1, 1024, ""),
                                      ("--max-gen-tokens", s.max_gen_tokens, 1, 262144, ""),
                                      ("--timeout", s.timeout, 1, 86400, " seconds"),
                                      ("--max-retries", s.max_retries, 0, 100, "")):
        if not lo <= value <= hi:
            raise UsageError(f"{flag} {value} is out of range; use {lo}..{hi}{unit}")
    if not 0.0 < s.threshold <= 1.0:
        raise UsageError(f"--threshold {s.threshold} is out of range; use 0 < x <= 1")
    if s.limit is not None and s.limit < 1:
        raise UsageError(f"--limit {s.limit} is not valid; use a positive item count")
    if not s.model.strip():
        raise UsageError("--model is empty; give the served model name (K3_SERVED_MODEL_NAME)")


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
