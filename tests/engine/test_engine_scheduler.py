"""The scheduler on its own (no model): budgets, chunking, admission order, preemption."""

from pagefleet_serve.config import EngineConfig, SpeculativeConfig
from pagefleet_serve.engine.block_manager import BlockManager
from pagefleet_serve.engine.sampler import SampledToken
from pagefleet_serve.engine.scheduler import Scheduler
from pagefleet_serve.engine.sequence import Sequence, SequenceStatus
from pagefleet_serve.sampling_params import SamplingParams

BS = 4


def make_scheduler(num_blocks=64, **config):
    config = EngineConfig(model="builtin://tiny-random", block_size=BS, **config)
    return Scheduler(config, BlockManager(num_blocks, BS, True), max_model_len=1024)


def make_seq(request_id, num_tokens, max_tokens=16, priority=0, first_token=0):
    tokens = list(range(first_token, first_token + num_tokens))
    return Sequence(
        request_id=request_id,
        sample_index=0,
        token_ids=tokens,
        num_prompt_tokens=num_tokens,
        params=SamplingParams(max_tokens=max_tokens),
        eos_token_id=None,
        arrival_time=0.0,
        priority=priority,
    )


def run_step(scheduler, token=7):
    """Schedule one step and feed back a token for every sequence that samples."""
    out = scheduler.schedule()
    sampled = {
        item.seq: [SampledToken(token)] * item.seq.num_samples
        for item in out.scheduled
        if item.samples
    }
    scheduler.update(out, sampled)
    return {item.seq.request_id: item.num_new_tokens for item in out.scheduled}, out


def steps_while(scheduler, condition, max_steps=100):
    """Step while `condition()` holds; a scheduler that stops making progress fails here
    instead of looping forever. Returns each step's {request_id: num_new_tokens}."""
    steps = []
    while condition():
        assert len(steps) < max_steps, f"no progress after {max_steps} steps"
        steps.append(run_step(scheduler)[0])
    return steps


def test_long_prompt_is_chunked_and_decodes_go_first():
    s = make_scheduler(max_num_batched_tokens=16)
    s.add(make_seq("short", 3, max_tokens=50))
    assert run_step(s)[0] == {"short": 3}
    s.add(make_seq("long", 40, first_token=100))
    steps = steps_while(s, lambda: s.sequences_of("long")[0].num_computed_tokens < 40)
    # The running decode gets its token in every step; the prompt takes the rest.
    assert steps == [{"short": 1, "long": 15}, {"short": 1, "long": 15}, {"short": 1, "long": 10}]


def test_a_long_prefill_leaves_half_the_budget_to_a_request_that_arrives():
    """A short request arriving during a long prompt's prefill starts in the next step,
    not after the whole prompt (issue 42, item 7: each chunk can take seconds on a CPU)."""
    s = make_scheduler(max_num_batched_tokens=16)
    s.add(make_seq("short", 3, max_tokens=50))
    run_step(s)
    s.add(make_seq("long", 60, first_token=100))
    assert run_step(s)[0] == {"short": 1, "long": 15}
    s.add(make_seq("late", 4, max_tokens=2, first_token=300))
    # Of the 15 tokens the decode leaves, the prefill takes 8; "late" is admitted beside it.
    assert run_step(s)[0] == {"short": 1, "long": 8, "late": 4}
    # Nobody waits: the prefill takes the whole budget again.
    assert run_step(s)[0] == {"short": 1, "late": 1, "long": 14}


def test_a_long_prefill_takes_the_half_back_when_no_waiting_request_fits():
    s = make_scheduler(max_num_seqs=2, max_num_batched_tokens=16)
    s.add(make_seq("short", 3, max_tokens=50))
    run_step(s)
    s.add(make_seq("long", 60, first_token=100))
    run_step(s)
    s.add(make_seq("no-seat", 4, first_token=300))  # both seats are taken
    assert run_step(s)[0] == {"short": 1, "long": 15}
    assert [q.request_id for q in s.waiting] == ["no-seat"]
    long = s.sequences_of("long")[0]
    assert long.num_computed_tokens == 30 and len(long.block_table) * BS >= 30


