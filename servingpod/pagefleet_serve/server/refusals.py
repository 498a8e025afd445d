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

A refusal is charged by the work it cost: one refusal, or more for one whose checks ran
long (the seconds from the body's end to the answer, in units of `unit_s`; at most the
whole allowance, so that one refusal alone never waits): 20,000 chat messages validated
before their count was refused cost the API process 0.1-0.25 s, a hundred cheap
refusals' worth. A 429 (the pod is busy, not the request wrong) counts as one. Past the
allowance a client runs into debt, and its refusal waits the longer of `delay` and the
time the allowance takes to refill the debt (at most MAX_DELAY_S): a client looping on
refusals, over however many connections, then gets `rate * unit_s` of the API process's
time a second (5% at the defaults), or, where each refusal costs more than the whole
allowance, one refusal every two seconds.
"""

import time
from collections.abc import Callable

# Clients remembered at most; past it, those whose allowance has refilled are forgotten.
MAX_CLIENTS = 10_000
# The work one refusal is worth: at 20 a second, 5% of the API process's time.
REFUSAL_UNIT_S = 0.0025
# The longest a refusal waits; a client's debt stops growing at what refills in it.
MAX_DELAY_S = 30.0
# The ASGI scope's key for when a request's body was read whole (its checks start).
BODY_READ_AT = "pagefleet.body_read_at"


def mark_body_read(scope: dict) -> None:
    scope[BODY_READ_AT] = time.monotonic()


def work_seconds(scope: dict) -> float:
    """Seconds since the request's body was read (0 for one refused before or without it)."""
    read_at = scope.get(BODY_READ_AT)
    return 0.0 if read_at is None else max(0.0, time.monotonic() - read_at)


class RefusalGuard:
    def __init__(
        self,
        rate: float,
        delay: float,
        clock: Callable[[], float] = time.monotonic,
        unit_s: float = REFUSAL_UNIT_S,
    ) -> None:
        if rate <= 0 or delay < 0 or unit_s <= 0:
            raise ValueError(
                f"refusals: rate and unit must be > 0 and delay >= 0, got {rate}, {unit_s}, {delay}"
            )
        self.rate = rate
        self.delay = delay
        self.unit_s = unit_s
        self.capacity = 2 * rate
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (allowance, at)

    def __len__(self) -> int:
        """The clients remembered."""
        return len(self._buckets)

    def record(self, client: str, work_s: float = 0.0) -> float:
        """Charge `client` one refusal that cost `work_s` seconds of checks; the seconds
        its answer waits (0 within the client's allowance, or when delays are off)."""
        if not self.delay:
            return 0.0
        now = self._clock()
        allowance, at = self._buckets.get(client, (self.capacity, now))
        allowance = min(self.capacity, allowance + (now - at) * self.rate)
        cost = min(self.capacity, max(1.0, work_s / self.unit_s))
        if len(self._buckets) >= MAX_CLIENTS:
            self._forget_refilled(now)
        if allowance >= cost:
            self._buckets[client] = (allowance - cost, now)
            return 0.0
        allowance = max(allowance - cost, -MAX_DELAY_S * self.rate)
        self._buckets[client] = (allowance, now)
        return min(MAX_DELAY_S, max(self.delay, -allowance / self.rate))

    def _forget_refilled(self, now: float) -> None:
        self._buckets = {
            client: (allowance, at)
            for client, (allowance, at) in self._buckets.items()
            if allowance + (now - at) * self.rate < self.capacity
        }
