"""census.drive's decode load against the fake vLLM server (tests/fake_vllm.py): a stream whose
first tokens come late, provoked by events, never sleeps."""

from __future__ import annotations

import collections
import itertools
import re
import threading

import pytest

from k3rocm.checks.census.drive import LOAD_ATTEMPTS, profile_under_load
from k3rocm.checks.census.pipeline import Profiling
from k3rocm.errors import UsageError

LOAD = Profiling(concurrency=3, max_tokens=40, prompt_words=4, steps=2)


@pytest.fixture
def fake(fake_vllm, monkeypatch):
    from k3rocm.checks.census import drive

    lock, count = threading.Lock(), itertools.count()
    # the drive counts profiled tokens from what it read when /start_profile returned: the
    # streams go on only once it has (on a loaded machine its response can come after them)
    based, real_tokens = threading.Event(), drive._Load.tokens

    def tokens(self):
        out = real_tokens(self)
        if srv.hit["/start_profile"].is_set():
            based.set()
        return out

    monkeypatch.setattr(drive._Load, "tokens", tokens)
    began: dict[int, threading.Event] = collections.defaultdict(threading.Event)
    raced: dict[int, threading.Semaphore] = collections.defaultdict(
        lambda: threading.Semaphore(0))

    def chat(req, send):
        with lock:
            rnd = next(count) // LOAD.concurrency + 1
            began[rnd].set()
            nxt = began[rnd + 1]
        i = int(re.match(r"Request (\d+):", req["messages"][0]["content"]).group(1))
        late = [j for j in range(LOAD.concurrency) if srv.late(rnd, j)]
        if i in late:
            for _ in range(LOAD.concurrency - len(late)):
                while not (raced[rnd].acquire(timeout=0.02) or nxt.is_set()
                           or srv.closing.is_set()):
                    pass
        if (req.get("stream_options") or {}).get("continuous_usage_stats"):
            send("ab", 2)  # two tokens in one chunk: vLLM merges them when the client lags
        else:
            send("a", 1), send("b", 2)
        n = 2
        if late and i not in late:
            while n < LOAD.max_tokens * 3 // 4:
                n += 1
                send("c", n)
            raced[rnd].release()
        srv.wait(based, nxt)
        while n < req["max_tokens"]:
            if n == req["max_tokens"] - 2:
                srv.wait(srv.hit["/stop_profile"], nxt)
            n += 1
            send("c", n)

    srv = fake_vllm(chat=chat)
    srv.late = lambda rnd, i: False
    return srv


def test_a_round_with_a_late_stream_is_hung_up_and_a_fresh_one_profiled(fake, capsys):
    fake.late = lambda rnd, i: rnd == 1 and i == 0
    info = profile_under_load(fake.url, "k3-smoke", None, LOAD)
    assert len(fake.bodies) == 2 * LOAD.concurrency  # round 1 aborted, round 2 profiled
    assert fake.posts == ["/start_profile", "/stop_profile"]
    want = LOAD.steps + 4
    assert min(info["profiled_tokens_per_stream"]) >= want, info
    # every request asks for vLLM's per-chunk usage; the merged "ab" chunk counted as 2 tokens
    assert all(b["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
               and b["ignore_eos"] and b["min_tokens"] == b["max_tokens"] == LOAD.max_tokens
               for b in fake.bodies)
    err = capsys.readouterr().err
    assert f"load round 1/{LOAD_ATTEMPTS}: a stream was still in prefill after another had " \
        f"used half of its {LOAD.max_tokens} tokens" in err and "starting a fresh round" in err
    assert "all 3 streams decoding" in err


def test_a_stream_late_in_every_round_is_a_clear_error_not_an_empty_profile(fake):
    fake.late = lambda rnd, i: i == 2  # e.g. --concurrency above the server's max-num-seqs
    with pytest.raises(UsageError, match=r"in 3 rounds, some of the 3 streams only started "
                       r"decoding after others had used half of their 40 tokens: raise "
                       r"--max-tokens, or lower --concurrency") as e:
        profile_under_load(fake.url, "k3-smoke", None, LOAD)
    assert e.value.exit_code == 3
    assert len(fake.bodies) == LOAD_ATTEMPTS * LOAD.concurrency
    assert fake.posts == []  # the profiler was never started


def test_tokens_are_counted_from_chunks_when_the_server_sends_no_usage(fake, monkeypatch):
    from k3rocm.deploy.server_api import ServerAPI

    real = ServerAPI.stream_chat

    def no_usage(self, body, st):
        return real(self, {k: v for k, v in body.items() if k != "stream_options"}, st)

    monkeypatch.setattr(ServerAPI, "stream_chat", no_usage)
    info = profile_under_load(fake.url, "k3-smoke", None, LOAD)
    assert fake.posts == ["/start_profile", "/stop_profile"]
    assert min(info["profiled_tokens_per_stream"]) >= LOAD.steps + 4


def test_a_server_whose_profiler_stops_itself_is_waited_for_not_the_tokens(fake):
    calls = []

    def stopped() -> bool:
        calls.append(fake.posts[:])
        return len(calls) == 3

    info = profile_under_load(fake.url, "k3-smoke", None, LOAD, stopped=stopped)
    assert calls == [["/start_profile"]] * 3  # polled while the profiler ran, until it ended
    assert fake.posts == ["/start_profile", "/stop_profile"]
    assert info["stopped_by_server"] is True