def test_two_long_prefills_take_back_what_no_waiting_request_used_in_turn():
    s = make_scheduler(max_num_seqs=2, max_num_batched_tokens=16)
    s.add(make_seq("a", 35))
    s.add(make_seq("b", 60, first_token=100))
    assert run_step(s)[0] == {"a": 16}
    assert run_step(s)[0] == {"a": 8, "b": 8}  # b, waiting, was admitted with the half left
    s.add(make_seq("no-seat", 4, first_token=300))
    # a 8 of 16, b 4 of the 8 left; nobody admitted: a takes 3 more (its prompt's end),
    # b the last 1; the step's tokens are the budget, not more.
    scheduled, out = run_step(s)
    assert scheduled == {"a": 11, "b": 5} and out.num_batched_tokens == 16


def test_max_num_seqs_bounds_the_running_set():
    s = make_scheduler(max_num_seqs=2)
    for i in range(3):
        s.add(make_seq(f"r{i}", 4, first_token=10 * i))
    scheduled, _ = run_step(s)
    assert set(scheduled) == {"r0", "r1"} and [q.request_id for q in s.waiting] == ["r2"]


def test_priority_then_arrival():
    s = make_scheduler(max_num_seqs=1)
    s.add(make_seq("early", 4, max_tokens=2))
    s.add(make_seq("late-urgent", 4, max_tokens=2, priority=-1, first_token=50))
    s.add(make_seq("urgent-2", 4, max_tokens=2, priority=-1, first_token=90))
    assert [q.request_id for q in s.waiting] == ["late-urgent", "urgent-2", "early"]
    # One at a time, each to the end: the run order is the waiting order.
    runs = []
    for step in steps_while(s, s.has_unfinished):
        runs += [r for r in step if r not in runs]
    assert runs == ["late-urgent", "urgent-2", "early"]
    s.block_manager.check_no_leaks()


def place(s, seq, num_computed):
    """Put `seq` in the running set with `num_computed` tokens computed (a mid-flight state
    that steps reach only through long, fragile sequences of budgets)."""
    assert s.block_manager.allocate(seq, num_computed) is not None
    seq.num_computed_tokens = num_computed
    seq.status = SequenceStatus.RUNNING
    s.running.append(seq)


def test_victim_is_the_lowest_priority_even_when_older():
    s = make_scheduler(num_blocks=4)
    old = make_seq("old-background", 9, priority=1)
    new = make_seq("new-urgent", 9, priority=0, first_token=50)
    place(s, old, 8)
    place(s, new, 8)  # both now need a third block; the pool is full
    scheduled, out = run_step(s)
    assert out.preempted == [old] and scheduled == {"new-urgent": 1}
    assert old.status is SequenceStatus.WAITING and old.block_table == []
    assert s.waiting == [old] and s.block_manager.num_free_blocks == 1


def test_a_sequence_that_is_the_victim_preempts_itself():
    s = make_scheduler(num_blocks=4)
    old = make_seq("old", 7)
    new = make_seq("new", 9, first_token=50)
    place(s, old, 6)  # its next token fits its second block
    place(s, new, 8)  # its next token needs a third block, and it is the newest
    scheduled, out = run_step(s)
    assert out.preempted == [new] and scheduled == {"old": 1}
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0
    assert s.running == [old] and s.waiting == [new]
    # Nothing is admitted in a step that preempted, even with blocks free now.
    assert s.block_manager.num_free_blocks == 2


def decode_of(request_id, prompt, first_token):
    """A sequence with `prompt` tokens and one output token (7): a decode once placed."""
    seq = make_seq(request_id, prompt, first_token=first_token)
    seq.token_ids.append(7)
    return seq


