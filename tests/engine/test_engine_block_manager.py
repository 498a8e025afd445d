"""The block allocator on its own: exact block ids, free-queue order, ref counts."""

import hashlib
from array import array

import pytest
from pagefleet_serve.engine.block_manager import BlockManager, hash_block, lora_hash_seed
from pagefleet_serve.engine.sequence import Sequence
from pagefleet_serve.sampling_params import SamplingParams

BS = 4


def make_seq(tokens, request_id="r"):
    return Sequence(
        request_id=request_id,
        sample_index=0,
        token_ids=list(tokens),
        num_prompt_tokens=len(tokens),
        params=SamplingParams(),
        eos_token_id=None,
        arrival_time=0.0,
    )


def compute(bm, seq, num_tokens, prefix=()):
    """Allocate and 'run' num_tokens more tokens of seq (what one step does)."""
    copies = bm.allocate(seq, num_tokens, list(prefix))
    assert copies is not None
    seq.num_computed_tokens += num_tokens
    bm.cache_full_blocks(seq)
    return copies


def test_allocates_on_demand_and_frees_tail_first():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    seq = make_seq(range(10))
    compute(bm, seq, 6)  # a first prefill chunk: 2 blocks, not 3
    assert seq.block_table == [0, 1]
    compute(bm, seq, 4)
    assert seq.block_table == [0, 1, 2]
    assert bm.free_queue.block_ids() == [3, 4, 5, 6, 7]
    assert bm.num_used_blocks == 3 and bm.usage == pytest.approx(3 / 8)
    bm.free(seq)
    # The partial block 2 holds nothing reusable: it goes first; the cached chain 0 -> 1 is
    # appended tail first, so block 1 is evicted before block 0.
    assert bm.free_queue.block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    assert sorted(bm.cached.values(), key=lambda b: b.block_id) == bm.blocks[:2]
    bm.check_no_leaks()


def test_prefix_hit_reuses_blocks_and_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    first = make_seq(range(12))
    compute(bm, first, 12)
    bm.free(first)
    # The same 12 tokens: 3 cached blocks, but the last token must be computed for logits.
    again = make_seq(range(12), "again")
    hits = bm.find_cached_prefix(again)
    assert [b.block_id for b in hits] == [0, 1]
    # A different tail after 8 shared tokens.
    other = make_seq([*range(8), 99, 98, 97], "other")
    hits = bm.find_cached_prefix(other)
    assert [b.block_id for b in hits] == [0, 1]
    compute(bm, other, 3, hits)
    assert other.num_computed_tokens == 11
    assert other.block_table[:2] == [0, 1]
    assert [bm.blocks[i].ref_count for i in other.block_table] == [1, 1, 1]
    # The revived blocks left the free queue; the new block came from its front.
    assert 0 not in bm.free_queue.block_ids() and 1 not in bm.free_queue.block_ids()
    bm.free(other)
    bm.check_no_leaks()


def test_shared_blocks_are_ref_counted():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    a = make_seq([*range(8), 1], "a")
    compute(bm, a, 9)
    b = make_seq([*range(8), 2], "b")
    hits = bm.find_cached_prefix(b)
    compute(bm, b, 1, hits)
    assert [bm.blocks[i].ref_count for i in (0, 1)] == [2, 2]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in (0, 1)] == [1, 1]
    assert 0 not in bm.free_queue.block_ids()
    bm.free(b)
    bm.check_no_leaks()


def test_lru_eviction_drops_the_hash():
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    seq = make_seq(range(8))
    compute(bm, seq, 8)
    bm.free(seq)
    assert bm.free_queue.block_ids() == [2, 3, 1, 0]
    big = make_seq(range(100, 112), "big")  # needs 3 blocks: takes 2, 3, then evicts 1
    compute(bm, big, 12)
    assert big.block_table == [2, 3, 1]
    assert bm.blocks[1].block_hash != hash_block(bm.blocks[0].block_hash, list(range(4, 8)))
    probe = make_seq(range(9), "probe")
    assert [b.block_id for b in bm.find_cached_prefix(probe)] == [0]
    bm.free(big)
    bm.check_no_leaks()


