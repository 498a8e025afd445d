"""Which LoRA adapter each of the device's `max_loras` slots holds: ref-counted by the
running sequences that read it, least recently used first when one must be replaced.

An adapter stays in its slot after its last sequence finishes, so that its next request
needs no copy; a slot is reused only when no running sequence reads it, empty slots first,
then the one released longest ago. `acquire` fails (None) and changes nothing when every
slot is read by some other adapter's running sequences: the scheduler then leaves that
request waiting and admits others. What must be copied into a slot before the next step
is handed out by `take_loads`.
"""

from collections import OrderedDict


class LoRASlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.slot_of: dict[int, int] = {}  # lora_id -> the slot holding it
        self.lora_in: list[int | None] = [None] * num_slots
        self.ref_counts = [0] * num_slots
        # Slots no running sequence reads, least recently used first (empty ones first).
        self._idle: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_slots))
        self._loads: list[tuple[int, int]] = []  # (slot, lora_id) to copy before the step

    def can_acquire(self, lora_id: int) -> bool:
        return lora_id in self.slot_of or bool(self._idle)

    def acquire(self, lora_id: int) -> int | None:
        """The slot a new running sequence of `lora_id` reads (loading it into the least
        recently used idle slot if it is not resident); None, changing nothing, if none
        is free."""
        slot = self.slot_of.get(lora_id)
        if slot is None:
            if not self._idle:
                return None
            slot = next(iter(self._idle))
            evicted = self.lora_in[slot]
            if evicted is not None:
                del self.slot_of[evicted]
            self.lora_in[slot], self.slot_of[lora_id] = lora_id, slot
            self._loads.append((slot, lora_id))
        self._idle.pop(slot, None)
        self.ref_counts[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        """A sequence that read `slot` stopped running (finished or preempted)."""
        self.ref_counts[slot] -= 1
        if self.ref_counts[slot] == 0:
            self._idle[slot] = None  # the most recently used idle slot

    def forget(self, lora_id: int) -> None:
        """An unloaded adapter (no sequence reads it): its slot becomes the first to reuse."""
        slot = self.slot_of.pop(lora_id, None)
        if slot is None:
            return
        if self.ref_counts[slot]:
            raise ValueError(f"adapter {lora_id} is read by {self.ref_counts[slot]} sequences")
        self.lora_in[slot] = None
        self._idle.move_to_end(slot, last=False)
        self._loads = [load for load in self._loads if load[1] != lora_id]

    def take_loads(self) -> list[tuple[int, int]]:
        """The (slot, lora_id) copies the next step needs first, handed out once."""
        loads, self._loads = self._loads, []
        return loads

    def idle_slots(self) -> list[int]:
        return list(self._idle)
