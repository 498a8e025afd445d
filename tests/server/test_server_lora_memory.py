"""Adapters' host memory bounded, against a real `pagefleet serve` (issue 68, item 3): by
default --max-cpu-loras is --max-loras (vLLM's default), so one adapter loaded under many
names keeps the pod's memory flat (the least recently used idle one leaves host memory and
is read back from its path when a request names it), and past --max-lora-adapters a load
is a clear 429 instead of one more adapter."""

from __future__ import annotations

import httpx
import psutil
import pytest

from tests.server.server_harness import ServerProcess, assert_error
from tests.server.test_server_lora import write_adapter
from tests.server.test_server_lora_hostile import ENV, load

NAMES = 48
RANK = 8  # 3.9 MB in float32, as the probe's adapter


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("allowed")


@pytest.fixture(scope="module")
def server(root):
    process = ServerProcess(
        *("--allowed-lora-root", str(root), "--max-lora-adapters", str(NAMES)), env=ENV
    ).wait_ready()
    try:
        yield process
    finally:
        process.stop()


def rss(server) -> int:
    """The pod's resident bytes: the API process and the engine core's."""
    parent = psutil.Process(server.process.pid)
    return sum(p.memory_info().rss for p in [parent, *parent.children(recursive=True)])


def test_one_adapter_under_many_names_keeps_memory_flat(server, root):
    path = write_adapter(root / "shared", RANK, 0)
    for index in range(8):
        assert load(server, f"name-{index}", path).status_code == 200
    before = rss(server)
    for index in range(8, NAMES):
        answer = load(server, f"name-{index}", path)
        assert answer.status_code == 200, answer.text
    grown = rss(server) - before
    # Each held in host memory grew the engine by 3.9 MB (40 more: 156 MB).
    assert grown < 40 << 20, f"{grown / 2**20:.0f} MiB more after {NAMES - 8} more names"
    full = load(server, "one-too-many", path)
    error = assert_error(full, 429, code="too_many_lora_adapters")
    assert f"{NAMES}" in error["message"] and "--max-lora-adapters" in error["message"]
    # The first name left host memory long ago: it is read back from its path.
    completion = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": "name-0", "prompt": "Hello", "max_tokens": 2},
        timeout=60,
    )
    assert completion.status_code == 200, completion.text
    unload = httpx.post(
        f"{server.base_url}/v1/unload_lora_adapter", json={"lora_name": "name-1"}, timeout=60
    )
    assert unload.status_code == 200, unload.text
    assert load(server, "one-too-many", path).status_code == 200
