"""A stream nobody reads (issue 68, class 7): a client that opens an SSE stream with a
large output (n=16, logprobs=20, ignore_eos) and then reads nothing fills its socket's
buffers; the server's write then waits, and after --stream-write-timeout seconds the
stream is aborted with its request, so its output stops piling up in the server and its
KV blocks go back, while the client still holds the connection. Other requests are served
meanwhile and after. Without a write timeout all 16 x 4,000 tokens are generated into the server's memory."""

import json
import socket
import time

import httpx
import pytest

from tests.engine.hub_server import save_tiny_llama
from tests.server.server_harness import ThreadServer, read_metrics, wait_until

WRITE_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # A tiny model steps fast, so its unread output fills the socket's buffers (up to the
    # kernel's 4 MiB send buffer) within seconds.
    model = save_tiny_llama(tmp_path_factory.mktemp("tiny"), max_position_embeddings=4096)
    running = ThreadServer(
        {"stream_write_timeout": WRITE_TIMEOUT},
        model=str(model),
        max_num_seqs=20,
        max_model_len=4096,
        kv_cache_memory_bytes=64 << 20,
    )
    yield running
    running.stop()


def open_unread_stream(base_url: str) -> socket.socket:
    """A streamed completion sent on a socket with a small receive buffer, never read."""
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    body = json.dumps(
        {
            "prompt": "Once upon a time",
            "max_tokens": 4000,
            "n": 16,
            "logprobs": 20,
            "ignore_eos": True,
            "temperature": 1.0,
            "stream": True,
        }
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock.sendall(head + body)
    return sock


def test_a_stream_nobody_reads_is_aborted_and_frees_its_blocks(server):
    free = server.core.block_manager.num_free_blocks
    sock = open_unread_stream(server.base_url)
    try:
        wait_until(server.core.has_unfinished_requests, 30, "the request to start")
        started = time.monotonic()
        # Served meanwhile: the stalled stream holds no one else up.
        answer = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"prompt": "Hello", "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        wait_until(
            lambda: not server.core.has_unfinished_requests(),
            60,
            "the unread stream's request to be aborted",
        )
        aborted_after = time.monotonic() - started
        # The whole output would be 64,000 tokens: it stopped long before (seconds to fill
        # the socket's buffers, then the write timeout).
        assert aborted_after < 45, aborted_after
        server.core.block_manager.check_no_leaks()
        assert server.core.block_manager.num_free_blocks == free
        metrics = read_metrics(server.base_url)
        assert metrics["vllm:generation_tokens_total"] < 64_000 // 2
        assert metrics["pagefleet:stream_write_timeouts_total"] == 1
    finally:
        sock.close()
    # The server still serves, streams included.
    with httpx.stream(
        "POST",
        f"{server.base_url}/v1/completions",
        json={"prompt": "Hello", "max_tokens": 4, "stream": True},
        timeout=60,
    ) as stream:
        assert stream.status_code == 200
        assert "data: [DONE]" in stream.read().decode()
