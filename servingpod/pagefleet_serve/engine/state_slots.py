"""The state slots of a hybrid model: rows of its recurrent layers' state tensors (see
`model.layers.state`), one per running sequence, allocated from the KV budget beside the
paged blocks (`startup`).

A sequence takes its slot when it is admitted, and a request with n > 1 takes its
siblings' too, so that its fork after the prompt never waits; the fork copies the
prompt's state into each sibling's slot. A sequence gives its slots back when it finishes,
is aborted or is preempted (its recompute starts from zeros). When no slot is free, a
waiting request waits, as for seats and blocks.

The copies between slots (a fork's, and the prefix checkpoints' of `state_checkpoints`)
are not made here: they are handed to the next step (`SchedulerOutput.state_copies`),
whose runner makes them in order before its forward pass.
"""

from pagefleet_serve.engine.sequence import Sequence


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: 0 first
        self._copies: list[tuple[int, int]] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def can_hold(self, seq: Sequence) -> bool:
        """Whether `seq` and the siblings it forks into find free slots."""
        return len(self._free) >= seq.num_samples

    def acquire(self, seq: Sequence) -> None:
        """`seq` is admitted: its slot, and those its siblings take at the fork."""
        seq.state_slot = self._free.pop()
        seq.sibling_state_slots = [self._free.pop() for _ in seq.sibling_generators]

    def release(self, seq: Sequence) -> None:
        if seq.state_slot is not None:
            self._free.append(seq.state_slot)
        self._free.extend(seq.sibling_state_slots)
        seq.state_slot, seq.sibling_state_slots = None, []

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` forks from `parent` after its prompt: it takes a slot the parent holds
        for it, and the parent's state is copied there before the next step."""
        child.state_slot = parent.sibling_state_slots.pop(0)
        self.copy(parent.state_slot, child.state_slot)

    def copy(self, src: int, dst: int) -> None:
        """Copy slot `src`'s state into `dst` before the next step runs."""
        self._copies.append((src, dst))

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self._copies = self._copies, []
        return copies