def test_a_victim_preempted_earlier_in_the_step_is_skipped_and_the_rest_still_run():
    s = make_scheduler(num_blocks=5)
    a = decode_of("a", 8, first_token=0)
    b = make_seq("b", 7, first_token=100)
    c = decode_of("c", 4, first_token=200)
    place(s, a, 8)  # a decode whose next token needs a third block
    place(s, b, 5)  # a prefill whose last 2 prompt tokens fit its second block
    place(s, c, 4)  # the newest: the victim, after a and before b in the step's order
    scheduled, out = run_step(s)
    assert out.preempted == [c] and scheduled == {"a": 1, "b": 2}
    assert (c.num_preemptions, s.num_preemptions) == (1, 1)


def test_after_a_sequence_preempts_itself_the_older_prefills_still_run():
    s = make_scheduler(num_blocks=3)
    a = make_seq("a", 7)
    c = decode_of("c", 4, first_token=200)
    place(s, a, 5)  # a prefill that needs no new block
    place(s, c, 4)  # a decode (scheduled first) that needs one, and the newest
    scheduled, out = run_step(s)
    assert out.preempted == [c] and scheduled == {"a": 2}
    # Back in the same spot (a's next token fits its second block): preempted again, and
    # both preemptions are counted.
    s.waiting.remove(c)
    place(s, c, 4)
    scheduled, out = run_step(s)
    assert out.preempted == [c] and scheduled == {"a": 1}
    assert (c.num_preemptions, s.num_preemptions) == (2, 2)


def test_budget_of_an_already_scheduled_victim_is_given_back():
    s = make_scheduler(num_blocks=4, max_num_batched_tokens=5)
    low = make_seq("low-decode", 5, priority=2)
    low.token_ids.append(7)  # its first output token: now a decode
    p = make_seq("p", 12, priority=1, first_token=100)
    q = make_seq("q", 12, priority=1, first_token=200)
    place(s, low, 5)  # a decode: scheduled first, needs no block
    place(s, p, 4)  # prefills: p's next 4 tokens need a block the full pool lacks
    place(s, q, 4)
    scheduled, out = run_step(s)
    # low (1 token) is preempted after it was scheduled: its token goes back to the budget,
    # and q, after p's 4, gets the 1 token left.
    assert out.preempted == [low]
    assert scheduled == {"p": 4, "q": 1} and out.num_batched_tokens == 5
    assert s.block_manager.num_free_blocks == 0


def test_a_prompt_that_will_fork_counts_all_its_samples_against_max_num_seqs():
    s = make_scheduler(max_num_seqs=3, max_num_batched_tokens=8)
    forking = make_seq("n3", 12, max_tokens=4)
    forking.sibling_generators = [None, None]
    s.add(forking)
    s.add(make_seq("single", 4, first_token=50))
    # The n=3 prompt is prefilled in two chunks; the single request must wait for a seat
    # even though only one sequence runs: the prompt will be three.
    assert run_step(s)[0] == {"n3": 8}
    assert run_step(s)[0] == {"n3": 4}
    assert len(s.running) == 3 and [q.request_id for q in s.waiting] == ["single"]
    steps_while(s, lambda: [q.request_id for q in s.waiting] == ["single"])
    assert len(s.running) <= 3
    assert s.sequences_of("single")[0].status is SequenceStatus.RUNNING


def test_newest_is_preempted_when_blocks_run_out_and_resumes():
    s = make_scheduler(num_blocks=4, max_num_seqs=8)
    old, new = make_seq("old", 8, max_tokens=8), make_seq("new", 8, max_tokens=8, first_token=50)
    s.add(old)
    s.add(new)
    run_step(s)  # both prefilled: 2 blocks each, pool full
    assert s.block_manager.num_free_blocks == 0
    scheduled, out = run_step(s)  # both need a third block: the newest goes
    assert out.preempted == [new] and new.status is SequenceStatus.WAITING
    assert new.num_computed_tokens == 0 and new.num_preemptions == 1
    assert scheduled == {"old": 1}
    steps_while(s, lambda: not old.is_finished)
    # The preempted one resumes, recomputing prompt + its first output token (old's growth
    # evicted its cached blocks).
    scheduled, _ = run_step(s)
    assert scheduled == {"new": 9}
    steps_while(s, lambda: not new.is_finished)
    assert new.output_token_ids == [7] * 8 and s.num_preemptions == 1
    s.block_manager.check_no_leaks()


