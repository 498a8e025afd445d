"""Precise prefix routing: `pagefleet router --kv-events-endpoint --tokenizer` in front of
two real pods that publish their KV cache events (`--kv-events-config`, ipc sockets).
A prompt one pod was sent directly (the router never saw it, and its approximate table
would send it to the other pod) goes to the pod whose cache holds it, known from the
replay of that pod's events when the router starts; once that pod has evicted it, the
router no longer prefers it. The index's own rules (stored, removed, cleared, the
longest common run) are checked on the events of a real engine's format."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from pagefleet_router.kv_index import KVBlockIndex, chain_names
from pagefleet_serve.frontend.tokenizer import load_tokenizer
from pagefleet_serve.kv_event_messages import AllBlocksCleared, BlockRemoved, BlockStored

from tests.router.test_router_proxy import (
    API_KEY,
    RouterProcess,
    auth,
    completion,
    prompt_homed_on,
)
from tests.server.server_harness import ServerProcess, free_port, read_metrics, wait_until

# 17 blocks of 16 tokens: a dozen prompts of ~100 tokens evict the first.
POD_FLAGS = ("--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "12MiB")


def stored(names: list[bytes], parent: bytes | None = None) -> BlockStored:
    return BlockStored(names, parent, list(range(16 * len(names))), 16, None, "GPU", None)


def test_the_index_follows_stores_removals_and_clears_and_matches_leading_runs():
    index = KVBlockIndex()
    a = chain_names(list(range(64)), 16, 64)  # 4 blocks
    b = chain_names([*range(32), *range(900, 932)], 16, 64)  # shares a's first 2
    index.apply("p0", [stored(a)])
    index.apply("p1", [stored(b[:2]), stored(b[2:], b[1])])
    assert index.cached_blocks(a) == {"p0": 4, "p1": 2}
    assert index.cached_blocks(b) == {"p0": 2, "p1": 4}
    index.apply("p0", [BlockRemoved([a[1]], "GPU")])  # a hole: only the first block leads
    assert index.cached_blocks(a) == {"p0": 1, "p1": 2}
    index.apply("p1", [AllBlocksCleared()])
    assert index.cached_blocks(b) == {"p0": 1}
    index.clear("p0")
    assert index.cached_blocks(a) == {} and index.num_blocks("p0") == 0


@pytest.fixture(scope="module")
def pods(tmp_path_factory):
    sockets = tmp_path_factory.mktemp("kv")
    started = []
    for _ in range(2):
        port = free_port()
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"ipc://{sockets}/events-{port}",
            "replay_endpoint": f"ipc://{sockets}/replay-{port}",
        }
        flags = ("--port", str(port), "--kv-events-config", json.dumps(config))
        started.append(ServerProcess(*POD_FLAGS, "--api-key", API_KEY, *flags))
    try:
        yield [p.wait_ready() for p in started], sockets
    finally:
        for process in started:
            process.stop()


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    load_tokenizer("builtin://smollm2-135m").backend_tokenizer.save(str(path))
    return path


def hits(pod: ServerProcess) -> float:
    return read_metrics(pod.base_url)["vllm:prefix_cache_hits_total"]


def test_a_prompt_goes_to_the_pod_whose_cache_holds_it_until_it_is_evicted(pods, tokenizer_file):
    (first, second), sockets = pods
    urls = [first.base_url, second.base_url]
    # A prompt the approximate table alone would send to the second pod, cached on the first.
    prompt = prompt_homed_on(urls[1], urls) + " and the bridge she built still stands. " * 6
    with httpx.Client(timeout=120, headers=auth()) as client:
        response = client.post(f"{first.base_url}/v1/completions", json=completion(prompt, 1))
        assert response.status_code == 200, response.text
        router = RouterProcess(
            urls,
            "--kv-events-endpoint",
            f"ipc://{sockets}/events-{{port}}",
            "--kv-replay-endpoint",
            f"ipc://{sockets}/replay-{{port}}",
            "--tokenizer",
            str(tokenizer_file),
        )
        try:
            # The router learns the first pod's cache from its replay, once it follows it.
            blocks = f'pagefleet:router_kv_cached_blocks{{pod="{urls[0]}"}}'
            wait_until(lambda: router.metrics().get(blocks, 0) >= 4, 30, "the replay")
            before = hits(first)
            body = completion(prompt + " Why?", 1)
            response = client.post(f"{router.base_url}/v1/completions", json=body)
            assert response.status_code == 200, response.text
            cached = 'pagefleet:router_routing_decisions_total{reason="cached"}'
            assert router.metrics()[cached] == 1
            assert hits(first) - before >= 64  # the cached prompt's blocks, on the first pod
            served = router.metrics()
            pod_key = 'pagefleet:router_requests_total{{code="200",pod="{}"}}'
            assert served.get(pod_key.format(urls[0]), 0) >= 1

            # Other prompts fill the first pod's small cache: the prompt's blocks go.
            for n in range(12):
                filler = f"Unrelated story {n}: " + "the river ran north past the mill. " * 12
                response = client.post(
                    f"{first.base_url}/v1/completions", json=completion(filler, 1)
                )
                assert response.status_code == 200, response.text
            time.sleep(1)  # the last evictions' events reach the router within milliseconds
            response = client.post(f"{router.base_url}/v1/completions", json=body)
            assert response.status_code == 200, response.text
            assert router.metrics()[cached] == 1  # evicted: no longer routed by the cache
        finally:
            router.stop()
