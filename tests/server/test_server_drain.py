"""Graceful drain of a `pagefleet serve` process on SIGTERM: /ready turns 503 at once, new
requests get 503, in-flight streams finish (or, past --shutdown-timeout, end with an error
event), the process exits 0; a second SIGTERM exits at once.

No test relies on generation speed: where a stream must still be running when the drain
deadline passes (or when the second signal comes), the server and its children are
stopped (SIGSTOP) once the drain has begun, so no token is made while the clock runs."""

import contextlib
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.server.server_harness import ServerProcess, assert_error, sse_events, wait_until

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


def process_tree(pid: int) -> list[int]:
    """The process and its descendants (an engine core process, if any), parents first."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [pid, *(p for child in children for p in process_tree(int(child)))]


@contextlib.contextmanager
def stopped(server: ServerProcess):
    """No instruction of the server or its children runs inside this block; time does."""
    pids = process_tree(server.process.pid)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in reversed(pids):
            os.kill(pid, signal.SIGCONT)


def wait_for_log(server: ServerProcess, text: str) -> None:
    wait_until(lambda: text in server.log_text(), 10, f"{text!r} in the server log")


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
            # Logged just before the drain reads its clock for the deadline.
            wait_for_log(server, "draining: 1 requests in flight")
            with stopped(server):
                time.sleep(2)  # past the 1 s deadline, with no token made meanwhile
            events = sse_events([first, *lines])
    assert events[-1] == "DONE"
    assert events[-2]["error"]["code"] == "server_shutting_down"
    assert len(events) < 900  # cut short, not run to completion
    assert "drain timeout: cancelling 1 requests" in server.log_text()
    assert server.process.wait(timeout=60) == 0


def test_second_sigterm_exits_at_once(start):
    server = start("--shutdown-timeout", "600")
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        with open_stream(client, max_tokens=900) as stream:
            lines = stream.iter_lines()
            first_token(lines)
            server.signal(signal.SIGTERM)
            wait_for_log(server, "draining: 1 requests in flight")
            # The second signal is pending before the stream can make another token.
            with stopped(server):
                started = time.monotonic()
                server.signal(signal.SIGTERM)
            server.process.wait(timeout=15)
    assert time.monotonic() - started < 15
    assert "second shutdown signal" in server.log_text()
    assert "drain complete" not in server.log_text()
