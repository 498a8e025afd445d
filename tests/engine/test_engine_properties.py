"""Property tests of the scheduler and block manager together (no model): random
interleavings of admissions with shared prefixes, steps, aborts, preemptions (a small pool
forces them) and n > 1 forks keep the block pool consistent.

After every operation: each block's ref count equals the number of block tables holding
it, the free queue holds exactly the unreferenced blocks, the pool is never exceeded, each
running sequence holds exactly the blocks its computed tokens need, and a shadow copy of
the KV cache (position and token written in each slot, copied on write like the real one)
shows that every computed position of every running sequence holds that sequence's token
at that position, so a prefix-cache hit never hands out K/V of other tokens or positions.
"""

import random
from dataclasses import dataclass

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pagefleet_serve.config import EngineConfig
from pagefleet_serve.engine.block_manager import BlockManager
from pagefleet_serve.engine.sampler import SampledToken
from pagefleet_serve.engine.scheduler import Scheduler, SchedulerOutput
from pagefleet_serve.engine.sequence import Sequence, SequenceStatus
from pagefleet_serve.sampling_params import SamplingParams

BS = 4
VOCAB = 6  # few token ids, so that prompts share prefixes and outputs repeat them
MAX_PROMPT = 14
MAX_OUTPUT = 8
# A request whose prompt and output fit in this many blocks; the pool always holds one.
MAX_SEQ_BLOCKS = -(-(MAX_PROMPT + MAX_OUTPUT) // BS)
MAX_STEPS_TO_DRAIN = 400

# Two 8-token prefixes that hold the same 4 tokens at different positions, and none.
PREFIXES = [[1, 2, 3, 4, 5, 0, 1, 2], [5, 0, 1, 2, 3, 4, 5, 0], []]


@dataclass
class Add:
    prefix: int  # index into PREFIXES
    suffix: list[int]
    n: int
    max_tokens: int
    priority: int
    eos: bool


@dataclass
class Step:
    pass


@dataclass
class Abort:
    which: int  # index (mod the number of live requests)


adds = st.builds(
    Add,
    prefix=st.integers(0, len(PREFIXES) - 1),
    suffix=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=MAX_PROMPT - 8),
    n=st.integers(1, 3),
    max_tokens=st.integers(1, MAX_OUTPUT),
    priority=st.integers(-1, 1),
    eos=st.booleans(),
)
operations = st.lists(
    st.one_of(adds, st.just(Step()), st.builds(Abort, st.integers(0, 10))),
    min_size=1,
    max_size=40,
)
engines = st.fixed_dictionaries(
    {
        "num_blocks": st.integers(MAX_SEQ_BLOCKS, 2 * MAX_SEQ_BLOCKS),
        "max_num_seqs": st.integers(3, 6),
        "max_num_batched_tokens": st.integers(4, 32),
        "enable_prefix_caching": st.sampled_from([True, True, False]),
    }
)


