"""Runs in the client container, copied into each run directory: ``run ...`` is ``lm-eval run``
plus the model ``k3-chat-completions`` (``--reasoning-fallback``: an empty content is scored on
the reasoning text, each such answer logged to $K3_GSM8K_FALLBACK_LOG); every response's
finish_reason goes to $K3_GSM8K_FINISH_LOG, the client versions to $K3_GSM8K_CLIENT_INFO.
``fetch-gsm8k`` downloads openai/gsm8k into $HF_HOME's hub cache. Standard library + lm-eval only.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import sys
import threading
from importlib import metadata
from pathlib import Path

MODEL_NAME = "k3-chat-completions"
REASONING_KEYS = ("reasoning_content", "reasoning")

_lock = threading.Lock()


def _append_jsonl(path: str | None, record: dict) -> None:
    if not path:
        return
    with _lock, open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record, ensure_ascii=False) + "\n")


def _choices(outputs):
    for out in outputs if isinstance(outputs, list) else [outputs]:
        yield from (out.get("choices") or []) if isinstance(out, dict) else []


def apply_reasoning_fallback(outputs, log_path: str | None = None):
    """A copy of ``outputs`` with empty contents replaced by the reasoning text; one log line
    per replacement."""
    fixed = copy.deepcopy(outputs)
    for out in fixed if isinstance(fixed, list) else [fixed]:
        for choice in _choices(out):
            msg = choice.get("message") or {}
            content = msg.get("content")
            if content is not None and content.strip():
                continue
            for key in REASONING_KEYS:
                text = msg.get(key)
                if isinstance(text, str) and text.strip():
                    msg["content"] = text
                    _append_jsonl(log_path, {
                        "id": out.get("id"), "index": choice.get("index"), "content": content,
                        "field": key, "finish_reason": choice.get("finish_reason"), "text": text})
                    break
    return fixed


def log_finish_reasons(outputs, log_path: str | None) -> None:
    for choice in _choices(outputs):
        text = (choice.get("message") or {}).get("content") if "message" in choice \
            else choice.get("text")
        _append_jsonl(log_path, {"finish_reason": choice.get("finish_reason"), "text": text})


def client_info() -> dict:
    versions = {}
    for dist in ("lm_eval", "datasets", "huggingface_hub", "aiohttp", "transformers"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    return {"python": platform.python_version(), "executable": sys.executable,
            "versions": versions, "argv": sys.argv}


def register() -> None:
    from lm_eval.api.registry import register_model
    from lm_eval.models.openai_completions import LocalChatCompletion, LocalCompletionsAPI

    # lm-eval 0.4.13 lm_eval/models/openai_completions.py: LocalCompletionsAPI.parse_generations
    # is a staticmethod, LocalChatCompletion.parse_generations an instance method.
    finish_log = os.environ.get("K3_GSM8K_FINISH_LOG")
    completions_parse = LocalCompletionsAPI.parse_generations
    chat_parse = LocalChatCompletion.parse_generations

    def completions_logged(outputs, **kwargs):
        log_finish_reasons(outputs, finish_log)
        return completions_parse(outputs, **kwargs)

    def chat_logged(self, outputs, **kwargs):
        log_finish_reasons(outputs, finish_log)
        return chat_parse(self, outputs, **kwargs)

    LocalCompletionsAPI.parse_generations = staticmethod(completions_logged)
    LocalChatCompletion.parse_generations = chat_logged

    class ChatCompletionsWithReasoningFallback(LocalChatCompletion):
        def parse_generations(self, outputs, **kwargs):
            fixed = apply_reasoning_fallback(outputs, os.environ.get("K3_GSM8K_FALLBACK_LOG"))
            return super().parse_generations(fixed, **kwargs)

    register_model(MODEL_NAME)(ChatCompletionsWithReasoningFallback)


def fetch_gsm8k() -> int:
    """openai/gsm8k ``main`` into the hub cache; one JSON line: revision, path, files or error."""
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download("openai/gsm8k", repo_type="dataset", allow_patterns=["main/*"])
    except Exception as exc:  # noqa: BLE001 - offline, proxy, auth: one line for the host
        first = (str(exc).strip().splitlines() or [""])[0][:240]
        print(json.dumps({"error": f"{exc.__class__.__name__}: {first}"}))
        return 2
    files = sorted(str(p.relative_to(path)) for p in Path(path).rglob("*") if p.is_file())
    print(json.dumps({"revision": os.path.basename(path), "path": path, "files": files}))
    return 0


def main() -> None:
    if sys.argv[1:2] == ["fetch-gsm8k"]:
        sys.exit(fetch_gsm8k())
    info_path = os.environ.get("K3_GSM8K_CLIENT_INFO")
    if info_path:
        with open(info_path, "w", encoding="utf-8") as fh:
            json.dump(client_info(), fh, indent=2)
    register()
    from lm_eval.__main__ import cli_evaluate

    sys.argv[0] = "lm-eval"
    try:
        cli_evaluate()
    except KeyboardInterrupt:  # k3rocm gsm8k's Ctrl-C (SIGINT to this container): one line
        print("lm-eval: interrupted (SIGINT); stopping", file=sys.stderr, flush=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
