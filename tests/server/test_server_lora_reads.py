"""Adapter reads that never return, against a real `pagefleet serve` (issue 68, item 2): a
load from a hub that accepts the connection and never answers (a stalled download, as a
hung NFS or PVC mount would be) fails within --lora-read-timeout, while another adapter
loads at once beside it, and a second stalled load fails the same way (one blocked read
once wedged every later one); a SIGTERM while such a read is blocked still drains and
exits (the reader thread was joined at exit, so the pod waited for the read)."""

from __future__ import annotations

import signal
import socket
import threading
import time

import httpx
import pytest

from tests.server.server_harness import ServerProcess, assert_error, wait_until
from tests.server.test_server_lora import write_adapter
from tests.server.test_server_lora_hostile import ENV, load

READ_TIMEOUT_S = 8.0


class SilentHub:
    """A listening socket that accepts every connection and never answers."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.held.append(self.listener.accept()[0])
            except OSError:
                return

    def wait_for(self, connections: int) -> None:
        wait_until(lambda: len(self.held) >= connections, 60, "the read to reach the hub")

    def close(self) -> None:
        self.listener.close()
        for sock in self.held:
            sock.close()


@pytest.fixture(scope="module")
def hub():
    silent = SilentHub()
    yield silent
    silent.close()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("allowed")


@pytest.fixture(scope="module")
def server(hub, root, tmp_path_factory):
    env = ENV | {
        "HF_ENDPOINT": f"http://127.0.0.1:{hub.port}",
        "HF_HUB_OFFLINE": "0",
        "HF_HOME": str(tmp_path_factory.mktemp("hf-home")),
    }
    process = ServerProcess(
        *("--allowed-lora-root", str(root), "--lora-read-timeout", str(READ_TIMEOUT_S)),
        *("--shutdown-timeout", "5"),
        env=env,
    ).wait_ready()
    try:
        yield process
    finally:
        process.stop()


def stalled_load(server, name: str) -> tuple[threading.Thread, list]:
    answers: list = []

    def run() -> None:
        started = time.monotonic()
        answers.append((load(server, name, f"hf://org/{name}"), time.monotonic() - started))

    thread = threading.Thread(target=run)
    thread.start()
    return thread, answers


def test_a_stalled_read_fails_in_time_while_another_adapter_loads(server, hub, root):
    for number, name in enumerate(["stalled-1", "stalled-2"], 1):
        thread, answers = stalled_load(server, name)
        hub.wait_for(number)  # the read is blocked now
        good = load(server, f"good-{number}", write_adapter(root / f"good-{number}", 4, number))
        assert good.status_code == 200, good.text
        assert not answers, "the other load waited for the blocked read"
        thread.join(timeout=60)
        answer, took = answers[0]
        error = assert_error(answer, 400, code="invalid_lora_adapter")
        assert "--lora-read-timeout" in error["message"]
        assert READ_TIMEOUT_S - 0.5 < took < READ_TIMEOUT_S + 10
    completion = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": "good-2", "prompt": "Hello", "max_tokens": 2},
        timeout=60,
    )
    assert completion.status_code == 200, completion.text


def test_sigterm_drains_and_exits_while_a_read_is_blocked(server, hub):
    thread, _ = stalled_load(server, "stalled-at-exit")
    hub.wait_for(3)
    server.signal(signal.SIGTERM)
    started = time.monotonic()
    server.process.wait(timeout=60)
    assert time.monotonic() - started < 30
    thread.join(timeout=60)
