"""Drive a running server for a census: decode-heavy streaming load, profiler on, profiler off.

N concurrent streaming chat completions (``ignore_eos``); profiling starts once every stream
decodes with at least half its tokens to go, and ends when the server's profiler stops itself
or after ``steps`` more tokens; then the streams are hung up (aborting the requests).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3rocm.deploy.provenance import exec_text, read_file
from k3rocm.deploy.server_api import STREAM_TIMEOUT, ChatStream, ServerAPI
from k3rocm.errors import UsageError, tagged_log
from k3rocm.rundir import write_bytes_atomic

_log = tagged_log("census")


class _Load:
    """One round of ``concurrency`` streaming requests, each on its own thread."""

    def __init__(self, url: str, model: str, api_key: str | None, load: Any, salt: int) -> None:
        self.streams = [ChatStream() for _ in range(load.concurrency)]
        self.threads = []
        for i, st in enumerate(self.streams):
            words = " ".join(f"w{(i * 7919 + j + salt) % 997}" for j in range(load.prompt_words))
            body = {"model": model, "max_tokens": load.max_tokens,
                    "min_tokens": load.max_tokens, "ignore_eos": True, "temperature": 0.0,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                    "messages": [{"role": "user", "content": f"Request {i}: {words}"}]}
            self.threads.append(threading.Thread(target=ServerAPI(url, api_key).stream_chat,
                                                 args=(body, st), daemon=True))
        for t in self.threads:
            t.start()

    def tokens(self) -> list[int]:
        return [s.tokens for s in self.streams]

    def check(self, when: str) -> None:
        errs = [s.error for s in self.streams if s.error]
        if errs:
            raise UsageError(f"a load request failed {when}: {errs[0]}", 3)

    def close(self) -> None:
        for s in self.streams:
            s.hang_up()
        for t in self.threads:
            t.join(timeout=30)


LOAD_ATTEMPTS = 3


def _decoding_load(url: str, model: str, api_key: str | None, load: Any, t0: float,
                   prefill_timeout: float) -> _Load:
    """A load whose every stream is decoding with at least half its tokens left (a round
    where one stream lags is aborted and a fresh one started, up to LOAD_ATTEMPTS)."""
    half = load.max_tokens // 2
    for attempt in range(1, LOAD_ATTEMPTS + 1):
        run, next_note = _Load(url, model, api_key, load, salt=attempt - 1), 0.0
        while True:
            run.check("before profiling")
            toks = run.tokens()
            if min(toks) >= 2 and max(toks) <= half:
                return run
            if max(toks) > half or any(s.done for s in run.streams):
                break
            el = time.time() - t0
            if el > prefill_timeout:
                run.close()
                raise UsageError(f"the load did not start decoding within {prefill_timeout:.0f}s"
                                 f" (tokens so far: {toks})", 3)
            if el >= next_note:
                _log(f"waiting for prefill of {load.concurrency} streams ... {el:.0f}s "
                     f"(tokens {toks})")
                next_note = el + 10
            time.sleep(0.05)
        run.close()
        _log(f"load round {attempt}/{LOAD_ATTEMPTS}: a stream was still in prefill after "
             f"another had used half of its {load.max_tokens} tokens (tokens {toks}); "
             + ("aborted, starting a fresh round" if attempt < LOAD_ATTEMPTS else "giving up"))
    raise UsageError(f"in {LOAD_ATTEMPTS} rounds, some of the {load.concurrency} streams only "
                     f"started decoding after others had used half of their {load.max_tokens} "
                     "tokens: raise --max-tokens, or lower --concurrency to at most the "
                     "server's --max-num-seqs", 3)


def profile_under_load(url: str, model: str, api_key: str | None, load: Any, margin: int = 4,
                       prefill_timeout: float = 600.0,
                       stopped: Callable[[], bool] | None = None) -> dict[str, Any]:
    """Run the ``load`` (:class:`pipeline.Profiling`), profile, stop; returns timings.
    ``stopped``: the server's profiler stopped itself (``max_iterations``: vLLM's
    ``WorkerProfiler.step``); without it, until every stream has ``steps + margin`` more tokens."""
    t0 = time.time()
    info: dict[str, Any] = {"concurrency": load.concurrency, "max_tokens": load.max_tokens}
    run = _decoding_load(url, model, api_key, load, t0, prefill_timeout)
    try:
        info["prefill_s"] = round(time.time() - t0, 3)
        _log(f"all {load.concurrency} streams decoding after {info['prefill_s']}s; "
             "POST /start_profile")
        api = ServerAPI(url, api_key)
        t_post = time.time()
        api.start_profile()
        t1 = time.time()
        base = run.tokens()
        info["start_profile_s"] = round(t1 - t_post, 3)
        want, next_poll = load.steps + margin, t1
        _log("profiling until the server's profiler stops itself (max_iterations)"
             if stopped else f"profiling until every stream has {want} more tokens")
        while True:
            run.check("while profiling")
            if stopped is None:
                if min(s.tokens - b for s, b in zip(run.streams, base, strict=True)) >= want:
                    break
            elif time.time() >= next_poll:
                if stopped():
                    info["stopped_by_server"] = True
                    break
                next_poll = time.time() + 0.5
            if all(s.done for s in run.streams):
                break
            if time.time() - t1 > STREAM_TIMEOUT:
                raise UsageError(f"the profile did not end within {STREAM_TIMEOUT:.0f}s of "
                                 "load", 3)
            time.sleep(0.02)
        info["profiled_tokens_per_stream"] = [
            s.tokens - b for s, b in zip(run.streams, base, strict=True)]
        _log("POST /stop_profile (writing traces can take a while)")
        t_post = time.time()
        api.stop_profile()
        info["stop_profile_s"] = round(time.time() - t_post, 3)
    finally:
        run.close()
    info["stream_tokens"] = run.tokens()
    info["wall_s"] = round(time.time() - t0, 3)
    return info


@dataclass
class TraceDir:
    """The server's traces: ``host`` directory, else ``path`` inside ``container``."""

    host: Path | None
    container: Any = None
    path: str | None = None

    def __str__(self) -> str:
        return str(self.host) if self.host is not None else \
            f"{self.path} inside container {self.container.name}"

    def snapshot(self) -> dict[str, Any]:
        if self.host is not None:
            d = self.host
            return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime)
                    for p in d.rglob("*") if p.is_file()} if d.is_dir() else {}
        out = exec_text(self.container, ["sh", "-c", f"cd '{self.path}' 2>/dev/null && "
                                         "find . -type f -exec stat -c '%s %n' {} +; exit 0"])
        lines = (line.partition(" ") for line in (out or "").splitlines())
        return {name.removeprefix("./"): int(size) for size, _, name in lines if size.isdigit()}

    def new_files(self, before: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in self.snapshot().items()
                if k not in before and k.endswith((".json", ".json.gz", ".txt"))
                and not Path(k).name.startswith(".")}

    def read(self, rel: str) -> bytes:
        if self.host is not None:
            return (self.host / rel).read_bytes()
        return read_file(self.container, f"{self.path.rstrip('/')}/{rel}")

    def collect(self, before: dict[str, Any], dest: Path, timeout: float = 600.0,
                settle: float = 3.0) -> list[Path]:
        """Copy the new trace files into ``dest`` once unchanged for ``settle`` seconds."""
        t0 = time.time()
        last: dict = {}
        stable_since = None
        while True:
            now = self.new_files(before)
            if now and now == last:
                stable_since = stable_since or time.time()
                if time.time() - stable_since >= settle:
                    break
            else:
                stable_since = None
            last = now
            if time.time() - t0 > timeout:
                if now:
                    break
                raise UsageError(
                    f"no new trace file appeared in {self.host} within {timeout:.0f}s; is that "
                    "the host side of the server's K3_PROFILER_DIR?" if self.host is not None
                    else f"no new trace file appeared in {self.path} inside the server "
                    f"container within {timeout:.0f}s", 3)
            time.sleep(0.5)
        return [write_bytes_atomic(dest / rel, self.read(rel)) for rel in sorted(now)]