def test_finish_reasons_and_abort_free_blocks():
    s = make_scheduler()
    a = make_seq("a", 5, max_tokens=2)
    b = make_seq("b", 5, max_tokens=100, first_token=40)
    s.add(a)
    s.add(b)
    run_step(s)
    run_step(s)
    assert a.finish_reason == "length" and a.block_table == []
    s.finish(b, "abort")
    assert b.finish_reason == "abort" and not s.has_unfinished()
    s.block_manager.check_no_leaks()


def test_eos_and_stop_token_ids():
    s = make_scheduler()
    eos = make_seq("eos", 3)
    eos.eos_token_id = 7
    s.add(eos)
    run_step(s, token=7)
    assert eos.finish_reason == "stop" and eos.output_token_ids == [7]


def test_fork_into_n_samples_after_the_prompt():
    s = make_scheduler()
    seq = make_seq("n", 6)
    seq.sibling_generators = [None, None]
    s.add(seq)
    run_step(s)
    family = s.sequences_of("n")
    assert [f.sample_index for f in family] == [0, 1, 2]
    assert all(f.output_token_ids == [7] for f in family)
    # The three share the prompt's blocks; the first write to the partial block copies it.
    shared = seq.block_table[1]
    assert all(f.block_table == seq.block_table for f in family)
    _, out = run_step(s)
    assert [src for src, _ in out.block_copies] == [shared, shared]
    assert len({f.block_table[1] for f in family}) == 3
    for f in family:
        s.finish(f, "abort")
    s.block_manager.check_no_leaks()


def test_token_budget_bounds_admissions_and_decodes():
    s = make_scheduler(max_num_batched_tokens=9)
    for i in range(3):
        s.add(make_seq(f"r{i}", 4, first_token=10 * i))
    # 4 + 4 + the one token left: r2's prompt is chunked.
    assert run_step(s)[0] == {"r0": 4, "r1": 4, "r2": 1}
    s.max_num_batched_tokens = 2
    assert run_step(s)[0] == {"r0": 1, "r1": 1}  # no budget left for r2's next chunk
    # A budget spent exactly leaves the next request waiting (not admitted with 0 tokens).
    s = make_scheduler(max_num_batched_tokens=8)
    for i in range(3):
        s.add(make_seq(f"r{i}", 4, first_token=10 * i))
    assert run_step(s)[0] == {"r0": 4, "r1": 4}
    assert [q.request_id for q in s.waiting] == ["r2"]


def test_admission_takes_prefix_cache_hits_and_counts_them():
    s = make_scheduler()
    first = make_seq("first", 9, max_tokens=1)
    s.add(first)
    run_step(s)
    assert first.finish_reason == "length"
    again = make_seq("again", 9, max_tokens=1)
    s.add(again)
    # The first two blocks (8 tokens) are reused: only the ninth token is computed.
    assert run_step(s)[0] == {"again": 1}
    assert again.num_prefix_hit_tokens == 8
    bm = s.block_manager
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (18, 8)
    bm.check_no_leaks()


def test_stop_token_ids_and_max_model_len_end_a_sequence():
    stop = make_seq("stop", 3)
    stop.params = SamplingParams(max_tokens=16, stop_token_ids=[7])
    s = make_scheduler()
    s.add(stop)
    run_step(s, token=7)
    assert stop.finish_reason == "stop"
    config = EngineConfig(model="builtin://tiny-random", block_size=BS)
    s = Scheduler(config, BlockManager(64, BS, True), max_model_len=6)
    full = make_seq("full", 4)
    s.add(full)
    steps_while(s, lambda: not full.is_finished)
    assert (full.num_tokens, full.finish_reason) == (6, "length")


