"""A client whose requests keep being refused waits for its refusals.

A refusal (a 4xx answer) costs the pod the parsing and the checks that found the fault, and
a client that sends nothing but faulty requests in a loop has them answered as fast as the
pod can: hundreds a second, whose work takes the API process's CPU from every other
client's requests (issue 42: four such loops sending float-overflow parameters doubled a
victim's time to first token). Each client (the peer's address, or X-Forwarded-For's from
a trusted proxy such as the router) has an allowance of refusals: a token bucket refilled
at `rate` a second that holds up to two seconds of it. A refusal beyond the allowance is
answered `delay` seconds late, which slows a client that waits for its answers to one
refusal per delay per connection (and the connections one client may hold are bounded by
--max-connections-per-client). An accepted request is never delayed, nor is another
client's refusal.
"""

import time
from collections.abc import Callable

# Clients remembered at most; past it, those whose allowance has refilled are forgotten.
MAX_CLIENTS = 10_000


class RefusalGuard:
    def __init__(
        self, rate: float, delay: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if rate <= 0 or delay < 0:
            raise ValueError(f"refusals: rate must be > 0 and delay >= 0, got {rate}, {delay}")
        self.rate = rate
        self.delay = delay
        self.capacity = 2 * rate
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (allowance, at)

    def __len__(self) -> int:
        """The clients remembered."""
        return len(self._buckets)

    def record(self, client: str) -> float:
        """Count one refusal of `client`; the seconds its answer waits (0 within the
        client's allowance, or when delays are off)."""
        if not self.delay:
            return 0.0
        now = self._clock()
        allowance, at = self._buckets.get(client, (self.capacity, now))
        allowance = min(self.capacity, allowance + (now - at) * self.rate)
        if len(self._buckets) >= MAX_CLIENTS:
            self._forget_refilled(now)
        if allowance >= 1:
            self._buckets[client] = (allowance - 1, now)
            return 0.0
        self._buckets[client] = (allowance, now)
        return self.delay

    def _forget_refilled(self, now: float) -> None:
        self._buckets = {
            client: (allowance, at)
            for client, (allowance, at) in self._buckets.items()
            if allowance + (now - at) * self.rate < self.capacity
        }
