"""Graceful drain of a `pagefleet serve` process on SIGTERM: /ready turns 503 at once, new
requests get 503, in-flight streams finish (or, past --shutdown-timeout, end with an error
event), the process exits 0; a second SIGTERM exits at once."""

import signal
import time

import httpx
import pytest
from server_harness import ServerProcess, assert_error, sse_events, wait_until

ENGINE_FLAGS = ("--max-model-len", "1024", "--kv-cache-memory", "128MiB")


@pytest.fixture
def start():
    started = []

    def start_server(*flags: str) -> ServerProcess:
        process = ServerProcess(*ENGINE_FLAGS, *flags)
        started.append(process)
        return process.wait_ready()

    yield start_server
    for process in started:
        process.stop()


def open_stream(client: httpx.Client, max_tokens: int):
    body = {
        "prompt": "Once upon a time",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    return client.stream("POST", "/v1/completions", json=body)


def first_token(lines) -> str:
    for line in lines:
        if line.startswith("data: {"):
            return line
    raise AssertionError("the stream ended before its first token")


def test_sigterm_lets_the_stream_in_flight_finish(start):
    server = start("--shutdown-timeout", "60")
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        with open_stream(client, max_tokens=24) as stream:
            lines = stream.iter_lines()
            first = first_token(lines)
            server.signal(signal.SIGTERM)
            wait_until(lambda: client.get("/ready").status_code == 503, 10, "/ready to turn 503")
            assert_error(client.get("/ready"), 503, code="server_shutting_down")
            late = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert_error(late, 503, code="server_shutting_down")
            events = sse_events([first, *lines])
    assert events[-1] == "DONE"
    chunks = [e for e in events if isinstance(e, dict)]
    assert all("error" not in e for e in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert server.process.wait(timeout=60) == 0
    assert "drain complete" in server.log_text()


def test_drain_timeout_aborts_with_an_error_event_then_exits_0(start):
    server = start("--shutdown-timeout", "1")
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        with open_stream(client, max_tokens=900) as stream:
            lines = stream.iter_lines()
            first = first_token(lines)
            server.signal(signal.SIGTERM)
            events = sse_events([first, *lines])
    assert events[-1] == "DONE"
    assert events[-2]["error"]["code"] == "server_shutting_down"
    assert len(events) < 900  # cut short, not run to completion
    assert server.process.wait(timeout=60) == 0


def test_second_sigterm_exits_at_once(start):
    server = start("--shutdown-timeout", "600")
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        with open_stream(client, max_tokens=900) as stream:
            lines = stream.iter_lines()
            first_token(lines)
            server.signal(signal.SIGTERM)
            wait_until(lambda: client.get("/ready").status_code == 503, 10, "/ready to turn 503")
            started = time.monotonic()
            server.signal(signal.SIGTERM)
            server.process.wait(timeout=15)
    assert time.monotonic() - started < 15
    assert "second shutdown signal" in server.log_text()