def test_update_returns_each_new_token_and_forks_with_the_sibling_generators():
    import torch

    s = make_scheduler()
    seq = make_seq("n", 3)
    generators = [torch.Generator(), torch.Generator()]
    seq.sibling_generators = list(generators)
    s.add(seq)
    out = s.schedule()
    tokens = [SampledToken(5), SampledToken(6), SampledToken(7)]
    new = s.update(out, {seq: tokens})
    family = s.sequences_of("n")
    assert new == list(zip(family, tokens, strict=True))
    assert [f.generator for f in family[1:]] == generators


# -- speculative decoding -------------------------------------------------------------------
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=8)
DRAFT_MODEL = SpeculativeConfig(
    method="draft_model", model="builtin://tiny-random", num_speculative_tokens=3
)


def decoding(s, request_id="a", prompt=5, max_tokens=16, first_token=0, drafts=()):
    """A sequence past its prefill (one token sampled: 7), proposing `drafts`."""
    seq = make_seq(request_id, prompt, max_tokens=max_tokens, first_token=first_token)
    s.add(seq)
    run_step(s)
    assert (seq.num_tokens, seq.num_computed_tokens) == (prompt + 1, prompt)
    seq.spec_token_ids = list(drafts)
    return seq


def test_drafts_are_verified_and_only_the_accepted_ones_count_as_computed():
    s = make_scheduler(speculative_config=NGRAM)
    seq = decoding(s, drafts=[20, 21, 22])
    out = s.schedule()
    [item] = out.scheduled
    assert (item.num_new_tokens, item.spec_token_ids) == (4, [20, 21, 22])
    assert item.input_token_ids == [7, 20, 21, 22] and item.samples
    assert len(seq.block_table) == 3  # slots for positions 5..8
    # The model accepts 20 and 21, rejects 22 and samples 9 in its place.
    accepted = [SampledToken(20), SampledToken(21), SampledToken(9)]
    assert s.update(out, {seq: accepted}) == [(seq, t) for t in accepted]
    assert seq.token_ids[-4:] == [7, 20, 21, 9]
    # 7, 20 and 21 have their KV now; 9 is computed by the next step. The block that
    # held only the rejected draft's slot goes back.
    assert (seq.num_tokens, seq.num_computed_tokens) == (9, 8)
    assert len(seq.block_table) == 2
    assert s.block_manager.num_free_blocks == 64 - 2


def test_a_draft_run_stops_at_the_token_that_ends_the_sequence():
    s = make_scheduler(speculative_config=NGRAM)
    seq = decoding(s, drafts=[20, 21, 22])
    seq.params = SamplingParams(max_tokens=16, stop_token_ids=[21])
    out = s.schedule()
    tokens = [SampledToken(20), SampledToken(21), SampledToken(22), SampledToken(9)]
    assert s.update(out, {seq: tokens}) == [(seq, tokens[0]), (seq, tokens[1])]
    assert seq.is_finished and seq.finish_reason == "stop"
    assert seq.block_table == [] and s.block_manager.num_free_blocks == 64


def test_drafts_fit_the_budget_max_tokens_and_context():
    drafts = list(range(20, 28))
    # Budget 4: the decode's own token and 3 drafts.
    s = make_scheduler(speculative_config=NGRAM, max_num_batched_tokens=8)
    decoding(s, drafts=drafts)
    s.max_num_batched_tokens = 4
    assert s.schedule().scheduled[0].spec_token_ids == drafts[:3]
    # max_tokens 4 with one output token: 2 drafts, so that the bonus token is the 4th.
    s = make_scheduler(speculative_config=NGRAM)
    decoding(s, max_tokens=4, drafts=drafts)
    assert s.schedule().scheduled[0].spec_token_ids == drafts[:2]
    # max_tokens 2: no room for a draft beside the bonus token.
    s = make_scheduler(speculative_config=NGRAM)
    decoding(s, max_tokens=2, drafts=drafts)
    [item] = s.schedule().scheduled
    assert (item.num_new_tokens, item.spec_token_ids) == (1, [])
    # A context of 9 tokens with 6 in the sequence: 2 drafts (positions 6, 7) and the bonus.
    s = Scheduler(
        EngineConfig(model="builtin://tiny-random", block_size=BS, speculative_config=NGRAM),
        BlockManager(64, BS, True),
        max_model_len=9,
    )
    decoding(s, drafts=drafts)
    assert s.schedule().scheduled[0].spec_token_ids == drafts[:2]


