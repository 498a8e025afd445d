"""Scheduler corners that only a full pool reaches (no model): no admission in a step
that preempted, every scheduled sequence advanced when a victim's budget went to more
than one prefill chunk, and a draft model's admission that falls back to its prompt alone
and still takes its prefix-cache hits exactly once."""

from pagefleet_serve.config import EngineConfig, SpeculativeConfig
from pagefleet_serve.engine.block_manager import BlockManager
from pagefleet_serve.engine.sampler import SampledToken
from pagefleet_serve.engine.scheduler import Scheduler
from pagefleet_serve.engine.sequence import Sequence, SequenceStatus
from pagefleet_serve.sampling_params import SamplingParams

BS = 4
DRAFT_MODEL = SpeculativeConfig(
    method="draft_model", model="builtin://tiny-random", num_speculative_tokens=3
)


def make_scheduler(num_blocks, **config):
    config = EngineConfig(model="builtin://tiny-random", block_size=BS, **config)
    return Scheduler(config, BlockManager(num_blocks, BS, True), max_model_len=1024)


def make_seq(request_id, num_tokens, priority=0, first_token=0, max_tokens=16):
    return Sequence(
        request_id=request_id,
        sample_index=0,
        token_ids=list(range(first_token, first_token + num_tokens)),
        num_prompt_tokens=num_tokens,
        params=SamplingParams(max_tokens=max_tokens),
        eos_token_id=None,
        arrival_time=0.0,
        priority=priority,
    )


def place(s, seq, num_computed):
    """Put `seq` in the running set with `num_computed` tokens computed."""
    assert s.block_manager.allocate(seq, num_computed) is not None
    seq.num_computed_tokens = num_computed
    seq.status = SequenceStatus.RUNNING
    s.running.append(seq)


def test_a_step_that_preempted_admits_nothing_even_what_would_fit():
    """Preemption says the running set has no room to grow: a waiting request that would
    fit the blocks the victim freed still waits for the next step."""
    s = make_scheduler(num_blocks=4)
    old = make_seq("old", 7)
    new = make_seq("new", 9, first_token=50)
    place(s, old, 6)  # its next token fits its second block
    place(s, new, 8)  # its next token needs a third block, and it is the newest: the victim
    small = make_seq("small", 2, priority=-1, first_token=100)  # first in the waiting order
    s.add(small)
    out = s.schedule()
    assert out.preempted == [new]
    assert [item.seq for item in out.scheduled] == [old]
    assert small.status is SequenceStatus.WAITING and s.waiting[0] is small
    assert s.block_manager.num_free_blocks == 2  # room it would have had
    # The next step, with no preemption, admits it.
    assert small in [item.seq for item in s.schedule().scheduled]


def test_every_sequence_after_a_prefill_chunk_advances_when_a_victims_budget_came_back():
    """A prefill chunk that does not reach the end of its prompt is usually the step's
    last item (it took the rest of the budget). Not when an already scheduled victim's
    tokens went back to the budget: then a later prefill runs too, here to the end of its
    prompt, and its sampled token must join it."""
    s = make_scheduler(num_blocks=4, max_num_batched_tokens=5)
    low = make_seq("low-decode", 5, priority=2)
    low.token_ids.append(7)  # a decode: scheduled first, then the victim
    p = make_seq("p", 12, priority=1, first_token=100)
    q = make_seq("q", 5, priority=1, first_token=200)
    place(s, low, 5)
    place(s, p, 4)  # p's next 4 tokens need a block the full pool lacks
    place(s, q, 4)  # q's last prompt token needs one too
    out = s.schedule()
    assert out.preempted == [low]
    assert [(item.seq, item.num_new_tokens, item.samples) for item in out.scheduled] == [
        (p, 4, False),
        (q, 1, True),
    ]
    new_tokens = s.update(out, {q: [SampledToken(42)]})
    assert new_tokens == [(q, SampledToken(42))]
    assert (p.num_computed_tokens, q.num_computed_tokens) == (8, 5)
    assert q.token_ids[-1] == 42 and q.num_output_tokens == 1


def test_a_draft_model_admission_that_falls_back_to_its_prompt_takes_its_hits_once():
    """3 blocks. "first" computed 8 tokens (2 cached blocks) and finished. "again" shares
    them and adds 2 tokens: its prompt needs a third block, the 3 lookahead slots past it a
    fourth, which the pool lacks. The admission falls back to the prompt alone: the 2 hits
    taken once, one new block, no lookahead."""
    s = make_scheduler(num_blocks=3, speculative_config=DRAFT_MODEL)
    first = make_seq("first", 8, max_tokens=1)
    s.add(first)
    out = s.schedule()
    cached = first.block_table[:2]  # its two full blocks (the third held its lookahead)
    s.update(out, {first: [SampledToken(7)]})
    assert first.is_finished
    again = make_seq("again", 10)
    s.add(again)
    [item] = s.schedule().scheduled
    assert item.seq is again and (item.num_new_tokens, again.num_computed_tokens) == (2, 8)
    assert again.block_table[:2] == cached and len(set(again.block_table)) == 3
    assert [s.block_manager.blocks[b].ref_count for b in again.block_table] == [1, 1, 1]
    assert s.block_manager.num_free_blocks == 0
    assert (again.num_prefix_hit_tokens, s.block_manager.prefix_cache_hits) == (8, 8)


def test_a_decode_whose_dropped_drafts_still_do_not_fit_preempts_instead_of_spinning():
    """The drafts (and any lookahead) are dropped first; when the token alone still needs
    a block the full pool lacks, the newest sequence is preempted, here itself."""
    s = make_scheduler(num_blocks=2)
    seq = make_seq("a", 8)
    seq.token_ids.append(7)  # a decode whose next token needs a third block
    place(s, seq, 8)
    seq.spec_token_ids = [1, 2, 3]
    out = s.schedule()
    assert out.preempted == [seq] and out.scheduled == []
    assert seq.status is SequenceStatus.WAITING and s.block_manager.num_free_blocks == 2


def test_a_draft_model_admission_with_prefix_hits_keeps_its_lookahead_slots():
    """4 blocks: the 2 hits, the 2 new prompt tokens and the 3 lookahead slots past the
    end (13 tokens) fit, so the admission takes all four blocks."""
    s = make_scheduler(num_blocks=4, speculative_config=DRAFT_MODEL)
    first = make_seq("first", 8, max_tokens=1)
    s.add(first)
    s.update(s.schedule(), {first: [SampledToken(7)]})
    again = make_seq("again", 10)
    s.add(again)
    [item] = s.schedule().scheduled
    assert (item.num_new_tokens, again.num_computed_tokens) == (2, 8)
    assert len(again.block_table) == 4 and s.block_manager.num_free_blocks == 0
