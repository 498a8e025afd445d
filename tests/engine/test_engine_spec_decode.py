"""Speculative decoding (n-gram prompt lookup): the proposer and the scheduler's draft
bookkeeping on their own, then the real model in float32, where speculation must give the
same greedy tokens, the same seeded tokens and the same sampled distribution as plain
decoding, with prefix hits, chunked prefill and preemption in the same batches."""

import collections
import json
import math
import random

import pytest
import torch
from pagefleet_kernels.backend import torch_backend
from pagefleet_serve import LLM, EngineConfig, SamplingParams
from pagefleet_serve.config import SpeculativeConfig
from pagefleet_serve.engine.block_manager import BlockManager
from pagefleet_serve.engine.sampler import SampledToken
from pagefleet_serve.engine.scheduler import Scheduler
from pagefleet_serve.engine.sequence import Sequence
from pagefleet_serve.engine.spec_decode.ngram import NgramProposer
from pagefleet_serve.engine.spec_decode.speculator import SpecDecodeStats, Speculator
from pagefleet_serve.model.config import ModelConfig
from pagefleet_serve.model.context import ModelContext
from pagefleet_serve.model.registry import build_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
# The built-in model as its own draft: greedy drafts are the target's own greedy tokens, so
# nearly all are accepted if the draft's KV cache (written, copied, rolled back) is right.
SELF_DRAFT = {"model": "builtin://smollm2-135m", "num_speculative_tokens": 4}
# Prompts whose answers repeat their input, so that most drafts are accepted.
COPY_PROMPTS = [
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the "
    "river bank, and the dog does not move.",
    "Fix the typo and write the whole line again: Paris is the capitl of France and its "
    "largest city, on the river Seine.",
]


# -- the proposer and the config, no model --------------------------------------------------
def test_ngram_proposes_what_followed_the_most_recent_longest_match():
    proposer = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=4)
    # [2, 3, 4] last occurred at index 5 (followed by 8, 3, 4), earlier at 1 (then 9).
    assert proposer.lookup([1, 2, 3, 4, 9, 2, 3, 4, 8, 3, 4], 3) == [8, 3, 4]
    assert proposer.lookup([7, 1, 2, 3, 5, 6, 1, 2, 3], 2) == [5, 6]  # the 3-gram wins
    assert proposer.lookup([5, 6, 7, 5], 10) == [6, 7, 5]  # as many as there are
    assert proposer.lookup([1, 2, 3], 4) == []  # no earlier occurrence
    assert proposer.lookup([1, 2, 1, 2], 0) == []
    assert NgramProposer(2, 3).lookup([4, 1, 4, 2], 3) == []  # 1-gram matches are too short


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9])
def test_logits_of_a_verification_span_are_each_rows_vocabulary_product(rows):
    """A span's few float32 rows take the product with the vocabulary matrix as it lies
    (faster than MKL's GEMM there): every row's logits must be what that row alone gets."""
    config = ModelConfig(
        vocab_size=4096, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=16,
    )  # fmt: skip
    model = build_model(config, ModelContext(torch_backend())).eval()
    torch.nn.init.normal_(model.lm_head.weight, generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(rows, config.hidden_size, generator=torch.Generator().manual_seed(rows))
    with torch.inference_mode():
        logits = model.compute_logits(hidden)
        expected = torch.stack([hidden[i] @ model.lm_head.weight.T for i in range(rows)])
    assert logits.shape == (rows, config.vocab_size) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_speculative_config_reads_vllm_json_and_names_bad_fields():
    config = EngineConfig(speculative_config=json.dumps(NGRAM))
    assert config.speculative_config == SpeculativeConfig(
        method="ngram", num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=1
    )
    assert EngineConfig(speculative_config="{}").speculative_config is None
    # vLLM's draft-model form: the method follows from the model.
    draft = '{"model": "builtin://tiny-random", "num_speculative_tokens": 3}'
    assert EngineConfig(speculative_config=draft).speculative_config == SpeculativeConfig(
        method="draft_model", model="builtin://tiny-random", num_speculative_tokens=3
    )
    for bad, field in (
        ('{"method": "eagle"}', "method"),
        ('{"method": "draft_model"}', "model is required"),
        ('{"method": "ngram", "model": "builtin://tiny-random"}', "model names a draft"),
        ('{"model": "builtin://llama-9000"}', "unknown built-in model"),
        ('{"model": "s3://bucket/draft.gguf"}', "unsupported scheme"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_min"),
        ('{"num_spec_tokens": 4}', "unknown keys ['num_spec_tokens']"),
        ("{method: ngram}", "not valid JSON"),
        ("[4]", "must be a JSON object"),
    ):
        with pytest.raises(ValueError, match="speculative_config") as error:
            EngineConfig(speculative_config=bad)
        assert field in str(error.value)


def test_speculator_skips_large_batches_and_backs_off_after_rejections():
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=2, disable_by_batch_size=2))
    seqs = [Sequence("r", i, [1, 2, 3, 1, 2], 5, SamplingParams(), None, 0.0) for i in range(3)]
    for seq in seqs:
        seq.num_computed_tokens = 4
    speculator.propose(seqs)
    assert [seq.spec_token_ids for seq in seqs] == [[], [], []]  # 3 running > 2
    seq = seqs[0]

    def proposals(steps: int) -> list[bool]:
        made = []
        for _ in range(steps):
            speculator.propose([seq])
            made.append(bool(seq.spec_token_ids))
        return made

    assert proposals(1) == [True]
    speculator.record(seq, 2, 0)
    assert proposals(2) == [False, True]  # one step off after the first miss
    speculator.record(seq, 2, 0)
    assert proposals(3) == [False, False, True]  # two after the second in a row
    speculator.record(seq, 2, 1)
    assert proposals(1) == [True]  # an acceptance ends the back-off
    assert speculator.stats() == SpecDecodeStats(3, 6, 1, (1, 0))