def test_a_prefilling_sequence_verifies_no_drafts():
    s = make_scheduler(speculative_config=NGRAM, max_num_batched_tokens=4)
    seq = make_seq("a", 10)
    s.add(seq)
    run_step(s)  # 4 of the 10 prompt tokens
    seq.spec_token_ids = [20, 21]
    [item] = s.schedule().scheduled
    assert (item.num_new_tokens, item.spec_token_ids) == (4, [])


def test_drafts_are_dropped_before_anyone_is_preempted_for_them():
    # 3 blocks: a (4 prompt tokens) and b (3) take one each. a's decode needs the third;
    # its 5 drafts would need two more: they are dropped, and b is not preempted.
    s = make_scheduler(num_blocks=3, speculative_config=NGRAM)
    a = make_seq("a", 4)
    b = make_seq("b", 3, first_token=50)
    s.add(a)
    s.add(b)
    run_step(s)
    a.spec_token_ids = [20, 21, 22, 23, 24]
    out = s.schedule()
    assert out.preempted == []
    assert [(i.seq.request_id, i.num_new_tokens, i.spec_token_ids) for i in out.scheduled] == [
        ("a", 1, []),
        ("b", 1, []),
    ]


def test_a_draft_model_keeps_lookahead_slots_past_the_end():
    s = make_scheduler(speculative_config=DRAFT_MODEL)
    assert s.num_lookahead_tokens == 3
    seq = make_seq("a", 4)
    s.add(seq)
    s.schedule()
    # The prompt's 4 slots and 3 for the draft model's next proposals: 2 blocks, not 1.
    assert len(seq.block_table) == 2
    # n-gram proposals write no KV ahead: no lookahead.
    assert make_scheduler(speculative_config=NGRAM).num_lookahead_tokens == 0


def test_a_draft_models_lookahead_waits_for_the_end_of_a_chunked_prompt():
    s = make_scheduler(speculative_config=DRAFT_MODEL, max_num_batched_tokens=4)
    seq = make_seq("a", 10)
    s.add(seq)
    run_step(s)
    assert len(seq.block_table) == 1  # 4 of 10 prompt tokens: no lookahead yet
    run_step(s)
    assert len(seq.block_table) == 2
    run_step(s)  # the prompt's end: positions 8, 9 and 3 lookahead slots (10..12)
    assert len(seq.block_table) == 4


def test_a_draft_model_decode_allocates_drafts_and_lookahead_and_trims_after():
    s = make_scheduler(speculative_config=DRAFT_MODEL)
    seq = decoding(s, prompt=4, drafts=[20, 21, 22])
    # After the prefill: positions 0..3 and lookahead 4..6, 2 blocks.
    assert len(seq.block_table) == 2
    out = s.schedule()
    # Positions 4 (the sampled 7), 5..7 (drafts) and lookahead 8..10: 3 blocks.
    assert out.scheduled[0].num_new_tokens == 4 and len(seq.block_table) == 3
    # 20 accepted, 9 sampled: computed up to position 5, lookahead 6..8 kept, 3 blocks.
    s.update(out, {seq: [SampledToken(20), SampledToken(9)]})
    assert (seq.num_tokens, seq.num_computed_tokens) == (7, 6)
    assert len(seq.block_table) == 3


def test_admission_without_room_for_the_lookahead_still_admits_the_prompt():
    s = make_scheduler(num_blocks=1, speculative_config=DRAFT_MODEL)
    seq = make_seq("a", 4)
    s.add(seq)
    [item] = s.schedule().scheduled
    assert item.num_new_tokens == 4 and len(seq.block_table) == 1


