"""Prefix caching for a hybrid model: its recurrent layers' state at block boundaries.

A cached KV block lets a new prompt skip its tokens only if the recurrent layers' state
after them is known too: it is the whole past of the sequence, and no block holds it.
So a prompt's state is kept (copied into a checkpoint slot, beside the running sequences'
slots) at the block boundaries its prefill reaches: the end of each chunk that ends on a
boundary, and the deepest boundary a repeat of the prompt can resume from (before its last
token: a step needs its logits), which the scheduler makes a chunk end at
(`boundary`). A checkpoint is keyed by the hash of the block it ends, so a prompt that
extends a cached one (a conversation's next turn) finds it too.

A prompt then resumes from its deepest cached block that has a checkpoint: the KV blocks
before it are reused, the checkpoint is copied into its slot, and its prefill continues
from there. The checkpoints are bounded (`num_checkpoints` slots, least recently used
evicted first), and one goes with its block when the block leaves the prefix cache
(`forget`, which the block manager calls).
"""

import collections

from pagefleet_serve.engine.block_manager import BlockManager
from pagefleet_serve.engine.sequence import Sequence
from pagefleet_serve.engine.state_slots import StateSlots
from pagefleet_serve.messages import StateStats


class StateCheckpoints:
    def __init__(
        self, slots: StateSlots, first_slot: int, num_checkpoints: int, block_size: int
    ) -> None:
        """Checkpoint slots `first_slot` .. `first_slot + num_checkpoints - 1` of the
        state tensors (the running sequences' are those before)."""
        self.slots = slots
        self.block_size = block_size
        self.num_checkpoints = num_checkpoints
        self._free = list(range(first_slot + num_checkpoints - 1, first_slot - 1, -1))
        self._saved: collections.OrderedDict[bytes, int] = collections.OrderedDict()

    @property
    def num_saved(self) -> int:
        return len(self._saved)

    def boundary(self, seq: Sequence) -> int:
        """The deepest block boundary of the prompt a repeat of it can resume from."""
        return (seq.num_prompt_tokens - 1) // self.block_size * self.block_size

    def resumable(self, seq: Sequence, num_cached_blocks: int) -> int:
        """How many of the sequence's first `num_cached_blocks` cached blocks it can skip:
        up to the deepest that ends at a checkpoint (0: it starts from zeros)."""
        for count in range(num_cached_blocks, 0, -1):
            if seq.block_hashes[count - 1] in self._saved:
                return count
        return 0

    def restore(self, seq: Sequence, num_blocks: int) -> None:
        """`seq` was admitted past its first `num_blocks` blocks: the state there is
        copied into its slot before its step."""
        block_hash = seq.block_hashes[num_blocks - 1]
        self._saved.move_to_end(block_hash)
        self.slots.copy(self._saved[block_hash], seq.state_slot)

    def forget(self, block_hash: bytes) -> None:
        """The block of `block_hash` left the prefix cache: its checkpoint's slot is free."""
        slot = self._saved.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)

    def save(self, seq: Sequence) -> None:
        """After a step: keep the sequence's state if its prompt's prefill just ended a
        chunk on a block boundary (evicting the least recently used checkpoint if none
        is free)."""
        computed = seq.num_computed_tokens
        if computed % self.block_size or not 0 < computed <= seq.num_prompt_tokens:
            return
        block_hash = seq.block_hashes[computed // self.block_size - 1]
        if block_hash in self._saved:
            self._saved.move_to_end(block_hash)
            return
        if not self._free:
            self._free.append(self._saved.popitem(last=False)[1])
        slot = self._saved[block_hash] = self._free.pop()
        self.slots.copy(seq.state_slot, slot)


def state_cache(
    num_slots: int, num_checkpoints: int, block_manager: BlockManager
) -> tuple[StateSlots | None, StateCheckpoints | None]:
    """A hybrid model's state slots, and their checkpoints when the prefix cache is on;
    (None, None) for a model that keeps no per-sequence state (`num_slots` 0)."""
    if not num_slots:
        return None, None
    slots = StateSlots(num_slots)
    if not block_manager.enable_prefix_caching:
        return slots, None
    checkpoints = StateCheckpoints(slots, num_slots, num_checkpoints, block_manager.block_size)
    block_manager.on_evict.append(checkpoints.forget)
    return slots, checkpoints


def state_stats(
    slots: StateSlots | None, checkpoints: StateCheckpoints | None, bytes_per_sequence: int
) -> StateStats | None:
    """What /metrics shows of the state cache; None for a model without one."""
    if slots is None:
        return None
    return StateStats(
        num_slots=slots.num_slots,
        num_used_slots=slots.num_used,
        num_checkpoints=0 if checkpoints is None else checkpoints.num_checkpoints,
        num_saved_checkpoints=0 if checkpoints is None else checkpoints.num_saved,
        bytes_per_sequence=bytes_per_sequence,
    )