# -- the scheduler's draft bookkeeping, no model --------------------------------------------
def decoding_sequence(block_manager: BlockManager, num_tokens: int) -> Sequence:
    """A sequence whose prompt is computed but for its last token (a decode)."""
    seq = Sequence(
        "r",
        0,
        list(range(100, 100 + num_tokens)),
        num_tokens,
        SamplingParams(max_tokens=50),
        None,
        0.0,
    )
    assert block_manager.allocate(seq, num_tokens - 1) == []
    seq.num_computed_tokens = num_tokens - 1
    block_manager.cache_full_blocks(seq)
    return seq


def scheduler_with(
    seq: Sequence, block_manager: BlockManager, budget: int, speculative_config=None
) -> Scheduler:
    config = EngineConfig(
        max_num_batched_tokens=budget, block_size=4, speculative_config=speculative_config
    )
    scheduler = Scheduler(config, block_manager, max_model_len=64)
    seq.status = seq.status.RUNNING
    scheduler.running.append(seq)
    return scheduler


def test_drafts_take_budget_and_blocks_and_rejected_ones_give_them_back():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    seq = decoding_sequence(bm, num_tokens=7)  # 6 computed: blocks [0, 1]
    seq.spec_token_ids = [1, 2, 3, 4]
    step = scheduler_with(seq, bm, budget=4).schedule()
    (item,) = step.scheduled
    assert (item.num_new_tokens, item.spec_token_ids) == (4, [1, 2, 3])  # budget: 1 + 3
    assert item.input_token_ids == [106, 1, 2, 3]
    assert seq.block_table == [0, 1, 2]  # positions 6..9 reach block 2

    # The model accepted draft 1, rejected draft 2 and sampled 9 in its place.
    accepted = [SampledToken(1), SampledToken(9)]
    scheduler = scheduler_with(seq, bm, budget=4)
    scheduler.update(step, {seq: accepted})
    assert seq.token_ids[-3:] == [106, 1, 9]
    assert seq.num_computed_tokens == 8  # up to the accepted draft: 9 is the next input
    assert seq.block_table == [0, 1]  # block 2 held only rejected drafts' slots
    assert bm.num_free_blocks == 14
    assert len(bm.cached) == 2  # two full blocks, hashed over accepted tokens only
    assert seq.block_hashes == [seq.block_hashes[0], seq.block_hashes[1]]
    bm.free(seq)
    bm.check_no_leaks()


