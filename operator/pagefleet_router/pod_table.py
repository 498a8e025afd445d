"""key -> the pod that most recently served it, bounded by evicting the least recently
recorded key: the router's memory of where a prompt's blocks (`prefix.PrefixTable`) and a
stored response (`previous_response_id`) live."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class PodTable(Generic[K]):
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"table capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._pods: OrderedDict[K, str] = OrderedDict()

    def get(self, key: K) -> str | None:
        return self._pods.get(key)

    def record(self, keys: Iterable[K], pod: str) -> None:
        for key in keys:
            self._pods[key] = pod
            self._pods.move_to_end(key)
        while len(self._pods) > self.capacity:
            self._pods.popitem(last=False)

    def forget(self, key: K) -> None:
        self._pods.pop(key, None)

    def forget_pod(self, pod: str) -> None:
        """Drop a vanished pod's entries: its cache and its store went with it."""
        for key in [k for k, p in self._pods.items() if p == pod]:
            del self._pods[key]

    def __len__(self) -> int:
        return len(self._pods)
