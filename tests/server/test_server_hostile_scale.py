"""Issue 42 item 2 at the probe's full scale (`make test-server-slow`; 50 s): 1,100 TCP
connections that send nothing, held for 40 s (each one the server closes at its header
timeout is opened again at once, as the attacker did), against `pagefleet serve` with its
defaults. /health answers 200 every second throughout and a normal request completes."""

import selectors
import socket
import threading
import time

import httpx
import pytest

from tests.server.server_harness import ServerProcess

CONNECTIONS = 1100
HOLD_S = 40


def hold_connections(port: int, stop: threading.Event, opened: list[int]) -> None:
    """Keep CONNECTIONS idle connections open until `stop`, reopening closed ones."""
    selector = selectors.DefaultSelector()  # epoll: more descriptors than select() takes

    def connect() -> None:
        selector.register(socket.create_connection(("127.0.0.1", port)), selectors.EVENT_READ)

    for _ in range(CONNECTIONS):
        connect()
    opened.append(CONNECTIONS)
    try:
        while not stop.is_set():
            for key, _ in selector.select(timeout=0.5):
                sock = key.fileobj
                if sock.recv(1, socket.MSG_PEEK) == b"":  # readable and idle: closed by it
                    selector.unregister(sock)
                    sock.close()
                    connect()
                    opened[0] += 1
    finally:
        for key in list(selector.get_map().values()):
            key.fileobj.close()
        selector.close()


@pytest.mark.slow
def test_1100_idle_connections_held_for_40_s_leave_health_and_requests_served():
    server = ServerProcess("--max-model-len", "512", "--kv-cache-memory", "32MiB").wait_ready()
    stop = threading.Event()
    opened: list[int] = []
    holder = threading.Thread(target=hold_connections, args=(server.port, stop, opened))
    try:
        holder.start()
        while not opened:
            time.sleep(0.1)
        slowest = 0.0
        with httpx.Client(base_url=server.base_url, timeout=10) as http:
            deadline = time.monotonic() + HOLD_S
            while time.monotonic() < deadline:
                started = time.monotonic()
                health = http.get("/health")
                slowest = max(slowest, time.monotonic() - started)
                assert health.status_code == 200, health.text
                time.sleep(1)
            response = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 8
        # The header timeout (10 s) closed and the holder reopened them: the attack held on.
        assert opened[0] >= 2 * CONNECTIONS, opened
        print(f"slowest /health {slowest * 1000:.0f} ms; connections opened {opened[0]}")
    finally:
        stop.set()
        holder.join(30)
        server.stop()