def test_drafts_stop_short_of_max_tokens_and_are_dropped_before_preempting():
    bm = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    seq = decoding_sequence(bm, num_tokens=7)
    seq.spec_token_ids = [1, 2, 3, 4]
    # Room for one more token but not for a third block: the drafts go, nobody is preempted.
    step = scheduler_with(seq, bm, budget=64).schedule()
    assert (step.scheduled[0].num_new_tokens, step.scheduled[0].spec_token_ids, step.preempted) == (
        1,
        [],
        [],
    )
    bm.free(seq)

    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    seq = decoding_sequence(bm, num_tokens=7)
    seq.params = SamplingParams(max_tokens=2)  # 1 draft + 1 bonus token reach max_tokens
    seq.spec_token_ids = [1, 2, 3, 4]
    assert scheduler_with(seq, bm, budget=64).schedule().scheduled[0].spec_token_ids == [1]
    bm.free(seq)


def test_a_draft_model_keeps_lookahead_slots_of_its_own_which_go_before_anyone_is_preempted():
    draft = {"model": "builtin://tiny-random", "num_speculative_tokens": 3}
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    seq = decoding_sequence(bm, num_tokens=7)  # 6 computed: blocks [0, 1]
    seq.spec_token_ids = [1, 2, 3]
    scheduler = scheduler_with(seq, bm, budget=64, speculative_config=draft)
    step = scheduler.schedule()
    assert step.scheduled[0].num_new_tokens == 4
    assert seq.block_table == [0, 1, 2, 3]  # positions 6..9 verified, 10..12 for proposals
    scheduler.update(step, {seq: [SampledToken(1), SampledToken(9)]})  # draft 2 rejected
    # 8 computed; the next proposals write positions 8..10: block 3 goes back.
    assert (seq.num_computed_tokens, seq.block_table) == (8, [0, 1, 2])
    assert bm.holds_slots(seq, 3) and not bm.holds_slots(seq, 5)
    child = seq.fork(1, None)  # shares block 2 until its first write copies it
    bm.fork(child)
    assert not bm.holds_slots(seq, 3) and not bm.holds_slots(child, 3)
    bm.free(child)
    assert bm.holds_slots(seq, 3)
    bm.free(seq)
    bm.check_no_leaks()

    bm = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    seq = decoding_sequence(bm, num_tokens=7)
    seq.spec_token_ids = [1, 2, 3]
    step = scheduler_with(seq, bm, budget=64, speculative_config=draft).schedule()
    (item,) = step.scheduled
    assert (item.num_new_tokens, item.spec_token_ids, step.preempted) == (1, [], [])
    assert seq.block_table == [0, 1]
    bm.free(seq)


# -- the real model, float32 ----------------------------------------------------------------
@pytest.fixture(scope="module")
def copy_prompts(chat_prompts):
    from pagefleet_serve.frontend.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("builtin://smollm2-135m")
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        for text in COPY_PROMPTS
    ]


def token_ids(results) -> list[list[int]]:
    return [sample.token_ids for result in results for sample in result.outputs]


# K/V x 2 layers x 16 tokens x 2 kv heads x 16 dims x 4 bytes (float32)
TINY_BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4