def test_allocation_that_does_not_fit_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=BS, enable_prefix_caching=True)
    a = make_seq(range(8), "a")
    compute(bm, a, 8)
    b = make_seq(range(50, 58), "b")
    assert bm.allocate(b, 8) is None
    assert b.block_table == [] and bm.free_queue.block_ids() == [2]
    bm.free(a)
    bm.check_no_leaks()


def test_fork_shares_blocks_and_copies_the_partial_block_on_write():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    parent = make_seq(range(6))
    compute(bm, parent, 6)  # blocks 0 (full) and 1 (2 of 4 slots)
    child = parent.fork(1, None)
    bm.fork(child)
    assert [bm.blocks[i].ref_count for i in (0, 1)] == [2, 2]
    child.token_ids.append(7)
    copies = bm.allocate(child, 1)  # writes slot 2 of block 1, which the parent shares
    assert copies == [(1, 2)]
    assert child.block_table == [0, 2]
    assert [bm.blocks[i].ref_count for i in (0, 1, 2)] == [2, 1, 1]
    parent.token_ids.append(8)
    assert bm.allocate(parent, 1) == []  # now sole owner of block 1: writes in place
    bm.free(parent)
    bm.free(child)
    bm.check_no_leaks()


def test_prefix_caching_off_caches_nothing():
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    seq = make_seq(range(8))
    compute(bm, seq, 8)
    bm.free(seq)
    assert bm.cached == {} and bm.find_cached_prefix(make_seq(range(8), "x")) == []
    bm.check_no_leaks()


def test_hash_chain_covers_the_parent():
    first = hash_block(None, [1, 2, 3, 4])
    assert hash_block(first, [5, 6, 7, 8]) != hash_block(
        hash_block(None, [0, 2, 3, 4]), [5, 6, 7, 8]
    )
    assert hash_block(None, [1, 2, 3, 4]) == first


def sha256_chain(blocks):
    """The hash chain computed independently of `hash_block`: sha256(parent + int64 ids)."""
    hashes, parent = [], b""
    for tokens in blocks:
        parent = hashlib.sha256(parent + array("q", tokens).tobytes()).digest()
        hashes.append(parent)
    return hashes


def test_block_hashes_chain_each_block_to_its_parent():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    seq = make_seq([*range(12), 50])
    bm.update_block_hashes(seq)
    # Three full blocks are named, each after its own parent; the partial fourth is not.
    assert seq.block_hashes == sha256_chain([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]])


def test_leak_check_names_the_held_blocks():
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    seq = make_seq(range(5))
    compute(bm, seq, 5)
    with pytest.raises(AssertionError, match=r"blocks still referenced: \[0, 1\] \(2 in all\)"):
        bm.check_no_leaks()
    bm.free(seq)
    bm.check_no_leaks()


def test_the_same_tokens_at_another_position_miss_the_prefix_cache():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    first = make_seq([*range(8), 50], "first")
    compute(bm, first, 9)
    assert first.block_table == [0, 1, 2]
    bm.free(first)
    # Block 1 of `first` holds tokens 4-7 at positions 4-7; these sequences hold the same
    # four tokens at positions 0-3 or after another first block. Their K/V differs (the
    # positions and the attended prefix differ), so nothing may be reused.
    moved = make_seq([4, 5, 6, 7, 8, 9, 10, 11, 12], "moved")
    assert bm.find_cached_prefix(moved) == []
    other_parent = make_seq([9, 9, 9, 9, 4, 5, 6, 7, 12], "other-parent")
    assert bm.find_cached_prefix(other_parent) == []
    # The whole chain still hits, with its exact blocks.
    same = make_seq([*range(8), 60], "same")
    assert [b.block_id for b in bm.find_cached_prefix(same)] == [0, 1]
    bm.check_no_leaks()


