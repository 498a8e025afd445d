"""Hybrid models in the engine, served over the state slots and token-exact against
transformers' own classes: LFM2 (short convolutions beside attention) and Mamba2 (the
state-space model alone, no KV cache at all).

Each tiny random model (hidden 64; random norm weights, so that every layer changes the
next token) is built once by transformers and saved. Its greedy tokens must equal
transformers' generate through every path that moves a sequence's state: chunked prefill
(the state carried from chunk to chunk), decode beside other prompts' chunks, prefix-cache
hits resuming from a state checkpoint, preemption and recompute (from zeros again), an
n > 1 fork (the prompt's state copied to each sample), and an abort mid-prefill (its slot
freed and reused). A full state pool queues requests instead of failing them."""

import pytest
import torch
from pagefleet_serve import LLM, SamplingParams
from pagefleet_serve.config import EngineConfig
from pagefleet_serve.engine.block_manager import BlockManager
from pagefleet_serve.engine.sampler import SampledToken
from pagefleet_serve.engine.scheduler import Scheduler
from pagefleet_serve.engine.sequence import Sequence, SequenceStatus
from pagefleet_serve.engine.startup import state_slots_of
from pagefleet_serve.engine.state_checkpoints import StateCheckpoints
from pagefleet_serve.engine.state_slots import StateSlots
from pagefleet_serve.server.metrics import ServerMetrics

from tests.engine.test_engine_architectures import reference_tokens

