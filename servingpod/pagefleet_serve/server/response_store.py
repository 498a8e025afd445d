"""The recent responses of /v1/responses that a later request may continue by
`previous_response_id`, read back (GET /v1/responses/{id}) or delete: per process, bounded
in entries (least recently used first out) and in age (an entry older than `max_age_s` is
gone, whether used or not).

Each entry holds a response as it was answered and its whole conversation (its input
items, those of the responses it continued, and its output), so that continuing one needs
only that one entry: evicting an older response never breaks a later one. An entry is at
most a context's worth of prompt plus its output (twice over: as chat messages and as the
response's JSON), so the store holds about `max_entries` contexts of text at most.
"""

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class _Entry(Generic[T]):
    stored_at: float
    value: T


class ResponseStore(Generic[T]):
    def __init__(
        self, max_entries: int, max_age_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """`max_entries` 0: the store is off (nothing is kept)."""
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, got {max_entries}")
        if max_age_s <= 0:
            raise ValueError(f"max_age_s must be > 0, got {max_age_s}")
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        self._clock = clock
        self._entries: OrderedDict[str, _Entry[T]] = OrderedDict()  # least recently used first
        # Requests are validated in the frontend thread and finish on the event loop.
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, value: T) -> None:
        """Keep `value` as the most recently used entry, evicting what is over the bounds."""
        if not self.enabled:
            return
        with self._lock:
            now = self._clock()
            self._entries[response_id] = _Entry(now, value)
            self._entries.move_to_end(response_id)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
            self._drop_expired_lru(now)

    def get(self, response_id: str) -> T | None:
        """The entry (now the most recently used), None if unknown, evicted or expired."""
        with self._lock:
            now = self._clock()
            entry = self._entries.get(response_id)
            if entry is None:
                return None
            if now - entry.stored_at > self.max_age_s:
                del self._entries[response_id]
                return None
            self._entries.move_to_end(response_id)
            self._drop_expired_lru(now)
            return entry.value

    def delete(self, response_id: str) -> bool:
        """Forget an entry; False if it was unknown, evicted or expired."""
        with self._lock:
            entry = self._entries.pop(response_id, None)
            return entry is not None and self._clock() - entry.stored_at <= self.max_age_s

    def ids(self) -> list[str]:
        """The ids held, least recently used first."""
        with self._lock:
            return list(self._entries)

    def _drop_expired_lru(self, now: float) -> None:
        # Expired entries at the cold end go at once; one used since (further along) goes
        # when it is next asked for, and the size bound holds meanwhile.
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if now - oldest.stored_at <= self.max_age_s:
                break
            self._entries.popitem(last=False)
