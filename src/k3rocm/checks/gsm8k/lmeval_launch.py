"""Runs *inside the client container*: lm-eval's own CLI plus one model class.

(``python k3rocm_lmeval.py fetch-gsm8k`` instead downloads openai/gsm8k into ``$HF_HOME``'s hub
cache with huggingface_hub: ``make gsm8k-data``.)

``python k3rocm_lmeval.py run --model ... ...`` is ``lm-eval run ...`` with one extra registered
model, ``k3-chat-completions`` (used only with ``k3rocm gsm8k --reasoning-fallback``, a deviation
from the reference protocol of vLLM PR #52494): lm-eval's ``local-chat-completions`` unchanged,
except that a response whose ``message.content`` is empty while the reasoning field
(``reasoning_content``, or ``reasoning`` in newer vLLM) holds text is scored on that text.
Every such fallback is appended as one JSON line to ``$K3_GSM8K_FALLBACK_LOG`` so the summary
can say how many answers needed it. For every model (the reference's ``local-chat-completions`` and
``local-completions`` too) each response's ``finish_reason`` is appended to
``$K3_GSM8K_FINISH_LOG`` (scoring unchanged), so answers cut off at the generation limit
(``length``) are reported apart from wrong ones. Before evaluating, the versions of lm-eval and
its data stack are written to ``$K3_GSM8K_CLIENT_INFO``.

Only the standard library and lm-eval are imported here: this file is copied into each run
directory (so the exact code that produced a result is kept with it) and run by the client
image's Python.
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
    """Every choice of one response or a list of them (the OpenAI response shape)."""
    for out in outputs if isinstance(outputs, list) else [outputs]:
        yield from (out.get("choices") or []) if isinstance(out, dict) else []


def apply_reasoning_fallback(outputs, log_path: str | None = None):
    """Return ``outputs`` with empty contents replaced by the reasoning text (a deep copy).

    Pure function over the OpenAI chat-completions response shape; logs one line per fallback.
    """
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
    """One JSON line per choice: its finish_reason and its text (content, or completion text)."""
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
        """``local-chat-completions`` + scoring the reasoning text when the content is empty."""

        def parse_generations(self, outputs, **kwargs):
            fixed = apply_reasoning_fallback(outputs, os.environ.get("K3_GSM8K_FALLBACK_LOG"))
            return super().parse_generations(fixed, **kwargs)

    register_model(MODEL_NAME)(ChatCompletionsWithReasoningFallback)


def fetch_gsm8k() -> int:
    """openai/gsm8k (config ``main``: its parquet files) into the hub cache under ``$HF_HOME``.
    Prints one JSON line: ``{"revision", "path", "files"}`` or ``{"error"}``; exit 0 or 2."""
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download("openai/gsm8k", repo_type="dataset", allow_patterns=["main/*"])
    except Exception as exc:  # noqa: BLE001 - offline, proxy, auth: one line for the host
        first = (str(exc).strip().splitlines() or [""])[0][:240]
        print(json.dumps({"error": f"{exc.__class__.__name__}: {first}"}))
        return 2
    files = sorted(str(p.relative_to(path)) for p in Path(path).rglob("*")
                   if p.is_file())
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