def test_a_draft_model_admission_takes_its_prefix_hits_once():
    # 3 blocks: "first" computed 8 tokens (2 cached blocks) and finished. "again" shares
    # them and adds 1 token: it takes the 2 hits and one new block, which also holds the 3
    # lookahead slots (the fallback to the prompt alone: test_engine_scheduler_corners.py).
    s = make_scheduler(num_blocks=3, speculative_config=DRAFT_MODEL)
    first = make_seq("first", 8, max_tokens=1)
    s.add(first)
    run_step(s)
    assert first.is_finished
    again = make_seq("again", 9)
    s.add(again)
    [item] = s.schedule().scheduled
    assert (item.num_new_tokens, again.num_computed_tokens) == (1, 8)
    assert len(again.block_table) == 3 and len(set(again.block_table)) == 3
    assert [s.block_manager.blocks[b].ref_count for b in again.block_table] == [1, 1, 1]


def test_every_new_token_of_a_step_is_returned_decodes_and_forks_alike():
    s = make_scheduler()
    decodes = [make_seq("d", 3), make_seq("e", 3, first_token=20)]
    for seq in decodes:
        s.add(seq)
    run_step(s)
    fork = make_seq("f", 4, first_token=40)
    fork.sibling_generators = [None]
    s.add(fork)
    out = s.schedule()
    sampled = {
        decodes[0]: [SampledToken(8)],
        decodes[1]: [SampledToken(9)],
        fork: [SampledToken(5), SampledToken(6)],
    }
    new = s.update(out, sampled)
    assert [(q.request_id, q.sample_index, t.token_id) for q, t in new] == [
        ("d", 0, 8),
        ("e", 0, 9),
        ("f", 0, 5),
        ("f", 1, 6),
    ]


def with_adapter(request_id, lora_id, first_token):
    seq = make_seq(request_id, 4, first_token=first_token)
    seq.lora_id = lora_id
    return seq


def test_an_adapter_without_a_free_slot_waits_while_the_requests_behind_it_run():
    """One adapter slot: the first adapter's request takes it (one load handed out), a
    second adapter's request finds no free slot and waits, while a later request of the
    resident adapter and a base-model one are admitted behind it. Once the slot's readers
    finish, the waiting adapter is loaded into it."""
    s = make_scheduler(enable_lora=True, max_loras=1)
    first, other = with_adapter("a", 1, 0), with_adapter("b", 2, 10)
    same, base = with_adapter("a2", 1, 20), make_seq("c", 4, first_token=30)
    for seq in (first, other, same, base):
        s.add(seq)
    scheduled, out = run_step(s)
    assert set(scheduled) == {"a", "a2", "c"} and [q.request_id for q in s.waiting] == ["b"]
    assert out.lora_loads == [(0, 1)]
    assert (first.lora_slot, same.lora_slot, base.lora_slot) == (0, 0, None)
    run_step(s)
    assert run_step(s)[1].lora_loads == []  # resident: no copy while it runs
    for seq in (first, same):
        s.finish(seq, "abort")
    assert first.lora_slot is None
    scheduled, out = run_step(s)
    assert "b" in scheduled and out.lora_loads == [(0, 2)] and other.lora_slot == 0


def test_an_embedding_request_finishes_when_its_prompt_is_done_and_the_step_goes_on():
    """An embedding request's step that completes its prompt finishes it ("stop", its
    blocks freed); the sequences after it in the same step still get their tokens."""
    s = make_scheduler()
    pooled, generated = make_seq("embed", 4), make_seq("gen", 4, first_token=10)
    pooled.pooling = True
    s.add(pooled)
    s.add(generated)
    scheduled, _ = run_step(s)
    assert scheduled == {"embed": 4, "gen": 4}
    assert pooled.status is SequenceStatus.FINISHED and pooled.finish_reason == "stop"
    assert pooled.block_table == [] and s.running == [generated]
    assert generated.num_output_tokens == 1
