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


def test_long_prompt_is_chunked_and_decodes_go_first():
    s = make_scheduler(max_num_batched_tokens=16)
    s.add(make_seq("short", 3, max_tokens=50))
    assert run_step(s)[0] == {"short": 3}
    s.add(make_seq("long", 40, first_token=100))
    steps = []
    while s.sequences_of("long")[0].num_computed_tokens < 40:
        steps.append(run_step(s)[0])
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
    s.add(make_seq("late-urgent", 4, priority=-1))
    s.add(make_seq("early", 4, first_token=50))
    s.add(make_seq("urgent-2", 4, priority=-1, first_token=90))
    assert [q.request_id for q in s.waiting] == ["late-urgent", "urgent-2", "early"]


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
    while not old.is_finished:
        run_step(s)
    # The preempted one resumes, recomputing prompt + its first output token (old's growth
    # evicted its cached blocks).
    scheduled, _ = run_step(s)
    assert scheduled == {"new": 9}
    while not new.is_finished:
        run_step(s)
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