def test_tiny_draft_keeps_greedy_tokens_through_forks_chunks_preemption_and_rejections(make_llm):
    """builtin://tiny-random drafting for itself, 8 sequences at once: greedy tokens equal
    plain decoding's and nearly all drafts are accepted; with a repetition penalty (which
    the target's greedy pick applies and the draft's does not) many are rejected, and the
    tokens still equal plain decoding's."""
    rng = random.Random(0)
    shared = [rng.randrange(512) for _ in range(40)]  # prefix-cache hits
    prompts = [shared + [rng.randrange(512) for _ in range(rng.randrange(5, 30))] for _ in range(4)]
    prompts += [[rng.randrange(512) for _ in range(rng.randrange(10, 60))] for _ in range(4)]
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    runs = [
        [greedy] * 7 + [SamplingParams(n=2, max_tokens=40, temperature=0.0)],
        [SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.5)] * 8,
    ]
    # 20 blocks (320 tokens) for 8 sequences of up to 130: preemption; 48-token chunks.
    config = dict(model="builtin://tiny-random", max_model_len=128, max_num_batched_tokens=48)
    plain = make_llm(**config, kv_cache_memory_bytes=20 * TINY_BLOCK_BYTES)
    tiny_draft = {"model": "builtin://tiny-random", "disable_by_batch_size": None}
    llm = make_llm(
        **config, kv_cache_memory_bytes=40 * TINY_BLOCK_BYTES, speculative_config=tiny_draft
    )
    assert llm.engine.block_manager.num_blocks == 20
    stats = []
    for params in runs:
        assert token_ids(llm.generate(prompts, params)) == token_ids(
            plain.generate(prompts, params)
        )
        assert llm.engine.block_manager.num_used_blocks == 0
        stats.append(llm.engine.stats())
    assert stats[-1].num_preemptions >= 1 and stats[-1].prefix_cache_hits > 0
    first, both = stats[0].spec_decode, stats[1].spec_decode
    assert first.num_drafts > len(prompts)
    assert first.num_accepted_tokens >= 0.95 * first.num_draft_tokens, first
    second_accepted = both.num_accepted_tokens - first.num_accepted_tokens
    second_drafted = both.num_draft_tokens - first.num_draft_tokens
    assert 0 < second_accepted < 0.8 * second_drafted, both


GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
# 24 blocks (384 tokens) cannot hold 12 sequences of ~100 tokens: preemption; a 96-token
# budget chunks the ~75-token prompts while others verify drafts; one system prompt.
GREEDY_CONFIG = dict(max_model_len=256, max_num_batched_tokens=96)
GREEDY_BLOCKS = 24


@pytest.fixture(scope="module")
def greedy_case(chat_prompts, copy_prompts, kv_bytes_for_blocks):
    """The prompts of the greedy comparisons and their tokens without speculation."""
    prompts = copy_prompts + chat_prompts[::2]
    llm = LLM(
        "builtin://smollm2-135m",
        dtype="float32",
        kv_cache_memory_bytes=kv_bytes_for_blocks(GREEDY_BLOCKS),
        **GREEDY_CONFIG,
    )
    plain = token_ids(llm.generate(prompts, GREEDY))
    llm.engine.block_manager.check_no_leaks()
    return prompts, plain


def test_greedy_tokens_are_those_of_plain_decoding_with_prefix_hits_chunks_and_preemption(
    make_llm, greedy_case, kv_bytes_for_blocks
):
    prompts, plain = greedy_case
    llm = make_llm(
        **GREEDY_CONFIG,
        kv_cache_memory_bytes=kv_bytes_for_blocks(GREEDY_BLOCKS),
        speculative_config=NGRAM | {"disable_by_batch_size": None},
    )
    speculated = token_ids(llm.generate(prompts, GREEDY))
    assert speculated == plain
    stats = llm.engine.stats()
    assert stats.num_preemptions >= 1 and stats.prefix_cache_hits > 0
    spec = stats.spec_decode
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens  # both outcomes happened
    assert spec.accepted_per_position[0] >= spec.accepted_per_position[-1] > 0


