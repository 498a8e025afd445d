"""Event-loop liveness against a `pagefleet serve` process: /health keeps answering within
100 ms while 8 MB prompts arrive (they are refused by length before any tokenizer runs),
bodies over the limit get 413 while they are still arriving, and clients that send their
headers or body too slowly are cut off within the read timeouts, and requests beyond the
limit are turned away while the probes still answer."""

import gc
import json
import socket
import threading
import time

import httpx
import pytest

from tests.server.inflight import StreamInFlight, run_normal
from tests.server.server_harness import ServerProcess, assert_error, probe_health, wait_until

BODY_LIMIT = 16 << 20
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 2.0
MAX_MODEL_LEN = 512
LIMIT_CONCURRENCY = 12


@pytest.fixture(scope="module")
def server():
    process = ServerProcess(
        *("--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8"),
        *("--kv-cache-memory", "64MiB", "--max-request-body-bytes", str(BODY_LIMIT)),
        *("--header-read-timeout", str(HEADER_TIMEOUT_S)),
        *("--body-read-timeout", str(BODY_TIMEOUT_S)),
        *("--limit-concurrency", str(LIMIT_CONCURRENCY)),
    )
    try:
        yield process.wait_ready()
    finally:
        process.stop()


@pytest.fixture(scope="module")
def alone(server):
    return run_normal(server.base_url)


def eight_megabytes(path: str) -> bytes:
    text = "word " * 1_600_000
    if path == "/v1/chat/completions":
        return json.dumps({"messages": [{"role": "user", "content": text}]}).encode()
    return json.dumps({"prompt": text, "max_tokens": 4}).encode()


def test_health_answers_within_100ms_while_8mb_prompts_arrive(server, alone):
    stop = threading.Event()
    latencies: list[float] = []
    answers: list[httpx.Response] = []

    def send(path: str) -> None:
        body = eight_megabytes(path)
        assert len(body) >= 8_000_000
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            while not stop.is_set():
                answers.append(
                    client.post(path, content=body, headers={"content-type": "application/json"})
                )

    def probe(into: list[float], until: threading.Event) -> None:
        probe_health(server.base_url, into, until, interval=0.02)

    # The probe times this process too: after a thousand tests its heap is large, and a full
    # garbage collection (which holds the GIL) would stall the probe for tens of
    # milliseconds that the server had no part in. No collection runs while it measures.
    gc.collect()
    gc.disable()
    try:
        # The same probe on the idle server first: how fast this machine answers now.
        idle: list[float] = []
        idle_done = threading.Event()
        threading.Timer(1.0, idle_done.set).start()
        probe(idle, idle_done)
        with StreamInFlight(server.base_url) as normal:
            threads = [
                threading.Thread(target=send, args=("/v1/completions",)),
                threading.Thread(target=send, args=("/v1/chat/completions",)),
                threading.Thread(target=probe, args=(latencies, stop)),
            ]
            for thread in threads:
                thread.start()
            time.sleep(4.0)
            stop.set()
            for thread in threads:
                thread.join(timeout=60)
            assert normal.result() == alone
    finally:
        gc.enable()
    assert len(answers) >= 4 and len(latencies) >= 20
    for answer in answers:
        error = assert_error(answer, 400, code="context_length_exceeded")
        assert error["param"] in ("prompt", "messages")
        assert f"maximum context length of {MAX_MODEL_LEN} tokens" in error["message"]
    # Tokenizing one such prompt on the event loop stalled it for 7.5 s. The bounds (the
    # 90th percentile under 100 ms, no probe over a second) hold on an idle machine, where
    # an idle probe takes under 10 ms; a busy shared machine stretches them by as much as
    # it slows the idle probe (at most 5 times: a stall like that one still fails), so
    # that its load does not decide the outcome.
    idle.sort()
    latencies.sort()
    slowdown = min(5.0, max(1.0, idle[int(0.9 * len(idle))] / 0.01))
    assert len(idle) >= 10, idle
    assert latencies[int(0.9 * len(latencies))] < 0.1 * slowdown, (slowdown, latencies[-5:])
    assert latencies[-1] < 1.0 * slowdown, (slowdown, latencies[-5:])


def raw_request(server, head: bytes, body_parts=(), pause_s: float = 0.0) -> bytes:
    """Send `head` then `body_parts` on a raw socket (stopping if the server hangs up) and
    return all it answers until it closes the connection."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head)
        try:
            for part in body_parts:
                sock.sendall(part)
                time.sleep(pause_s)
        except (BrokenPipeError, ConnectionResetError):
            pass
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
        return received


def json_error(raw: bytes, status: int) -> dict:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), raw[:300]
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def post_head(length: int | None, content_type: str = "application/json") -> bytes:
    size = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
        f"{size}\r\n\r\n"
    ).encode()


def test_a_declared_oversized_body_is_413_before_it_is_read(server):
    answer = raw_request(server, post_head(50_000_000), [b'{"prompt": "', b"x" * 65536])
    error = json_error(answer, 413)
    assert error["code"] == "request_too_large" and str(BODY_LIMIT) in error["message"]


def test_an_oversized_chunked_body_is_413_while_it_arrives(server):
    chunk = b"x" * (1 << 20)
    parts = [f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"] * 40  # 40 MiB, never finished
    started = time.monotonic()
    error = json_error(raw_request(server, post_head(None), parts), 413)
    assert error["code"] == "request_too_large"
    assert time.monotonic() - started < 20


def test_half_sent_headers_are_cut_off(server):
    started = time.monotonic()
    answer = raw_request(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
    assert answer == b""
    assert time.monotonic() - started < HEADER_TIMEOUT_S + 2


def test_a_silent_connection_is_cut_off(server):
    started = time.monotonic()
    assert raw_request(server, b"") == b""
    assert time.monotonic() - started < HEADER_TIMEOUT_S + 2


def test_a_body_that_stops_half_way_is_408_then_closed(server, alone):
    with StreamInFlight(server.base_url) as normal:
        started = time.monotonic()
        answer = raw_request(server, post_head(1000), [b'{"prompt": "'])
        error = json_error(answer, 408)
        assert error["code"] == "request_timeout"
        assert BODY_TIMEOUT_S - 0.5 < time.monotonic() - started < BODY_TIMEOUT_S + 2
        assert normal.result() == alone
    assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200


def test_requests_beyond_the_limit_get_503_while_probes_answer(server):
    """--limit-concurrency counts requests whose headers arrived (here: bodies still owed),
    not sockets; the next request is turned away at once with OpenAI's JSON, the probes are
    never behind the gate, and the held requests' slots come back when they time out."""
    held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(LIMIT_CONCURRENCY)]
    try:
        for sock in held:
            sock.sendall(post_head(1000) + b'{"prompt": "')
        time.sleep(0.3)  # well within the body timeout that would end them
        busy = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "hi"}, timeout=5)
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert busy.json()["error"]["code"] == "server_busy"
        assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200
        assert httpx.get(f"{server.base_url}/ready", timeout=5).status_code == 200
    finally:
        for sock in held:
            sock.close()
    wait_until(
        lambda: (
            httpx.post(
                f"{server.base_url}/v1/completions",
                json={"prompt": "hi", "max_tokens": 1},
                timeout=5,
            ).status_code
            == 200
        ),
        10,
        "the server to take requests again",
    )
