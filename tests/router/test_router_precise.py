"""Precise prefix routing: `pagefleet router --kv-events-endpoint --tokenizer` in front of
two real pods that publish their KV cache events (`--kv-events-config`, ipc sockets).
A prompt one pod was sent directly (the router never saw it, and its approximate table
would send it to the other pod) goes to the pod whose cache holds it, known from the
replay of that pod's events when the router starts; once that pod has evicted it, the
router no longer prefers it. The index's own rules (stored, removed, cleared, the
longest common run) are checked on the events of a real engine's format. Requests whose
blocks the router cannot name (chats, batches, adapters) are counted by why, and a gap in
a pod's events that no replay fills (a batch its full queue dropped) makes the router
forget what that pod held."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import msgspec
import pytest
import zmq.asyncio
from pagefleet_router.discovery import PodMetrics, StaticEndpoints
from pagefleet_router.kv_feed import FeedSettings, PodFeed, PreciseRouting
from pagefleet_router.kv_index import KVBlockIndex, PromptBlocks, chain_names
from pagefleet_router.proxy import Router, RouterSettings
from pagefleet_serve.frontend.tokenizer import load_tokenizer
from pagefleet_serve.kv_event_messages import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
)

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


def test_a_gap_no_replay_fills_forgets_what_the_pod_held():
    index = KVBlockIndex()
    context = zmq.asyncio.Context()
    feed = PodFeed("http://p0:8000", FeedSettings("tcp://{host}:5557"), index, context)
    a, b = chain_names(list(range(32)), 16, 64), chain_names(list(range(900, 932)), 16, 64)

    def receive(sequence: int, event: BlockStored) -> None:
        payload = msgspec.msgpack.encode(EventBatch(time.time(), [event]))
        asyncio.run(feed._receive(sequence, payload))

    try:
        receive(0, stored(a))
        receive(1, stored(b))
        assert index.cached_blocks(a) == {feed.url: 2} and index.num_blocks(feed.url) == 4
        # batch 2 was dropped by the pod's full queue (no replay socket here either):
        # whether it removed a's blocks is not known, so nothing before it is trusted
        receive(3, stored(b[:1]))
        assert index.cached_blocks(a) == {} and index.num_blocks(feed.url) == 1
        receive(4, stored(a))
        assert index.cached_blocks(a) == {feed.url: 2}
    finally:
        context.term()


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


def test_only_a_base_model_completion_is_named_and_the_rest_is_counted_by_why(tokenizer_file):
    blocks = PromptBlocks(tokenizer_file, 4, 64)
    pods = ("http://10.0.0.1:8000", "http://10.0.0.2:8000")
    router = Router(
        RouterSettings(),
        StaticEndpoints(pods),
        precise=PreciseRouting(blocks, KVBlockIndex(), None),  # type: ignore[arg-type]
    )
    router.registry.set_endpoints(list(pods))
    router.registry.update(pods[1], PodMetrics(0, 0, 0, frozenset({"sql"})))

    def key(path: str, **body) -> list[bytes]:
        found = router.routing_key(path, json.dumps({"model": "smol", **body}).encode())
        assert found is not None
        return found.block_names

    def fallbacks() -> dict[str, float]:
        counted = router.metrics.precise_fallbacks.collect()[0].samples
        return {s.labels["reason"]: s.value for s in counted if s.name.endswith("_total")}

    assert fallbacks() == {"chat_template": 0, "prompt_form": 0, "adapter": 0}
    text = "The bridge she built still stands over the river, and the mill beside it."
    ids = blocks.tokenizer.encode(text, add_special_tokens=False).ids
    assert key("/v1/completions", prompt=text) == chain_names(ids, 4, 64) != []
    assert key("/v1/completions", prompt=[ids]) == chain_names(ids, 4, 64)
    assert key("/v1/embeddings", input=text) == []  # nothing cached to route by
    assert fallbacks() == {"chat_template": 0, "prompt_form": 0, "adapter": 0}
    messages = [{"role": "user", "content": text}]
    assert key("/v1/chat/completions", messages=messages) == []
    assert key("/v1/responses", input=text) == []
    assert key("/v1/completions", prompt=[text, text]) == []
    found = router.routing_key(
        "/v1/completions", json.dumps({"model": "sql", "prompt": text}).encode()
    )
    assert found is not None and found.block_names == []  # a pod serves "sql" as an adapter
    assert fallbacks() == {"chat_template": 2, "prompt_form": 1, "adapter": 1}


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
            assert read_metrics(first.base_url)["pagefleet:kv_events_dropped_total"] == 0
            chat = {"model": body["model"], "messages": [{"role": "user", "content": prompt}]}
            response = client.post(
                f"{router.base_url}/v1/chat/completions", json=chat | {"max_tokens": 1}
            )
            assert response.status_code == 200, response.text
            fallback = 'pagefleet:router_precise_fallbacks_total{reason="chat_template"}'
            assert router.metrics()[fallback] == 1  # routed, by the approximate table
            assert router.metrics()[cached] == 1
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
