"""Errors, limits and disconnects against a server whose engine this test can reach (uvicorn
in a thread): OpenAI's error JSON for every case, 401 with an API key, 429 when the queue
is full, keep-alive comments while queued, disconnects that free their KV blocks, an engine
failure that fails one request only, and /health when the engine hangs or dies."""

import dataclasses
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from httpx_sse import connect_sse
from pagefleet_serve.engine.core import EngineCore

from tests.server.server_harness import (
    ThreadServer,
    assert_error,
    read_metrics,
    sse_events,
    wait_until,
)

API_KEY = "test-secret"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 256
MAX_QUEUED = 2


def start_server() -> ThreadServer:
    # One sequence at a time, so a second request is queued behind a running one.
    return ThreadServer(
        {
            "api_key": API_KEY,
            "max_num_queued_requests": MAX_QUEUED,
            "sse_keepalive_interval": 0.3,
            "stream_coalesce_interval": 0.2,
        },
        max_num_seqs=1,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=64 << 20,
    )


@pytest.fixture(scope="module")
def server():
    running = start_server()
    yield running
    running.stop()


@pytest.fixture
def own_server():
    """A server of this test's own, for a test that kills its engine."""
    running = start_server()
    yield running
    running.stop()


def client_of(server: ThreadServer) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60)


@pytest.fixture
def http(server):
    with client_of(server) as client:
        yield client


@pytest.fixture
def idle(server):
    """After the test: nothing running or queued, every KV block free, no leaks."""
    yield
    engine = server.core
    wait_until(
        lambda: not engine.has_unfinished_requests() and server.state.num_queued == 0,
        30,
        "the engine to go idle",
    )
    wait_until(lambda: engine.block_manager.num_used_blocks == 0, 10, "all blocks to be free")
    engine.block_manager.check_no_leaks()


def post(http, path: str, body) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return http.post(path, content=body, headers={"content-type": "application/json"})
    return http.post(path, json=body)


def long_stream(http, path="/v1/completions", max_tokens=200):
    body = {
        "prompt": "Once upon a time",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
    return http.stream("POST", path, json=body)


# -- authentication -----------------------------------------------------------------------
def test_api_key_is_required_on_v1_only(server):
    with httpx.Client(base_url=server.base_url, timeout=30) as anonymous:
        assert_error(anonymous.get("/v1/models"), 401, code="invalid_api_key")
        wrong = anonymous.post(
            "/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer nope"}
        )
        assert_error(wrong, 401, code="invalid_api_key")
        for open_path in ("/health", "/ready", "/metrics"):
            assert anonymous.get(open_path).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0
        ).models.list()
    ok = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)
    assert ok.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=2).usage


def test_more_than_one_authorization_header_is_refused(server):
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        for second in (AUTH["Authorization"], "Bearer nope"):
            twice = client.get(
                "/v1/models",
                headers=[("Authorization", AUTH["Authorization"]), ("Authorization", second)],
            )
            assert_error(twice, 400, code="duplicate_header")


# -- 400s ---------------------------------------------------------------------------------
BAD_REQUESTS = [
    # (path, body, param the error must name)
    ("/v1/completions", b'{"prompt": "hi",', None),  # malformed JSON
    ("/v1/completions", b"[1, 2]", None),  # not an object
    ("/v1/completions", {"max_tokens": 4}, "prompt"),  # missing
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "4"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "top_k": -5}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "min_p": 2}, "min_p"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, "prompt"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": -9},
        "frequency_penalty",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "stream_options": {"include_usage": "yes"},
        },
        "stream_options",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    BAD_REQUESTS,
    ids=[f"{i}-{p}" for i, (_, _, p) in enumerate(BAD_REQUESTS)],
)
def test_bad_request_is_400_naming_the_field(http, path, body, param):
    error = assert_error(post(http, path, body), 400, param=param)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert param in error["message"]


def test_context_length_exceeded(http):
    response = post(http, "/v1/completions", {"prompt": "hello " * 100, "max_tokens": 200})
    error = assert_error(response, 400, code="context_length_exceeded", param="prompt")
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
    assert "in the prompt, 200 in the completion" in error["message"]
    long_chat = {"messages": [{"role": "user", "content": "word " * 300}]}
    error = assert_error(
        post(http, "/v1/chat/completions", long_chat),
        400,
        code="context_length_exceeded",
        param="messages",
    )
    assert str(MAX_MODEL_LEN) in error["message"]


def test_unknown_model_is_404(http):
    error = assert_error(
        post(http, "/v1/completions", {"model": "gpt-9", "prompt": "hi"}),
        404,
        code="model_not_found",
    )
    assert "gpt-9" in error["message"]
    assert_error(http.get("/v1/no-such-route"), 404)