MAX_NEW = 16
BLOCK = 16
SHORT = [(7 * i + 3) % 300 + 10 for i in range(37)]
LONG = [(11 * i + 5) % 300 + 10 for i in range(300)]
TINY = [5, 6, 7]
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def save(config, path):
    """A transformers model of `config`, its norm weights random (around 1) and its expert
    biases (LFM2-MoE's, which move the experts' choice; zeros as initialized) random too,
    saved."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                param.copy_(1 + 0.5 * torch.randn(param.shape, generator=generator))
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):
                buffer.copy_(0.5 * torch.randn(buffer.shape, generator=generator))
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    """(path, transformers model) of the tiny random LFM2."""
    import transformers

    config = transformers.Lfm2Config(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=192,
        block_multiple_of=16,  # the MLP's width, derived from intermediate_size: 128
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["conv", "full_attention", "conv", "conv"],
        conv_L_cache=3,
        max_position_embeddings=512,
        initializer_range=0.2,  # far from uniform logits: no greedy near-ties
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return save(config, tmp_path_factory.mktemp("lfm2"))


@pytest.fixture(scope="module")
def mamba2(tmp_path_factory):
    """A tiny random Mamba2: 3 layers of 8 SSM heads of 16 in 2 groups, state 16, chunks
    of 32 (a 300-token prompt's chunk spans two and a part)."""
    import transformers

    config = transformers.Mamba2Config(
        vocab_size=320,
        hidden_size=64,
        num_heads=8,
        head_dim=16,
        n_groups=2,
        state_size=16,
        expand=2,
        chunk_size=32,
        num_hidden_layers=3,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return save(config, tmp_path_factory.mktemp("mamba2"))


_REFERENCE: dict[tuple[int, ...], list[int]] = {}


def reference(model, prompt: list[int]) -> list[int]:
    """transformers' greedy tokens (computed once per model and prompt)."""
    key = (id(model), *prompt)
    if key not in _REFERENCE:
        _REFERENCE[key] = reference_tokens(model, prompt, MAX_NEW)
    return _REFERENCE[key]


def serve(path, **overrides) -> LLM:
    settings = dict(
        dtype="float32",
        max_model_len=512,
        kv_cache_memory_bytes=4 << 20,
        block_size=BLOCK,
        max_num_batched_tokens=64,  # the 300-token prompt prefills in chunks
        max_num_seqs=8,
    )
    return LLM(str(path), **(settings | overrides))


def assert_released(llm: LLM) -> None:
    engine = llm.engine
    assert engine.state_slots.num_used == 0
    engine.block_manager.check_no_leaks()


def test_greedy_parity_short_and_long_prompts_in_one_batch(lfm2):
    path, model = lfm2
    llm = serve(path)
    runner = llm.engine.runner
    # The attention layer alone holds K/V; the three convolutions a (64, 2) float32
    # window each per sequence.
    assert runner.kv_layers == [1] and runner.num_layers == 1
    assert runner.state_bytes_per_slot == 3 * 64 * 2 * 4
    assert llm.engine.state_slots.num_slots == 8
    # and as many prefix checkpoints after them
    assert runner.num_state_slots == 16 and llm.engine.state_checkpoints.num_checkpoints == 8
    outs = llm.generate([SHORT, LONG, TINY], GREEDY)
    for prompt, out in zip([SHORT, LONG, TINY], outs, strict=True):
        assert out.outputs[0].token_ids == reference(model, prompt)
    assert_released(llm)


def test_mamba2_parity_and_prefix_cache(mamba2):
    """A model of recurrent layers alone: no KV cache (its blocks cost nothing), every
    sequence's past in its slot; the 300-token prompt again resumes at 288."""
    path, model = mamba2
    llm = serve(path)
    runner = llm.engine.runner
    assert runner.kv_layers == [] and runner.bytes_per_block == 0
    # Each layer: a (8 * 16 + 2 * 2 * 16, 3) window and an (8, 16, 16) SSM state, float32.
    assert runner.state_bytes_per_slot == 3 * 4 * (192 * 3 + 8 * 16 * 16)
    outs = llm.generate([SHORT, LONG, TINY], GREEDY)
    for prompt, out in zip([SHORT, LONG, TINY], outs, strict=True):
        assert out.outputs[0].token_ids == reference(model, prompt)
    before = llm.stats().prefix_cache_hits
    (out,) = llm.generate([LONG], GREEDY)
    assert out.outputs[0].token_ids == reference(model, LONG)
    assert llm.stats().prefix_cache_hits - before == 288
    assert_released(llm)


def test_preemption_recomputes_the_state_from_zeros(lfm2):
    path, model = lfm2
    # 4 state slots (6 KiB), then 22 blocks of 16 tokens: the three prompts and their
    # outputs need 26, so the newest is preempted and recomputed.
    slots = 4 * 3 * 64 * 2 * 4
    llm = serve(
        path,
        max_num_seqs=4,
        max_model_len=352,
        kv_cache_memory_bytes=slots + 22 * 4096,
        enable_prefix_caching=False,  # a recompute from zeros, not from a checkpoint
    )
    assert llm.engine.block_manager.num_blocks == 22
    outs = llm.generate([LONG, SHORT, TINY], GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip([LONG, SHORT, TINY], outs, strict=True):
        assert out.outputs[0].token_ids == reference(model, prompt)
    assert_released(llm)


def test_prefix_cache_resumes_from_state_checkpoints(lfm2):
    """The 300-token prompt again skips 288 tokens (18 blocks: the deepest boundary before
    its last token, where its prefill's chunk ended and its state was kept); the prompt
    extended by 50 tokens resumes from the same checkpoint. Both give transformers'
    tokens, as a cold run does."""
    path, model = lfm2
    llm = serve(path)
    extended = LONG + [(3 * i + 1) % 300 + 10 for i in range(50)]
    hits = []
    for prompt in (LONG, LONG, extended):
        before = llm.stats().prefix_cache_hits
        (out,) = llm.generate([prompt], GREEDY)
        assert out.outputs[0].token_ids == reference(model, prompt)
        hits.append(llm.stats().prefix_cache_hits - before)
    assert hits == [0, 288, 288]
    assert llm.engine.state_checkpoints.num_saved > 0
    assert_released(llm)
    # What /metrics shows of them.
    metrics = ServerMetrics("lfm2", llm.stats, dict, block_size=BLOCK).render().decode()
    series = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line and line[0] != "#")
    label = '{model_name="lfm2"}'
    assert float(series["vllm:prefix_cache_hits_total" + label]) == 576
    assert float(series["pagefleet:state_slots" + label]) == 8
    assert float(series["pagefleet:state_used_slots" + label]) == 0
    assert (
        float(series["pagefleet:state_checkpoints" + label])
        == llm.engine.state_checkpoints.num_saved
    )
    assert float(series["pagefleet:state_bytes_per_sequence" + label]) == 3 * 64 * 2 * 4


def test_n_samples_fork_copies_the_prompts_state(lfm2):
    """Greedy samples of one prompt are the same tokens only if each sibling continues
    from the prompt's state (a zero state gives others)."""
    path, model = lfm2
    llm = serve(path)
    params = SamplingParams(n=3, max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate([SHORT], params)
    assert [o.token_ids for o in out.outputs] == [reference(model, SHORT)] * 3
    assert_released(llm)


def test_abort_mid_prefill_frees_the_slot(lfm2):
    path, model = lfm2
    llm = serve(path, max_num_seqs=1)
    llm.add_request("long", LONG, GREEDY)
    llm.step()  # the first 64-token chunk
    engine = llm.engine
    (seq,) = engine.scheduler.sequences_of("long")
    assert 0 < seq.num_computed_tokens < len(LONG)
    assert engine.state_slots.num_used == 1
    llm.abort_request("long")
    finals = [o for o in llm.step() if o.finished]
    assert [o.outputs[0].finish_reason for o in finals] == ["abort"]
    assert_released(llm)
    # The one slot serves the next request, from zeros.
    (out,) = llm.generate([SHORT], GREEDY)
    assert out.outputs[0].token_ids == reference(model, SHORT)
    assert_released(llm)


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative"),
        ({"enable_lora": True}, "enable_lora"),
    ],
)
def test_hybrid_models_refuse_speculation_and_adapters(lfm2, setting, named):
    path, _ = lfm2
    with pytest.raises(ValueError, match=rf"hybrid model .* without {named}"):
        serve(path, **setting)


def test_state_slots_come_out_of_the_kv_budget():
    assert state_slots_of(1 << 20, 0, 8) == 0  # no recurrent layer
    assert state_slots_of(1 << 20, 1000, 8) == 8  # a full batch
    assert state_slots_of(10_000, 1000, 8) == 5  # half the budget
    assert state_slots_of(6_000, 1000, 8, attention=False) == 6  # all of it: no KV blocks
    with pytest.raises(ValueError, match="holds no state slot"):
        state_slots_of(1000, 1000, 8)


def _seq(request_id: str, num_tokens: int, n: int = 1) -> Sequence:
    return Sequence(
        request_id=request_id,
        sample_index=0,
        token_ids=list(range(10, 10 + num_tokens)),
        num_prompt_tokens=num_tokens,
        params=SamplingParams(max_tokens=2, n=n),
        eos_token_id=None,
        arrival_time=0.0,
        sibling_generators=[None] * (n - 1),
    )


def _step(scheduler: Scheduler):
    out = scheduler.schedule()
    sampled = {
        item.seq: [SampledToken(7)] * item.seq.num_samples for item in out.scheduled if item.samples
    }
    scheduler.update(out, sampled)
    return out


def test_a_full_state_pool_queues_requests():
    """Three state slots, eight seats: the third request (n = 2) waits for two free slots
    while the single ones run; it is admitted when they finish, and its fork's copy of
    the prompt's state goes to the step after its prompt."""
    config = EngineConfig(model="builtin://tiny-random", block_size=4, max_num_seqs=8)
    slots = StateSlots(3)
    scheduler = Scheduler(config, BlockManager(64, 4, False), 64, slots)
    a, b, pair = _seq("a", 5), _seq("b", 5), _seq("pair", 5, n=2)
    for seq in (a, b, pair):
        scheduler.add(seq)
    out = _step(scheduler)
    assert [item.seq for item in out.scheduled] == [a, b]
    assert pair.status is SequenceStatus.WAITING and slots.num_used == 2
    assert {a.state_slot, b.state_slot} == {0, 1}
    _step(scheduler)  # a and b decode their last token and finish
    assert a.is_finished and b.is_finished and slots.num_used == 0
    out = _step(scheduler)
    assert [item.seq for item in out.scheduled] == [pair] and slots.num_used == 2
    child = next(s for s in scheduler.running if s is not pair)
    fork = (pair.state_slot, child.state_slot)
    assert None not in fork
    out = _step(scheduler)
    assert out.state_copies == [fork]
    assert not scheduler.has_unfinished() and slots.num_used == 0


def _prompt(request_id: str, first_token: int, num_tokens: int = 9) -> Sequence:
    seq = _seq(request_id, num_tokens)
    seq.token_ids = list(range(first_token, first_token + num_tokens))
    return seq


def _until_finished(scheduler: Scheduler, seq: Sequence) -> list:
    """Add `seq` and step until it finishes; each step's output."""
    scheduler.add(seq)
    steps = []
    while not seq.is_finished:
        steps.append(_step(scheduler))
    return steps


def test_state_checkpoints_are_bounded_and_leave_with_their_blocks():
    """A 9-token prompt's prefill stops at 8 (two 4-token blocks) and keeps its state there
    (slot 2, the one checkpoint slot); the same prompt again resumes at 8 from a copy of
    it. A second prompt's checkpoint evicts the first's (least recently used); blocks
    leaving the prefix cache take their checkpoint with them."""
    config = EngineConfig(model="builtin://tiny-random", block_size=4, max_num_seqs=2)
    blocks = BlockManager(8, 4, True)
    slots = StateSlots(2)
    checkpoints = StateCheckpoints(slots, 2, 1, 4)
    blocks.on_evict.append(checkpoints.forget)
    scheduler = Scheduler(config, blocks, 64, slots, checkpoints)

    def resumable(first_token: int) -> int:
        seq = _prompt("probe", first_token)
        blocks.update_block_hashes(seq)
        return checkpoints.resumable(seq, 2)

    steps = _until_finished(scheduler, _prompt("first", 10))
    assert [[item.num_new_tokens for item in out.scheduled] for out in steps] == [[8], [1], [1]]
    assert steps[1].state_copies == [(0, 2)]  # its slot's state at 8, saved
    assert checkpoints.num_saved == 1 and resumable(10) == 2

    again = _prompt("again", 10)
    scheduler.add(again)
    out = _step(scheduler)
    assert again.num_prefix_hit_tokens == 8 and out.scheduled[0].num_new_tokens == 1
    assert out.state_copies == [(2, again.state_slot)]  # restored into its slot
    while not again.is_finished:
        _step(scheduler)

    _until_finished(scheduler, _prompt("other", 100))
    assert checkpoints.num_saved == 1 and resumable(10) == 0 and resumable(100) == 2

    # Two 17-token prompts take all 8 blocks: the cached ones are evicted, and with them
    # the other prompt's checkpoint (the slot then holds the newest prompt's).
    for name, first_token in (("x", 200), ("y", 300)):
        scheduler.add(_prompt(name, first_token, 17))
    _step(scheduler)
    assert blocks.num_free_blocks == 0
    assert resumable(100) == 0 and checkpoints.num_saved == 1