@pytest.mark.parametrize(
    ("num_tokens", "block_table"),
    [(1, [0]), (4, [0]), (5, [0, 1]), (8, [0, 1]), (9, [0, 1, 2]), (12, [0, 1, 2])],
)
def test_exact_block_table_around_block_boundaries(num_tokens, block_table):
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    seq = make_seq(range(num_tokens))
    compute(bm, seq, num_tokens)
    assert seq.block_table == block_table
    assert bm.num_free_blocks == 4 - len(block_table)
    bm.free(seq)
    bm.check_no_leaks()


def test_decode_takes_a_new_block_exactly_one_past_the_boundary():
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    seq = make_seq(range(3))
    compute(bm, seq, 3)
    tables = []
    for token in range(10, 16):  # grow from 3 to 9 tokens, one decode step at a time
        seq.token_ids.append(token)
        compute(bm, seq, 1)
        tables.append(list(seq.block_table))
    assert tables == [[0], [0, 1], [0, 1], [0, 1], [0, 1], [0, 1, 2]]
    # A pool that is exactly full refuses the token one past its last block.
    full = make_seq(range(100, 104), "full")
    assert compute(bm, full, 4) == [] and bm.num_free_blocks == 0
    for token in range(16, 19):  # tokens 10-12 still fit block 2
        seq.token_ids.append(token)
        assert compute(bm, seq, 1) == []
    seq.token_ids.append(19)  # token 13 needs a fourth block: none is free
    assert bm.allocate(seq, 1) is None and seq.block_table == [0, 1, 2]
    bm.free(seq)
    bm.free(full)
    bm.check_no_leaks()


def test_trim_gives_back_the_blocks_past_the_computed_tokens_and_the_lookahead():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    seq = make_seq(range(8))
    assert bm.allocate(seq, 16) is not None  # 8 tokens and 8 draft slots: 4 blocks
    seq.num_computed_tokens = 8
    bm.trim(seq, num_lookahead_tokens=1)  # position 8 kept for a draft model: 3 blocks
    assert seq.block_table == [0, 1, 2] and bm.num_free_blocks == 5
    bm.trim(seq)  # no lookahead: the 8 computed tokens' 2 blocks
    assert seq.block_table == [0, 1] and bm.num_free_blocks == 6
    # Released tail first: the next allocation takes the block freed last.
    other = make_seq(range(100, 104), request_id="o")
    compute(bm, other, 4)
    assert other.block_table == [2]


def test_holds_slots_only_in_blocks_the_sequence_alone_holds():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    first = make_seq(range(6))
    compute(bm, first, 6)  # blocks 0 (full, cached) and 1 (positions 4..7)
    assert bm.holds_slots(first, 2)  # positions 6, 7
    assert not bm.holds_slots(first, 3)  # position 8 has no block yet
    # A prefix hit shares block 0; positions past it lie in the sequence's own block.
    second = make_seq([0, 1, 2, 3, 50, 51], request_id="second")
    compute(bm, second, 2, prefix=bm.find_cached_prefix(second))
    assert second.block_table[0] == first.block_table[0]
    assert bm.holds_slots(second, 2)  # positions 6, 7: its own block
    # A fork shares its parent's partial block until a write copies it.
    child = first.fork(1, None)
    bm.fork(child)
    assert not bm.holds_slots(child, 1) and not bm.holds_slots(first, 1)


def test_a_block_computed_twice_keeps_the_first_copy_cached():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    first, second = make_seq(range(5)), make_seq(range(5), request_id="second")
    # Both missed the cache in the same step: two copies of the same block.
    for seq in (first, second):
        assert bm.allocate(seq, 5) is not None
    for seq in (first, second):
        seq.num_computed_tokens = 5
        bm.cache_full_blocks(seq)
    [block_hash] = first.block_hashes
    assert bm.cached[block_hash].block_id == first.block_table[0]
    assert bm.blocks[second.block_table[0]].block_hash is None