class Harness:
    """The scheduler and block manager, a shadow KV cache, and fake sampled tokens."""

    def __init__(self, num_blocks, max_num_seqs, max_num_batched_tokens, enable_prefix_caching):
        config = EngineConfig(
            model="builtin://tiny-random",
            block_size=BS,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        self.bm = BlockManager(num_blocks, BS, enable_prefix_caching)
        self.scheduler = Scheduler(config, self.bm, max_model_len=MAX_PROMPT + MAX_OUTPUT)
        self.kv: dict[int, dict[int, tuple[int, int]]] = {}  # block -> slot -> (pos, token)
        self.tokens = random.Random(0)
        self.num_requests = 0

    def add(self, op: Add) -> None:
        prompt = PREFIXES[op.prefix] + op.suffix
        seq = Sequence(
            request_id=f"r{self.num_requests}",
            sample_index=0,
            token_ids=prompt,
            num_prompt_tokens=len(prompt),
            params=SamplingParams(max_tokens=op.max_tokens),
            eos_token_id=0 if op.eos else None,
            arrival_time=0.0,
            priority=op.priority,
            sibling_generators=[None] * (op.n - 1),
        )
        self.num_requests += 1
        self.scheduler.add(seq)

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        self._run_on_shadow_kv(out)
        sampled = {
            item.seq: [
                SampledToken(self.tokens.randrange(VOCAB)) for _ in range(item.seq.num_samples)
            ]
            for item in out.scheduled
            if item.samples
        }
        self.scheduler.update(out, sampled)
        # Shown by --hypothesis-show-statistics: how often the paths under test were taken.
        if out.preempted:
            event("a step preempted")
        if out.block_copies:
            event("a step copied a shared block")
        if any(item.seq.num_prefix_hit_tokens for item in out.scheduled):
            event("a step ran a prefix-cache hit")
        return out

    def abort(self, op: Abort) -> None:
        live = sorted({s.request_id for s in self.scheduler.running + self.scheduler.waiting})
        if live:
            for seq in self.scheduler.sequences_of(live[op.which % len(live)]):
                self.scheduler.finish(seq, "abort")

    def _run_on_shadow_kv(self, out: SchedulerOutput) -> None:
        """What the model runner does with the step: copies first, then writes K/V."""
        for src, dst in out.block_copies:
            self.kv[dst] = dict(self.kv.get(src, {}))
        for item in out.scheduled:
            seq = item.seq
            start = seq.num_computed_tokens
            for pos in range(start, start + item.num_new_tokens):
                block = seq.block_table[pos // BS]
                self.kv.setdefault(block, {})[pos % BS] = (pos, seq.token_ids[pos])

    def check(self) -> None:
        bm, scheduler = self.bm, self.scheduler
        running, waiting = scheduler.running, scheduler.waiting
        assert len(running) <= scheduler.max_num_seqs
        assert all(s.status is SequenceStatus.RUNNING for s in running)
        assert all(s.status is SequenceStatus.WAITING and s.block_table == [] for s in waiting)
        assert len({id(s) for s in running + waiting}) == len(running) + len(waiting)

        holders = [0] * bm.num_blocks
        for seq in running:
            assert len(set(seq.block_table)) == len(seq.block_table)
            for block_id in seq.block_table:
                holders[block_id] += 1
            # Exactly the blocks its computed tokens need: no more (a leak), no fewer.
            assert seq.num_computed_tokens <= seq.num_tokens
            assert len(seq.block_table) == bm.blocks_needed(seq.num_computed_tokens)
            for pos in range(seq.num_computed_tokens):
                slot = self.kv[seq.block_table[pos // BS]][pos % BS]
                assert slot == (pos, seq.token_ids[pos]), (seq.seq_id, pos, slot)
        assert [b.ref_count for b in bm.blocks] == holders

        free = bm.free_queue.block_ids()
        assert len(free) == len(set(free)) == bm.num_free_blocks  # nothing freed twice
        assert sorted(free) == [i for i, n in enumerate(holders) if n == 0]
        assert bm.num_used_blocks == sum(1 for n in holders if n) <= bm.num_blocks
        for block_hash, block in bm.cached.items():
            assert block.block_hash == block_hash

    def drain(self) -> None:
        for _ in range(MAX_STEPS_TO_DRAIN):
            if not self.scheduler.has_unfinished():
                return
            self.step()
            self.check()
        raise AssertionError(f"still unfinished after {MAX_STEPS_TO_DRAIN} steps")


@settings(
    max_examples=400,
    deadline=None,
    derandomize=True,  # the same examples on every run: `make test` stays deterministic
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(engine=engines, ops=operations)
def test_random_interleavings_keep_the_block_pool_consistent(engine, ops):
    harness = Harness(**engine)
    for op in ops:
        if isinstance(op, Add):
            harness.add(op)
        elif isinstance(op, Step):
            harness.step()
        else:
            harness.abort(op)
        harness.check()
    harness.drain()
    harness.bm.check_no_leaks()
