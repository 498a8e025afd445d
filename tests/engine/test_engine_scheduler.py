"""The scheduler on its own (no model): budgets, chunking, admission order, preemption."""

from pagefleet_serve.config import EngineConfig
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
