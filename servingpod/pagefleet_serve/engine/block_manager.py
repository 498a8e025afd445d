"""The KV block allocator: ref-counted blocks, hash-chained prefix caching, LRU eviction.

A full block is named by sha256(parent block's hash + its token ids), so a hit means the
whole prefix up to and including that block is the same; a sequence's first block has the
hash of its LoRA adapter as parent (none for the base model), so that two adapters never
share K/V computed for the same tokens; a block holding an image's tokens has the image's
hash in its name too, so that two images behind the same placeholder tokens never share
K/V. Freed blocks keep their hash and
stay in the prefix cache until the allocator reuses them; the free queue is least recently
used first, and a sequence frees its blocks tail-first so that chain tails go first.
With `record_events`, naming and evicting blocks (and a reset) are recorded as vLLM's KV
cache events, which the engine takes after each step (`take_events`) and publishes.
With `record_named`, the blocks of the base model newly named are listed for the KV tier
(`take_named`), which copies them out after the step that computed them.
"""

import hashlib
from collections.abc import Callable

from pagefleet_serve.engine.sequence import Sequence
from pagefleet_serve.kv_event_messages import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    hash_block,
)


class KVBlock:
    __slots__ = ("block_hash", "block_id", "next", "prev", "ref_count")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) removal from the middle (a cache hit
    revives a freed block)."""

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels
        self._tail = KVBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def append(self, block: KVBlock) -> None:
        self._insert(block, self._tail.prev, self._tail)

    def appendleft(self, block: KVBlock) -> None:
        self._insert(block, self._head, self._head.next)

    def popleft(self) -> KVBlock:
        if self._len == 0:
            raise IndexError("no free blocks")
        block = self._head.next
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self._len -= 1

    def block_ids(self) -> list[int]:
        ids, node = [], self._head.next
        while node is not self._tail:
            ids.append(node.block_id)
            node = node.next
        return ids

    def _insert(self, block: KVBlock, before: KVBlock, after: KVBlock) -> None:
        block.prev, block.next = before, after
        before.next = after.prev = block
        self._len += 1


def lora_hash_seed(lora_id: int | None) -> bytes | None:
    """The parent hash of a sequence's first block: its adapter's, None for the base model."""
    if lora_id is None:
        return None
    return hashlib.sha256(b"lora:%d" % lora_id).digest()


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        record_events: bool = False,
        record_named: bool = False,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found
        self.events: list[KVCacheEvent] | None = [] if record_events else None
        self.named: list[tuple[bytes, int]] | None = [] if record_named else None
        # Called with each block hash that leaves the prefix cache (a hybrid model's state
        # checkpoint of that block goes with it).
        self.on_evict: list[Callable[[bytes], None]] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences (cached-but-free blocks count as free)."""
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------
    def update_block_hashes(self, seq: Sequence) -> None:
        """Extend `seq.block_hashes` over every full block of its known tokens."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_tokens // bs):
            parent = seq.block_hashes[i - 1] if i else lora_hash_seed(seq.lora_id)
            start, end = i * bs, (i + 1) * bs
            images = b"".join(
                bytes.fromhex(image.digest)
                for image in seq.images
                if image.offset < end and start < image.offset + image.length
            )
            seq.block_hashes.append(hash_block(parent, seq.token_ids[start:end], images))

    def find_cached_prefix(self, seq: Sequence) -> list[KVBlock]:
        """The longest run of cached blocks that starts the sequence. At least one token is
        always left to compute: the step needs its logits."""
        if not self.enable_prefix_caching:
            return []
        self.update_block_hashes(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block = self.cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's newly computed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        self.update_block_hashes(seq)
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        named = []
        for i in range(seq.num_cached_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            block_hash = seq.block_hashes[i]
            # A block computed twice (two requests missed the cache in the same step) keeps
            # the first copy as the cached one; the duplicate stays unnamed.
            if block.block_hash is None and block_hash not in self.cached:
                block.block_hash = block_hash
                self.cached[block_hash] = block
                named.append(i)
        seq.num_cached_blocks = max(seq.num_cached_blocks, num_full)
        if self.events is not None and named:
            self._record_stored(seq, named)
        if self.named is not None and seq.lora_id is None:
            self.named += [(seq.block_hashes[i], seq.block_table[i]) for i in named]

    def _record_stored(self, seq: Sequence, named: list[int]) -> None:
        """One BlockStored per run of consecutive newly named blocks: a run's blocks chain
        one to the next, its first to the block before it (already known to subscribers:
        stored earlier, or the cached twin of a duplicate)."""
        bs = self.block_size
        runs: list[list[int]] = []
        for i in named:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, last = run[0], run[-1]
            self.events.append(
                BlockStored(
                    block_hashes=[seq.block_hashes[i] for i in run],
                    parent_block_hash=seq.block_hashes[first - 1] if first else None,
                    token_ids=list(seq.token_ids[first * bs : (last + 1) * bs]),
                    block_size=bs,
                    lora_id=seq.lora_id,
                    medium=MEDIUM_GPU,
                    lora_name=None,
                )
            )

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, in order."""
        if self.events is None:
            return []
        events, self.events = self.events, []
        return events

    def take_named(self) -> list[tuple[bytes, int]]:
        """The (hash, block id) of the base model's blocks named since the last call."""
        if self.named is None:
            return []
        named, self.named = self.named, []
        return named

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's reset_prefix_cache), only while no sequence
        holds a block: a running sequence's blocks keep their names. Returns False,
        changing nothing, when some block is held."""
        if self.num_used_blocks:
            return False
        for block_hash, block in self.cached.items():
            block.block_hash = None
            for listener in self.on_evict:
                listener(block_hash)
        self.cached.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True

    # -- allocation ---------------------------------------------------------------------
    def allocate(
        self,
        seq: Sequence,
        num_new_tokens: int,
        cached_prefix: list[KVBlock] = (),
        num_loaded: int = 0,
    ) -> list[tuple[int, int]] | None:
        """Make room for `num_new_tokens` more computed tokens of `seq`, after taking
        `cached_prefix` (a new admission's prefix-cache hits) into its block table, then
        `num_loaded` fresh blocks that count as computed: the KV tier's hits, which the
        engine loads into them before the step (the step after names them).

        Returns the (src, dst) block copies to run first (copy-on-write of a shared partial
        block), or None, changing nothing, when the free blocks do not suffice.
        """
        bs = self.block_size
        table = seq.block_table
        num_computed = seq.num_computed_tokens + (len(cached_prefix) + num_loaded) * bs
        num_new_blocks = (
            self.blocks_needed(num_computed + num_new_tokens) - len(table) - len(cached_prefix)
        )
        write_block = num_computed // bs
        needs_copy = write_block < len(table) and self.blocks[table[write_block]].ref_count > 1
        num_revived = sum(1 for block in cached_prefix if block.ref_count == 0)
        if max(num_new_blocks, 0) + needs_copy + num_revived > self.num_free_blocks:
            return None

        for block in cached_prefix:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1
            table.append(block.block_id)
        if cached_prefix or num_loaded:
            seq.num_computed_tokens = num_computed
            seq.num_cached_blocks = len(cached_prefix)
        copies = []
        if needs_copy:
            shared = self.blocks[table[write_block]]
            shared.ref_count -= 1
            fresh = self._take_free_block()
            copies.append((shared.block_id, fresh.block_id))
            table[write_block] = fresh.block_id
        for _ in range(num_new_blocks):
            table.append(self._take_free_block().block_id)
        return copies

    def count_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_hit_tokens

    def fork(self, child: Sequence) -> None:
        """`child` was forked with a copy of its parent's block table: share the blocks."""
        for block_id in child.block_table:
            self.blocks[block_id].ref_count += 1

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks, tail first (chain tails are evicted first)."""
        for block_id in reversed(seq.block_table):
            self._release(self.blocks[block_id])
        seq.block_table = []
        seq.num_cached_blocks = 0

    def trim(self, seq: Sequence, num_lookahead_tokens: int = 0) -> None:
        """Release the blocks past the sequence's computed tokens (and the lookahead slots a
        draft model writes its next proposals into): those a step allocated for draft
        tokens that were then rejected (speculative decoding)."""
        keep = self.blocks_needed(seq.num_computed_tokens + num_lookahead_tokens)
        for block_id in reversed(seq.block_table[keep:]):
            self._release(self.blocks[block_id])
        del seq.block_table[keep:]

    def holds_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether the slots of the sequence's next `num_tokens` positions are allocated in
        blocks it alone holds (a fork shares its parent's partial block until the first
        write copies it), so that a draft model may write them before the step."""
        first = seq.num_computed_tokens // self.block_size
        last = (seq.num_computed_tokens + num_tokens - 1) // self.block_size
        return last < len(seq.block_table) and all(
            self.blocks[block_id].ref_count == 1 for block_id in seq.block_table[first : last + 1]
        )

    def _release(self, block: KVBlock) -> None:
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is None:
                self.free_queue.appendleft(block)  # holds nothing reusable
            else:
                self.free_queue.append(block)

    def _take_free_block(self) -> KVBlock:
        block = self.free_queue.popleft()
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if self.events is not None:
                    self._record_removed(block.block_hash)
                for listener in self.on_evict:
                    listener(block.block_hash)
            block.block_hash = None
        block.ref_count = 1
        return block

    def _record_removed(self, block_hash: bytes) -> None:
        """Evictions one after another make one BlockRemoved."""
        if self.events and isinstance(self.events[-1], BlockRemoved):
            self.events[-1].block_hashes.append(block_hash)
        else:
            self.events.append(BlockRemoved(block_hashes=[block_hash], medium=MEDIUM_GPU))

    def check_no_leaks(self) -> None:
        """Raise when any block is still referenced (used by tests and the engine's idle check)."""
        held = [b.block_id for b in self.blocks if b.ref_count != 0]
        if held or self.num_free_blocks != self.num_blocks:
            raise AssertionError(
                f"blocks still referenced: {held[:20]} ({len(held)} in all); "
                f"free queue holds {self.num_free_blocks} of {self.num_blocks}"
            )
