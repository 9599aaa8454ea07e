"""deploy.server_api.ServerAPI against a fake vLLM server (tests/fake_vllm.py)."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import REPO, free_port

from k3rocm.deploy.scale import status
from k3rocm.deploy.scale.preflight import check_node
from k3rocm.deploy.server_api import (
    ChatStream,
    ServerAPI,
    StartFailed,
    Unreachable,
    auth_headers,
    wait_ready,
)
from k3rocm.dev.smoke import stream_chat
from k3rocm.errors import EXIT_SERVER, ServerError, UsageError


@pytest.fixture
def vllm(fake_vllm):
    return fake_vllm()


@pytest.mark.parametrize("key", [None, "", "EMPTY"])
def test_no_key_sends_no_header(vllm, key):
    api = ServerAPI(vllm.url, key)
    assert auth_headers(key) == {} and api.health() == 200 and api.models() == ["k3-smoke"]
    api.start_profile()
    assert [a for _, _, a in vllm.seen] == [None, None, None]


def test_a_key_goes_on_every_request_and_the_profiler_endpoints(vllm):
    vllm.key = "s3cret"
    api = ServerAPI(vllm.url + "/", "s3cret")  # a trailing slash is no second path
    assert api.health() == 200 and api.models() == ["k3-smoke"]
    assert api.metrics_text().startswith("vllm:num_requests_running")
    api.start_profile()
    api.stop_profile()
    assert vllm.seen == [(m, p, "Bearer s3cret") for m, p in [
        ("GET", "/health"), ("GET", "/v1/models"), ("GET", "/metrics"),
        ("POST", "/start_profile"), ("POST", "/stop_profile")]]
    vllm.profiler = False
    with pytest.raises(ServerError, match="answered 404: the server was started without a "
                       "profiler; set K3_PROFILER_DIR") as ei:
        api.start_profile()
    assert ei.value.exit_code == EXIT_SERVER


@pytest.mark.parametrize("key", [None, "EMPTY", "wrong"])
def test_401_on_models_is_one_line_exit_3(vllm, key):
    url = vllm.url
    vllm.key = "s3cret"
    with pytest.raises(ServerError) as ei:
        ServerAPI(url, key).models()
    assert ei.value.exit_code == EXIT_SERVER
    assert f"server at {url} refused /v1/models (HTTP 401); set K3_API_KEY" in str(ei.value)


@pytest.mark.parametrize("answer, says", [
    ((404, "{}"), "answered /v1/models with HTTP 404; is it a vLLM OpenAI server and healthy?"),
    ((500, "oops"), "answered /v1/models with HTTP 500"),
    ((200, "not json"), "/v1/models is not an OpenAI model list"),
    ((200, '{"data": [{"name": "x"}]}'), "/v1/models is not an OpenAI model list"),
    ((200, '{"data": "x"}'), "/v1/models is not an OpenAI model list"),
])
def test_other_model_list_answers_are_server_errors(vllm, answer, says):
    vllm.models = answer
    with pytest.raises(ServerError, match=says) as ei:
        ServerAPI(vllm.url).models()
    assert ei.value.exit_code == EXIT_SERVER and "\n" not in str(ei.value)


def test_no_server_is_unreachable_with_its_reason():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(Unreachable) as ei:
        ServerAPI(url).health()
    e = ei.value
    assert (e.reason, e.refused, e.exit_code) == ("ConnectionError", True, EXIT_SERVER)
    assert str(e).startswith(f"nothing listening at {url} (connection refused): start the "
                             "server (`make up`")


def test_a_server_that_never_answers_times_out_and_is_not_refused(vllm):
    with pytest.raises(Unreachable) as ei:
        ServerAPI(vllm.url, timeout=0.3).get("/hang")
    assert ei.value.reason == "ReadTimeout" and not ei.value.refused
    assert "nothing listening" not in str(ei.value)


# --- connection refused: commands that expect a running server stop at once ----------------------

def test_wait_ready_for_a_running_server_fails_at_once_when_nothing_listens():
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(Unreachable, match="nothing listening at") as ei:
        wait_ready(url, "m", timeout=60, quiet=True)
    assert time.monotonic() - t0 < 5 and ei.value.exit_code == EXIT_SERVER


def test_wait_ready_keeps_waiting_while_a_starting_container_lives_then_names_its_failure():
    """A starting container (``failed`` given): refused means wait, until its state says it
    failed or the timeout passes."""
    url = f"http://127.0.0.1:{free_port()}"
    asked = []

    def alive():
        asked.append(1)
        return None

    with pytest.raises(UsageError, match=r"not healthy within 2s \(connection refused\)") as ei:
        wait_ready(url, "m", timeout=1.5, failed=alive, quiet=True)
    assert ei.value.exit_code == EXIT_SERVER
    assert len(asked) >= 2  # polled, not given up at the first refusal
    states = iter([None, "exited with code 2"])
    with pytest.raises(StartFailed) as ei:
        wait_ready(url, "m", timeout=60, failed=lambda: next(states), quiet=True)
    assert ei.value.reason == "exited with code 2" and ei.value.exit_code == EXIT_SERVER
    assert "exited with code 2 before it became ready" in str(ei.value)


def test_census_with_nothing_listening_says_so_at_once(k3):
    """`k3rocm census` with no server: exit 3 at once, naming the URL."""
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    r = k3("census", "--url", url, "--model-dir",
           str(REPO / "tests/data/census/models/tiny-deepseek-v3"))
    took = time.monotonic() - t0
    assert r.returncode == 3, r.stdout + r.stderr
    assert f"nothing listening at {url}" in r.stderr.strip().splitlines()[-1]
    assert took < 20, f"{took:.0f} s"


def test_preflight_calls_a_closed_api_port_on_a_node_a_warning():
    c = check_node(f"127.0.0.1:{free_port()}", timeout=2)
    assert (c.status, c.have) == ("warn", "host up, API port closed")


# --- callers: one rule and one error text through the client ------------------------------------

def test_smoke_chat_failures_are_one_line_errors_with_their_exit_codes(vllm):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(UsageError, match=f"chat completion failed: nothing listening at {url}") \
            as ei:
        stream_chat(url, "m", "hi", 4, echo=False)
    assert ei.value.exit_code == EXIT_SERVER
    with pytest.raises(UsageError, match="chat completion failed: HTTP 404: ") as ei:
        stream_chat(vllm.url, "m", "hi", 4, echo=False)  # no chat script: the fake answers 404
    assert ei.value.exit_code == 2


def test_hang_up_cuts_a_stream_on_a_connection_close_response(fake_vllm):
    srv = fake_vllm(chat=lambda req, send: (send("a", 1), srv.closing.wait(60)))
    st, got = ChatStream(), threading.Event()
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
    t = threading.Thread(target=ServerAPI(srv.url).stream_chat, daemon=True,
                         args=(body, st, lambda _text: got.set()))
    t.start()
    got.wait(10)  # the first chunk arrived: the stream is open
    st.hang_up()
    t.join(10)
    assert not t.is_alive() and st.done and st.error is None and st.tokens == 1
    assert srv.bodies[0]["stream"] is True


def test_wait_ready_reports_a_refused_key(vllm):
    url = vllm.url
    vllm.key = "s3cret"
    with pytest.raises(ServerError, match="refused /v1/models .*set K3_API_KEY"):
        wait_ready(url, "k3-smoke", timeout=5, quiet=True)
    assert wait_ready(url, "k3-smoke", timeout=5, api_key="s3cret", quiet=True) >= 0


def test_scale_overhead_with_a_wrong_key_says_so_in_one_line(vllm, k3):
    vllm.key = "s3cret"
    port = vllm.port
    r = k3("scale", "overhead", env={
        "K3_SCALE_MODE": "replicas", "K3_SCALE_NODES": f"127.0.0.1:{port},127.0.0.1:{free_port()}",
        "K3_SCALE_ROUTER_HOST": "127.0.0.1", "K3_SCALE_ROUTER_PORT": str(free_port()),
        "K3_API_KEY": "wrong"})
    assert r.returncode == 3, r.stdout + r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "refused /v1/models (HTTP 401); set K3_API_KEY" in err[0], err


def test_scale_status_sends_no_header_for_empty(vllm):
    st = status.replica_status(vllm.url.removeprefix("http://"), api_key="EMPTY")
    assert (st.health, st.models) == ("ok", ["k3-smoke"])
    assert {(p, a) for _, p, a in vllm.seen} == {
        ("/health", None), ("/v1/models", None), ("/metrics", None)}
