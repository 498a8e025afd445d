"""A `pagefleet serve` process over a KV tier directory (--kv-offload-dir), restarted: a
~1,500-token prompt is served, the server stops (SIGTERM: the queued block writes are
finished), a new server over the same directory serves the prompt again with the same
greedy tokens, its prefix-cache hits >= 1,400 tokens, all of them from the files, as
/metrics says (the real `openai` client, a tiny random Llama saved by transformers)."""

from __future__ import annotations

import signal
from pathlib import Path

import openai
import pytest

from tests.engine.hub_server import save_tiny_llama
from tests.server.server_harness import ServerProcess, read_metrics

PROMPT = [(7 * i + 11) % 5000 + 300 for i in range(1500)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(
        tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=2048, initializer_range=0.2
    )


def serve_once(model_dir: Path, tier_dir: Path) -> tuple[list[int], dict[str, float]]:
    """Start a server over `tier_dir`, complete the prompt greedily, stop it gracefully:
    the completion's token ids and the server's metrics before it stopped."""
    server = ServerProcess(
        "--model",
        str(model_dir),
        "--max-model-len",
        "1600",
        "--kv-cache-memory",
        "8MiB",
        "--kv-offload-dir",
        str(tier_dir),
        "--served-model-name",
        "tiny",
    ).wait_ready()
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        completion = client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        metrics = read_metrics(server.base_url)
        server.signal(signal.SIGTERM)
        assert server.process.wait(timeout=60) == 0, server.log_text()
    finally:
        server.stop()
    return completion.choices[0].token_ids, metrics


# Two server start-ups (~25 s each on a loaded 2-core machine): the engine-level restart
# test (tests/engine/test_engine_kv_tier.py) is the fast one.
@pytest.mark.slow
def test_restarted_server_serves_the_prompt_from_the_directory(model_dir, tmp_path):
    cold_tokens, cold = serve_once(model_dir, tmp_path)
    assert cold["vllm:prefix_cache_hits_total"] == 0
    assert cold['pagefleet:kv_offload_store_bytes_total{medium="STORAGE"}'] > 0
    assert len(list(tmp_path.glob("??/*.kvblock"))) == (len(PROMPT) + 7) // 16

    warm_tokens, warm = serve_once(model_dir, tmp_path)
    assert warm_tokens == cold_tokens
    assert warm["vllm:prefix_cache_hits_total"] >= 1400
    assert warm["vllm:external_prefix_cache_hits_total"] == warm["vllm:prefix_cache_hits_total"]
    assert warm['pagefleet:kv_offload_hit_tokens_total{medium="STORAGE"}'] >= 1400
    assert warm["pagefleet:kv_offload_invalid_blocks_total"] == 0