def test_server_still_answers_after_a_burst_of_bad_requests(http, idle):
    for path, body, _ in BAD_REQUESTS * 3:
        assert post(http, path, body).status_code == 400
    good = post(
        http,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
            "user": "tester",
            "unknown_field": {"ignored": True},
        },
    )
    assert good.status_code == 200 and good.json()["choices"][0]["message"]["content"]


# -- queue limit, keep-alive, disconnects -------------------------------------------------
def read_until(lines, predicate, timeout=60.0) -> list:
    """Read SSE lines (skipping blanks) until one satisfies `predicate`."""
    seen = []
    deadline = time.monotonic() + timeout
    for line in lines:
        if line:
            seen.append(line)
            if predicate(line):
                return seen
        assert time.monotonic() < deadline, f"no matching line in time; got {seen}"
    raise AssertionError(f"stream ended first; got {seen}")


def is_token(line: str) -> bool:
    return line.startswith('data: {"id"') and '"text":""' not in line


def test_queue_full_is_429_with_retry_after(server, http, idle):
    with long_stream(http) as running:
        # Hold on to the line iterators: a dropped one closes its connection.
        running_lines = running.iter_lines()
        read_until(running_lines, is_token)
        with long_stream(http) as queued_1, long_stream(http) as queued_2:
            assert queued_1.status_code == queued_2.status_code == 200
            wait_until(lambda: server.state.num_queued == MAX_QUEUED, 10, "two queued requests")
            # Keep-alive comments flow while a request waits in the queue.
            queued_lines = queued_1.iter_lines()
            read_until(queued_lines, lambda line: line.startswith(":"))
            rejected = post(http, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
            assert_error(rejected, 429, code="queue_full")
            assert int(rejected.headers["retry-after"]) >= 1
            metrics = read_metrics(server.base_url)
            assert metrics['pagefleet:requests_rejected_total{reason="queue_full"}'] >= 1
            assert metrics["pagefleet:num_requests_queued"] == MAX_QUEUED


def test_opted_in_keepalive_comments_are_skipped_by_httpx_sse(server, http, idle):
    """This server sends a comment every 0.3s of silence; a queued stream read by httpx-sse
    still yields every event."""
    with long_stream(http, max_tokens=12) as running:
        running_lines = running.iter_lines()  # held: a dropped iterator closes the stream
        read_until(running_lines, is_token)
        body = {"prompt": "Hi", "max_tokens": 3, "ignore_eos": True, "stream": True}
        with connect_sse(http, "POST", "/v1/completions", json=body) as source:
            data = [event.data for event in source.iter_sse()]
    assert data[-1] == "[DONE]"
    assert sum(1 for d in data[:-1] if json.loads(d)["choices"][0]["finish_reason"]) == 1


def test_disconnects_abort_and_free_kv_blocks(server, http, idle):
    before = read_metrics(server.base_url)
    with long_stream(http) as running:
        lines = running.iter_lines()
        read_until(lines, is_token)
        with long_stream(http) as queued:
            wait_until(
                lambda: read_metrics(server.base_url)["vllm:num_requests_waiting"] == 1,
                10,
                "the second request to wait in the engine queue",
            )
        # The queued client has gone: its request leaves the engine's queue.
        wait_until(
            lambda: read_metrics(server.base_url)["vllm:num_requests_waiting"] == 0,
            10,
            "the dropped queued request to leave",
        )
        assert queued.is_closed
        for _ in range(3):
            read_until(lines, is_token)
        assert read_metrics(server.base_url)["vllm:kv_cache_usage_perc"] > 0
    # The running client dropped mid-stream: its blocks are freed.
    after = wait_until(
        lambda: (m := read_metrics(server.base_url))["vllm:num_requests_running"] == 0 and m,
        10,
        "the dropped stream to stop running",
    )
    assert after["vllm:kv_cache_usage_perc"] == 0.0
    assert after["vllm:num_requests_waiting"] == 0.0
    aborted = 'vllm:request_success_total{finished_reason="abort"}'
    assert after[aborted] - before.get(aborted, 0.0) == 2


def test_non_streaming_client_that_disconnects_is_aborted(server, idle):
    body = b'{"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": true}'
    # A raw socket: send the request, wait until it runs, then hang up without reading.
    import socket

    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
            b"application/json\r\nAuthorization: Bearer "
            + API_KEY.encode()
            + b"\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        wait_until(lambda: server.engine.stats.num_running == 1, 10, "the request to run")
    wait_until(lambda: server.engine.stats.num_running == 0, 10, "the request to be aborted")


def test_coalesced_stream_equals_non_stream(server, http, idle, monkeypatch):
    # A 5 s interval: the 11 tokens after the first come well inside one window (or two on
    # a machine so loaded that a step takes over 0.45 s), whatever the step time; with the
    # module's 0.2 s a loaded machine's steps are each their own chunk, so the count
    # would say nothing about coalescing.
    state = server.server.state
    monkeypatch.setattr(
        state, "settings", dataclasses.replace(state.settings, stream_coalesce_interval=5.0)
    )
    body = {
        "prompt": "The three primary colors are",
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
    }
    whole = post(http, "/v1/completions", body).json()
    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as response:
        events = sse_events(response.iter_lines())
    chunks = [e for e in events if isinstance(e, dict)]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    # The first token alone (it goes out at once), then the other 11 merged: without
    # coalescing each token would be its own chunk.
    assert 2 <= len(chunks) <= 3 and events[-1] == "DONE", [c["choices"][0] for c in chunks]
    assert all(c["choices"][0]["text"] for c in chunks[:-1])  # no empty chunk is sent


def test_unexpected_error_is_a_500_in_openai_form(server, http, idle, monkeypatch):
    from pagefleet_serve.server import app

    def broken(*_):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(app, "list_models", broken)
    error = assert_error(http.get("/v1/models"), 500)
    assert error["type"] == "server_error" and error["message"] == "internal server error"
    monkeypatch.undo()
    # A new connection: uvicorn closes the one the unhandled exception went through.
    with client_of(server) as fresh:
        assert fresh.get("/v1/models").status_code == 200
    assert httpx.get(f"{server.base_url}/health").status_code == 200


# -- engine failures ----------------------------------------------------------------------
def fail_next_steps(server, count: int, delay: float = 0.0):
    """Make the engine's next `count` model steps raise (after `delay` seconds)."""
    executor = server.core.executor
    real = executor.execute
    left = [count]

    def execute(step):
        if left[0] > 0:
            left[0] -= 1
            time.sleep(delay)
            raise RuntimeError("injected step failure")
        return real(step)

    executor.execute = execute
    return lambda: executor.__dict__.pop("execute", None)


def test_engine_failure_fails_only_that_request(server, http, idle):
    restore = fail_next_steps(server, 1)
    try:
        error = assert_error(
            post(http, "/v1/completions", {"prompt": "Hello", "max_tokens": 4}), 500
        )
        assert error["type"] == "server_error" and "injected step failure" in error["message"]
        fail_next_steps(server, 1)
        with http.stream(
            "POST", "/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "stream": True}
        ) as response:
            assert response.status_code == 200
            events = sse_events(response.iter_lines())
        assert events[-2]["error"]["type"] == "server_error" and events[-1] == "DONE"
    finally:
        restore()
    good = post(http, "/v1/completions", {"prompt": "Hello", "max_tokens": 4})
    assert good.status_code == 200
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_health_is_503_while_a_step_hangs(server, http, idle, monkeypatch):
    monkeypatch.setattr(server.engine, "STEP_TIMEOUT_S", 0.5)
    executor = server.core.executor
    real = executor.execute
    release = threading.Event()

    def slow(step):
        release.wait(timeout=30)
        return real(step)

    monkeypatch.setattr(executor, "execute", slow)
    with long_stream(http, max_tokens=2):
        wait_until(
            lambda: httpx.get(f"{server.base_url}/health").status_code == 503,
            10,
            "/health to report the hung step",
        )
        assert_error(httpx.get(f"{server.base_url}/ready"), 503, code="engine_unhealthy")
        # A hung step may pass: a request sent meanwhile waits for the engine, not refused.
        queued = ThreadPoolExecutor(1).submit(
            httpx.post,
            f"{server.base_url}/v1/completions",
            json={"prompt": "hi", "max_tokens": 2},
            headers=dict(http.headers),
            timeout=60,
        )
        time.sleep(0.5)
        assert not queued.done(), queued.result().text
        monkeypatch.setattr(executor, "execute", real)
        release.set()
        wait_until(
            lambda: httpx.get(f"{server.base_url}/health").status_code == 200,
            10,
            "/health to recover",
        )
        assert queued.result().status_code == 200, queued.result().text


def test_dead_engine_turns_health_503(own_server):
    server = own_server  # it kills the engine: never the module's shared one
    failures = EngineCore.MAX_CONSECUTIVE_FAILURES
    fail_next_steps(server, failures)
    with client_of(server) as http:
        for _ in range(failures):  # each request's first step fails; the last is fatal
            assert_error(post(http, "/v1/completions", {"prompt": "Hello", "max_tokens": 4}), 500)
        wait_until(
            lambda: httpx.get(f"{server.base_url}/health").status_code == 503,
            10,
            "/health to report the dead engine",
        )
        assert httpx.get(f"{server.base_url}/ready").status_code == 503
        error = assert_error(post(http, "/v1/completions", {"prompt": "hi"}), 503)
        assert error["code"] == "engine_unhealthy"
