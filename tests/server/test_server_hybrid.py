"""A hybrid model behind the real HTTP server and the openai client: the tiny random LFM2
of tests/engine/test_engine_hybrid.py, served on token ids, answers a 300-token prompt
with transformers' greedy tokens, twice, the second time from a state checkpoint; its
state slots and the prefix-cache hits show in /metrics."""

import openai
import pytest

from tests.engine.test_engine_hybrid import LONG, MAX_NEW, lfm2, reference  # noqa: F401
from tests.server.server_harness import ThreadServer, read_metrics


@pytest.fixture(scope="module")
def server(lfm2):  # noqa: F811
    path, _ = lfm2
    running = ThreadServer(
        {"served_model_names": ("lfm2",)},
        model=str(path),
        max_model_len=512,
        kv_cache_memory_bytes=4 << 20,
        block_size=16,
        max_num_batched_tokens=64,
        max_num_seqs=8,
    )
    yield running
    running.stop()


def test_completions_from_a_checkpoint_and_the_state_metrics(server, lfm2):  # noqa: F811
    _, model = lfm2
    sdk = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    answers = []
    for _ in range(2):
        response = sdk.completions.create(
            model="lfm2", prompt=LONG, max_tokens=MAX_NEW, temperature=0.0, logprobs=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        answers.append(response.choices[0])
    metrics = read_metrics(server.base_url)
    assert metrics["vllm:prefix_cache_hits_total"] == 288
    assert metrics["pagefleet:state_slots"] == 8
    assert metrics["pagefleet:state_used_slots"] == 0
    assert metrics["pagefleet:state_bytes_per_sequence"] == 3 * 64 * 2 * 4
    assert metrics["pagefleet:state_checkpoints"] >= 1
    for answer in answers:  # served on token ids: each token's text is "<id>"
        assert answer.finish_reason == "length"
        tokens = [int(token.strip("<>")) for token in answer.logprobs.tokens]
        assert tokens == reference(model, LONG)
