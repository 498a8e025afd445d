"""Which LoRA adapters' weights are in host memory: at most `capacity` of them (vLLM's
--max-cpu-loras; None: every adapter served), least recently used first when one must go.

The engine serves any number of adapters by name and path; only these are read. An
adapter a request names that is not here is read again from its path: `reserve` first
makes it a place (the read happens off the step loop, and its place counts meanwhile), by
dropping the least recently used adapter that no request uses, one in no device slot if
there is one (else one in an idle slot, which that slot then forgets: what the device
holds stays in host memory). When every adapter here is used, `reserve` fails (False) and
changes nothing: the request waits until one is free.
"""

from collections import OrderedDict
from collections.abc import Set

from pagefleet_serve.engine.lora_slots import LoRASlots
from pagefleet_serve.model.lora import LoRAAdapter


class LoRAHostCache:
    def __init__(self, capacity: int | None, slots: LoRASlots) -> None:
        self.capacity = capacity
        self.slots = slots
        # lora_id -> its weights (None: a place reserved, being read), least recent first.
        self._adapters: OrderedDict[int, LoRAAdapter | None] = OrderedDict()

    def __len__(self) -> int:
        """Adapters in host memory, counting those being read into it."""
        return len(self._adapters)

    def __contains__(self, lora_id: int) -> bool:
        """Whether `lora_id`'s weights are here (read, not only reserved)."""
        return self._adapters.get(lora_id) is not None

    def is_reserved(self, lora_id: int) -> bool:
        return lora_id in self._adapters

    def lora_ids(self) -> list[int]:
        """The adapters whose weights are here (read, not only reserved), least recent
        first."""
        return [lora_id for lora_id, adapter in self._adapters.items() if adapter is not None]

    def use(self, lora_id: int) -> LoRAAdapter:
        """The adapter's weights, now the most recently used. KeyError if not here."""
        adapter = self._adapters[lora_id]
        if adapter is None:
            raise KeyError(lora_id)
        self._adapters.move_to_end(lora_id)
        return adapter

    def reserve(self, lora_id: int, in_use: Set[int]) -> bool:
        """A place for `lora_id` (held until `put` or `drop`), dropping an adapter no
        request uses (`in_use`: the lora_ids of requests) if the cache is full; False,
        changing nothing, when every one is used."""
        if lora_id in self._adapters:
            return True
        if self.capacity is not None and len(self._adapters) >= self.capacity:
            unused = [other for other in self._adapters if other not in in_use]
            if not unused:
                return False
            # The first one in no device slot, in LRU order (min keeps the first of equals).
            self.drop(min(unused, key=lambda other: other in self.slots.slot_of))
        self._adapters[lora_id] = None
        return True

    def put(self, adapter: LoRAAdapter) -> None:
        """Fill the adapter's reserved place; an adapter whose place has gone meanwhile
        (unloaded, or dropped while no request used it) is left out."""
        if self.is_reserved(adapter.lora_id):
            self._adapters[adapter.lora_id] = adapter
            self._adapters.move_to_end(adapter.lora_id)

    def drop(self, lora_id: int) -> None:
        """Out of host memory, and out of its device slot (which no sequence may read)."""
        self._adapters.pop(lora_id, None)
        self.slots.forget(lora_id)
