"""Request fields with no natural bound, against a `pagefleet serve` process (issue 68,
items 1 and 5): `metadata` within OpenAI's bounds (16 pairs, keys of 64 characters, values
of 512) on every endpoint that takes it, `user` and message names capped, each a 400 naming
the field; a body's parse cost bounded before it is parsed, so that 4 MB of 270,000 tiny
keys is refused at once and /health keeps answering within 100 ms while fifty of them
arrive together."""

import gc
import json
import socket
import threading
import time

import httpx
import pytest
from pagefleet_serve.server.body_cost import MAX_BODY_VALUES, count_values
from pagefleet_serve.server.protocol import (
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE_CHARS,
    MAX_NAME_CHARS,
    MAX_USER_CHARS,
)

from tests.server.server_harness import ServerProcess, assert_error, probe_health

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
RESPONSES = {"input": "hi", "max_output_tokens": 1}


@pytest.fixture(scope="module")
def server():
    process = ServerProcess(
        *("--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4"),
        *("--kv-cache-memory", "32MiB"),
        # Refusals answered at once: the probe then meets every body's work together,
        # not spread over the throttle's delays.
        *("--refusal-delay", "0"),
    )
    try:
        yield process.wait_ready()
    finally:
        process.stop()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def pairs(count: int, key_chars: int = 4, value_chars: int = 1) -> dict[str, str]:
    return {f"{i:0{key_chars}d}"[-key_chars:]: "v" * value_chars for i in range(count)}


LONG_KEY = {"k" * (MAX_METADATA_KEY_CHARS + 1): "v"}
LONG_VALUE = {"k": "v" * (MAX_METADATA_VALUE_CHARS + 1)}
REFUSED = [
    ("/v1/responses", RESPONSES | {"metadata": pairs(MAX_METADATA_PAIRS + 1)}, "metadata", "16"),
    ("/v1/responses", RESPONSES | {"metadata": LONG_KEY}, "metadata", "64"),
    ("/v1/responses", RESPONSES | {"metadata": LONG_VALUE}, "metadata", "512"),
    ("/v1/chat/completions", CHAT | {"metadata": pairs(MAX_METADATA_PAIRS + 1)}, "metadata", "16"),
    ("/v1/chat/completions", CHAT | {"metadata": LONG_KEY}, "metadata", "64"),
    ("/v1/chat/completions", CHAT | {"metadata": LONG_VALUE}, "metadata", "512"),
    ("/v1/responses", RESPONSES | {"user": "u" * (MAX_USER_CHARS + 1)}, "user", "256"),
    ("/v1/chat/completions", CHAT | {"user": "u" * (MAX_USER_CHARS + 1)}, "user", "256"),
    ("/v1/completions", {"prompt": "hi", "user": "u" * (MAX_USER_CHARS + 1)}, "user", "256"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi", "name": "n" * (MAX_NAME_CHARS + 1)}]},
        "messages",
        "64",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "param", "words"), REFUSED, ids=[f"{i}-{r[2]}" for i, r in enumerate(REFUSED)]
)
def test_a_field_past_its_bound_is_400_naming_it(http, path, body, param, words):
    error = assert_error(http.post(path, json=body), 400, param=param)
    assert param in error["message"] and words in error["message"], error
    assert len(error["message"]) < 400, "the refusal echoes what it refuses"


def test_metadata_at_its_bounds_is_kept_and_echoed(http):
    metadata = pairs(MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS)
    response = http.post("/v1/responses", json=RESPONSES | {"metadata": metadata})
    assert response.status_code == 200, response.text
    assert response.json()["metadata"] == metadata
    chat = http.post("/v1/chat/completions", json=CHAT | {"metadata": metadata})
    assert chat.status_code == 200, chat.text


