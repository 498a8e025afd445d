"""Per-sample seeds of a seeded n > 1 request (issue 42, item 14): sample i draws from a
generator seeded by a hash of (seed, i), so no sample of one seed is a sample of another,
and every signed 64-bit seed is a stream of its own."""

import pytest
from pagefleet_serve import LLM, SamplingParams
from pagefleet_serve.sampling_params import INT64_MAX, INT64_MIN, generator_seed, sample_seed


@pytest.fixture(scope="module")
def llm():
    return LLM(
        "builtin://smollm2-135m", dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20
    )


def tokens(llm, params):
    return [o.token_ids for o in llm.generate("The weather today is", params)[0].outputs]


def sampled(seed, n=1):
    return SamplingParams(n=n, max_tokens=12, temperature=1.0, seed=seed)


def test_sample_seeds_are_a_hash_of_seed_and_index():
    assert sample_seed(5, 0) == 5  # n = 1 requests draw what they always did
    seeds = {sample_seed(s, i) for s in range(-50, 50) for i in range(8)}
    assert len(seeds) == 100 * 8  # seed + i gave 100 + 7 distinct ones
    assert all(INT64_MIN <= s <= INT64_MAX for s in seeds)  # a request may ask for any
    # The CPU generator keeps 32 bits of its seed: seeds that differ above them must not
    # collide there.
    ends = [INT64_MIN, -1, 0, 2**32, INT64_MAX]
    assert len({generator_seed(s) % 2**32 for s in ends}) == len(ends)


def test_sample_one_of_a_seed_is_not_sample_zero_of_the_next_seed(llm):
    two = tokens(llm, sampled(1000, n=2))
    assert two[1] != tokens(llm, sampled(1001))[0]
    # Sample i is what a single request seeded with sample_seed(seed, i) draws.
    assert two == [tokens(llm, sampled(sample_seed(1000, i)))[0] for i in range(2)]


def test_the_most_negative_seed_is_not_seed_zero(llm):
    # (seed + index) % 2**63 sent -2**63 to 0, and -1 to 2**63 - 1; the CPU generator made
    # 2**32 seed 0.
    assert tokens(llm, sampled(INT64_MIN)) != tokens(llm, sampled(0))
    assert tokens(llm, sampled(2**32)) != tokens(llm, sampled(0))
    assert tokens(llm, sampled(-1)) != tokens(llm, sampled(INT64_MAX))


def test_a_preempted_seeded_request_draws_the_same_tokens(kv_bytes_for_blocks):
    # Preemption frees a sequence's blocks and recomputes them later: its generator draws
    # nothing for the recompute, so its tokens are those it draws alone (float32 on the
    # CPU, where the recomputed logits match; docs/api.md states the limit elsewhere).
    llm = LLM(
        "builtin://smollm2-135m",
        dtype="float32",
        max_model_len=128,
        kv_cache_memory_bytes=kv_bytes_for_blocks(12),
    )
    questions = ["Write a story about a dragon.", "Explain rain.", "Describe a city at night."]
    prompts = [llm.chat_prompt([{"role": "user", "content": q}]) for q in questions]
    params = [
        SamplingParams(max_tokens=60, temperature=1.0, seed=10 + i, ignore_eos=True)
        for i in range(3)
    ]
    alone = [
        llm.generate(p, s)[0].outputs[0].token_ids for p, s in zip(prompts, params, strict=True)
    ]
    together = llm.generate(prompts, params)
    assert any(r.metrics.num_preemptions for r in together)
    assert [r.outputs[0].token_ids for r in together] == alone