def test_self_draft_gives_the_greedy_tokens_and_accepts_nearly_every_draft(
    make_llm, greedy_case, kv_bytes_for_blocks
):
    # Six of the prompts, 16 tokens each: the first 16 of their plain greedy tokens (float32
    # greedy tokens do not depend on the batch). 16 blocks cannot hold the six: preemption.
    prompts, plain = greedy_case
    prompts, plain = prompts[:6], [tokens[:16] for tokens in plain[:6]]
    # Twice the bytes buy the same 16 blocks: each holds the target's and the draft's K/V.
    llm = make_llm(
        **GREEDY_CONFIG,
        kv_cache_memory_bytes=kv_bytes_for_blocks(2 * 16),
        speculative_config=SELF_DRAFT | {"disable_by_batch_size": None},
    )
    assert llm.engine.block_manager.num_blocks == 16
    assert token_ids(llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0))) == plain
    assert llm.engine.block_manager.num_used_blocks == 0
    stats = llm.engine.stats()
    assert stats.num_preemptions >= 1 and stats.prefix_cache_hits > 0
    spec = stats.spec_decode
    assert spec.num_drafts >= 2 * len(prompts)
    assert spec.num_accepted_tokens >= 0.95 * spec.num_draft_tokens, spec


@pytest.mark.slow  # minutes of sampling on 2 cores: `make test-engine-slow`
@pytest.mark.parametrize("spec", [NGRAM, SELF_DRAFT], ids=["ngram", "draft_model"])
def test_seeded_samples_are_the_tokens_and_logprobs_of_plain_decoding(
    make_llm, chat_prompts, copy_prompts, spec
):
    # Penalties see the drafts before each position as output; top-k/top-p/min-p apply.
    params = [
        SamplingParams(
            max_tokens=32,
            temperature=0.8,
            top_p=0.95,
            top_k=40,
            presence_penalty=0.2,
            repetition_penalty=1.05,
            seed=seed,
            logprobs=2,
        )
        for seed in range(4)
    ]
    prompts = copy_prompts + chat_prompts[:2]
    config = dict(max_model_len=256, kv_cache_memory_bytes=64 << 20)
    plain = make_llm(**config).generate(prompts, params)
    llm = make_llm(**config, speculative_config=spec)
    speculated = llm.generate(prompts, params)
    assert token_ids(speculated) == token_ids(plain)
    for ours, theirs in zip(speculated, plain, strict=True):
        got = [entry.logprob for entry in ours.outputs[0].logprobs]
        want = [entry.logprob for entry in theirs.outputs[0].logprobs]
        assert got == pytest.approx(want, abs=1e-3)
    spec_stats = llm.engine.stats().spec_decode
    assert 0 < spec_stats.num_accepted_tokens < spec_stats.num_draft_tokens


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at p = 0.999 (z = 3.09), Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.slow  # minutes of sampling on 2 cores: `make test-engine-slow`
@pytest.mark.parametrize("proposal", [NGRAM, SELF_DRAFT], ids=["ngram", "draft_model"])
def test_sampled_distribution_at_temperature_0_8_is_that_of_plain_decoding(
    make_llm, copy_prompts, proposal
):
    """300 unseeded samples of the first 4 tokens with and without speculation (global
    seed fixed); a two-sample chi-square test on the joint 4-token outcomes (those seen
    fewer than 10 times pooled are lumped) must not reject at p = 0.001."""
    num_samples = 300
    params = SamplingParams(n=num_samples, max_tokens=4, temperature=0.8)
    config = dict(max_model_len=256, max_num_seqs=num_samples, max_num_batched_tokens=2048)
    counts = []
    for spec in (None, proposal | {"disable_by_batch_size": None}):
        llm = make_llm(**config, kv_cache_memory_bytes=512 << 20, speculative_config=spec)
        torch.manual_seed(0)
        (result,) = llm.generate(copy_prompts[1], params)
        counts.append(collections.Counter(tuple(s.token_ids) for s in result.outputs))
    spec = llm.engine.stats().spec_decode
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens  # accepts and rejections
    plain, speculated = counts
    frequent = [k for k in plain.keys() | speculated.keys() if plain[k] + speculated[k] >= 10]
    assert len(frequent) >= 3  # the outcomes vary: the test has something to compare
    cells = [(plain[k], speculated[k]) for k in frequent]
    cells.append((num_samples - sum(a for a, _ in cells), num_samples - sum(b for _, b in cells)))
    cells = [(a, b) for a, b in cells if a + b]
    statistic = sum((a - b) ** 2 / (a + b) for a, b in cells)
    assert statistic < chi_square_critical(len(cells) - 1), (statistic, cells)