def many_keys(size: int) -> bytes:
    """`metadata` of as many tiny pairs as fit in `size` bytes (270,000 in 4 MB)."""
    metadata = {f"k{i:06d}": "v" for i in range(size // 14)}
    return json.dumps(RESPONSES | {"metadata": metadata}, separators=(",", ":")).encode()


def test_the_value_count_is_exact_past_the_quick_bound():
    text = json.dumps({"prompt": '"[{' * (MAX_BODY_VALUES + 10)}).encode()
    assert count_values(text) == 3  # the object, its key, the one string
    assert count_values(many_keys(4_000_000)) == MAX_BODY_VALUES + 1
    # Every string ending in an escaped backslash: no quote counts as a sure delimiter.
    keys = {f"{i}\\": "\\" for i in range(MAX_BODY_VALUES)}
    assert count_values(json.dumps(keys).encode()) == MAX_BODY_VALUES + 1
    assert count_values(json.dumps(dict(list(keys.items())[:100])).encode()) == 201


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/completions"])
def test_a_body_of_many_tiny_values_is_refused_unparsed(http, path):
    body = many_keys(4_000_000)
    if path == "/v1/completions":  # the same map in a field the endpoint does not know
        body = body.replace(b'"metadata"', b'"anything"').replace(b'"input"', b'"prompt"')
    started = time.perf_counter()
    response = http.post(path, content=body, headers={"content-type": "application/json"})
    error = assert_error(response, 400, code="request_too_complex")
    assert str(MAX_BODY_VALUES) in error["message"]
    assert time.perf_counter() - started < 5


def post_raw(server, path: str, body: bytes) -> bytes:
    """POST `body` on a raw socket (one sendall, which leaves this process's interpreter
    lock to the probe) and return the whole answer."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=120) as sock:
        sock.sendall(head + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


def probe_while(
    server, body: bytes, senders: int, min_probes: int = 10
) -> tuple[list[float], list[bytes]]:
    """/health latencies, sorted, while `senders` clients post `body` at once (again, a
    wave at a time, until the probe has `min_probes` latencies: a fast machine refuses
    one wave within a few probes); and the answers they got."""
    answers: list[bytes] = []
    latencies: list[float] = []
    done = threading.Event()

    def send() -> None:
        answers.append(post_raw(server, "/v1/responses", body))

    prober = threading.Thread(target=probe, args=(server, latencies, done))
    prober.start()
    for _ in range(20):
        threads = [threading.Thread(target=send) for _ in range(senders)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        if len(latencies) >= min_probes:
            break
    done.set()
    prober.join(timeout=30)
    return sorted(latencies), answers


def probe(server, into: list[float], until: threading.Event) -> None:
    probe_health(server.base_url, into, until, interval=0.01)


def test_health_answers_within_100ms_while_50_such_bodies_are_refused(server):
    # A full collection in this process would stall the probe for reasons of its own.
    gc.collect()
    gc.disable()
    try:
        idle: list[float] = []
        idle_done = threading.Event()
        threading.Timer(1.0, idle_done.set).start()
        probe(server, idle, idle_done)
        # The control: as many bytes, in one string (refused by its length after a cheap
        # parse): what moving 200 MB through the loop costs on this machine.
        flat = json.dumps(RESPONSES | {"user": "u" * 4_000_000}).encode()
        control, _ = probe_while(server, flat, 50)
        latencies, answers = probe_while(server, many_keys(4_000_000), 50)
    finally:
        gc.enable()
    # Whole waves of 50, each body refused.
    assert len(answers) % 50 == 0 and len(latencies) >= 10, (len(answers), len(latencies))
    for answer in answers:
        assert answer.startswith(b"HTTP/1.1 400 ") and b"request_too_complex" in answer
    # Parsing each body stalled the loop for about half a second (/health past 4 s with
    # six clients). The bound: 100 ms at the 99th percentile, stretched, as in
    # test_server_liveness, by as much as a busy shared machine slows the idle probe (at
    # most 5 times), or within twice what the same bytes in one string cost the probe
    # (a machine too busy to move 200 MB quickly slows both alike; the stall still fails).
    idle.sort()
    slowdown = min(5.0, max(1.0, idle[int(0.9 * len(idle))] / 0.01))
    p99 = latencies[int(0.99 * len(latencies))]
    bound = max(0.1 * slowdown, 2 * control[int(0.99 * len(control))])
    assert p99 < bound, (slowdown, control[-3:], latencies[-5:])
