"""/v1/embeddings behind the router: proxied to the pods, and never routed by prefix (an
embedding's pod keeps no KV past the request, so there is nothing to be affine to): its
requests go to the least loaded pod even when their text shares a completion's prefix.
The proxy half runs `python -m pagefleet_router` in front of a real embed pod on
loopback."""

from __future__ import annotations

import httpx
import pytest
from pagefleet_router.policy import PodState, PolicyConfig, choose_pod
from pagefleet_router.prefix import PrefixTable, block_hashes, prompt_text

from tests.engine.embedding_models import build_embedding_model
from tests.router.test_router_proxy import BLOCK_CHARS, RouterProcess
from tests.server.server_harness import ThreadServer, read_metrics

SHARED = "You are a support assistant for a bicycle shop. Be brief and friendly. " * 3


def test_an_embedding_has_no_prefix_and_goes_to_the_least_loaded_pod():
    completion = prompt_text("/v1/completions", {"model": "m", "prompt": SHARED})
    hashes = block_hashes(completion, BLOCK_CHARS, 64)
    assert len(hashes) >= 3
    table = PrefixTable(100)
    table.record(hashes, "http://a")  # pod a served this text as a completion
    assert prompt_text("/v1/embeddings", {"model": "m", "input": SHARED}) == ""
    assert prompt_text("/v1/embeddings", {"model": "m", "input": [SHARED, "x"]}) == ""
    embedding_hashes = block_hashes(
        prompt_text("/v1/embeddings", {"model": "m", "input": SHARED}), BLOCK_CHARS, 64
    )
    assert embedding_hashes == []
    pods = [PodState("http://a", in_flight=1), PodState("http://b")]
    config = PolicyConfig()
    assert choose_pod(hashes, pods, table.get, config).reason == "prefix"
    decision = choose_pod(embedding_hashes, pods, table.get, config)
    assert (decision.url, decision.reason) == ("http://b", "load")


@pytest.fixture(scope="module")
def embed_pod(tmp_path_factory):
    path = build_embedding_model(tmp_path_factory.mktemp("embed"), pooling="mean")
    pod = ThreadServer(
        {"served_model_names": ("tiny-embed",)},
        model=str(path),
        max_model_len=128,
        kv_cache_memory_bytes=2 << 20,
    )
    yield pod
    pod.stop()


@pytest.fixture
def router(embed_pod):
    running = RouterProcess([embed_pod.base_url])
    yield running.base_url
    running.stop()


def test_embeddings_are_proxied_and_routed_by_load(embed_pod, router):
    body = {"model": "tiny-embed", "input": [SHARED + "Are you open on Sunday?"]}
    direct = httpx.post(f"{embed_pod.base_url}/v1/embeddings", json=body, timeout=60)
    assert direct.status_code == 200, direct.text
    for question in ("Are you open on Sunday?", "Do you fix e-bikes?", "Are you open on Sunday?"):
        body = {"model": "tiny-embed", "input": [SHARED + question]}
        response = httpx.post(f"{router}/v1/embeddings", json=body, timeout=60)
        assert response.status_code == 200, response.text
        if question == "Are you open on Sunday?":
            assert response.json()["data"] == direct.json()["data"]
    metrics = read_metrics(router)
    assert metrics['pagefleet:router_routing_decisions_total{reason="load"}'] == 3
    assert metrics.get('pagefleet:router_routing_decisions_total{reason="prefix"}', 0) == 0