def test_a_reused_block_is_cached_again_under_its_new_content():
    bm = BlockManager(num_blocks=2, block_size=BS, enable_prefix_caching=True)
    old = make_seq(range(8))
    compute(bm, old, 8)
    bm.free(old)
    new = make_seq(range(100, 108), request_id="new")
    compute(bm, new, 8)  # evicts both of old's blocks
    table = list(new.block_table)
    bm.free(new)
    again = make_seq([*range(100, 108), 1], request_id="again")
    assert [b.block_id for b in bm.find_cached_prefix(again)] == table


def test_a_freed_sequence_recomputed_from_scratch_caches_its_blocks_again():
    bm = BlockManager(num_blocks=2, block_size=BS, enable_prefix_caching=True)
    seq = make_seq(range(8))
    compute(bm, seq, 8)
    bm.free(seq)  # preempted
    seq.num_computed_tokens = 0
    other = make_seq(range(100, 108), request_id="other")
    compute(bm, other, 8)  # evicts seq's blocks
    bm.free(other)
    assert bm.find_cached_prefix(make_seq([*range(8), 1], request_id="probe")) == []
    compute(bm, seq, 8)  # recomputed: no hit left
    assert len(bm.find_cached_prefix(make_seq([*range(8), 1], request_id="probe"))) == 2


def test_prefix_lookups_accumulate():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    bm.count_prefix_lookup(10, 4)
    bm.count_prefix_lookup(6, 0)
    bm.count_prefix_lookup(9, 8)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (25, 12)


def test_a_leak_report_names_the_first_20_held_blocks_and_the_count():
    bm = BlockManager(num_blocks=32, block_size=BS, enable_prefix_caching=True)
    compute(bm, make_seq(range(100)), 100)  # 25 blocks, never freed
    with pytest.raises(AssertionError) as caught:
        bm.check_no_leaks()
    assert str(caught.value) == (
        f"blocks still referenced: {list(range(20))} (25 in all); free queue holds 7 of 32"
    )


def test_holds_slots_looks_only_at_the_blocks_of_those_slots():
    """A fork that copied its partial block on its first write holds the slots in it alone,
    even though a lookahead block after it (allocated by the parent, past the slots asked
    about) is still shared."""
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    parent = make_seq(range(6))
    assert bm.allocate(parent, 10) is not None  # 6 tokens and 4 lookahead slots: 3 blocks
    parent.num_computed_tokens = 6
    child = parent.fork(1, None)
    bm.fork(child)
    assert bm.allocate(child, 1) is not None  # copy-on-write of block 1 only
    assert child.block_table[2] == parent.block_table[2] != child.block_table[1]
    assert bm.holds_slots(child, 2)  # positions 6, 7: its own copy
    assert not bm.holds_slots(child, 3)  # position 8: the shared lookahead block


def test_the_same_tokens_under_another_adapter_are_another_prefix():
    """A sequence's first block hashes from its adapter's seed: the same tokens cached for
    the base model or one adapter are no hit for another adapter, and a hit for the same
    one."""
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    tokens = range(9)
    for lora_id in (None, 1):
        seq = make_seq(tokens, request_id=f"warm-{lora_id}")
        seq.lora_id = lora_id
        compute(bm, seq, 9)
    for lora_id, hits in ((None, 2), (1, 2), (2, 0)):
        seq = make_seq(tokens, request_id=f"probe-{lora_id}")
        seq.lora_id = lora_id
        assert len(bm.find_cached_prefix(seq)) == hits, lora_id


def test_an_adapters_seed_is_the_hash_of_its_id():
    """The first block's parent: none for the base model, sha256(b"lora:<id>") for an
    adapter, so a block hash is reproducible from the adapter id and the tokens alone."""
    assert lora_hash_seed(None) is None
    assert lora_hash_seed(7) == hashlib.sha256(b"lora:7").digest()
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    seq = make_seq(range(5))
    seq.lora_id = 7
    bm.update_block_hashes(seq)
    assert seq.block_hashes == [hash_block(lora_hash_seed(7), [0, 1, 2, 3])]
