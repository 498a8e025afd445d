"""A client looping on faulty requests (issue 42, items 10 and 11: four loops of float-
overflow parameters doubled a victim's time to first token) gets its refusals late once
past its allowance, and only it: the allowance's token bucket on a clock of our own, then a
real server (uvicorn in a thread, the built-in model) with three clients on their own
loopback addresses."""

import asyncio
import time

import httpx
import pytest
from pagefleet_serve.server.refusals import MAX_CLIENTS, MAX_DELAY_S, RefusalGuard

from tests.server.server_harness import ThreadServer

DELAY = 5.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_allowance_is_two_seconds_of_the_rate_and_refills_at_it():
    clock = Clock()
    guard = RefusalGuard(rate=2, delay=DELAY, clock=clock)
    assert [guard.record("a") for _ in range(5)] == [0, 0, 0, 0, DELAY]
    assert guard.record("b") == 0  # another client's allowance is its own
    clock.now += 1.0  # the refusal past the allowance was owed: two refusals' worth back
    assert [guard.record("a") for _ in range(2)] == [0, DELAY]
    clock.now += 60  # refilled, and no more than full
    assert [guard.record("a") for _ in range(5)] == [0, 0, 0, 0, DELAY]


def test_a_refusal_costs_its_work_and_past_the_allowance_the_debt_sets_the_wait():
    """At 20 a second and 2.5 ms a refusal: 50 ms of checks cost 20 refusals; the client
    waits until its debt would refill, at least the delay, at most MAX_DELAY_S."""
    clock = Clock()
    guard = RefusalGuard(rate=20, delay=0.5, clock=clock)
    assert [guard.record("a", work_s=0.05) for _ in range(2)] == [0, 0]  # 40: the allowance
    assert guard.record("a", work_s=0.05) == pytest.approx(1.0)  # 20 owed: a second
    assert guard.record("a", work_s=0.05) == pytest.approx(2.0)
    clock.now += 2.0  # the debt refilled
    assert guard.record("a") == 0.5  # one owed: the delay, not 0.05 s
    assert guard.record("b", work_s=0.0001) == 0  # cheap work costs one refusal
    assert max(guard.record("a", work_s=10) for _ in range(100)) == MAX_DELAY_S


def test_one_refusal_costs_at_most_the_whole_allowance():
    clock = Clock()
    guard = RefusalGuard(rate=2, delay=DELAY, clock=clock)
    assert guard.record("a", work_s=60) == 0  # an honest client's one slow mistake
    assert guard.record("a") == DELAY  # the allowance is spent


def test_a_zero_delay_turns_it_off_and_bad_settings_are_refused():
    guard = RefusalGuard(rate=1, delay=0)
    assert all(guard.record("a") == 0 for _ in range(100))
    with pytest.raises(ValueError, match="rate and unit must be > 0"):
        RefusalGuard(rate=0, delay=1)
    with pytest.raises(ValueError, match="rate and unit must be > 0"):
        RefusalGuard(rate=1, delay=1, unit_s=0)
    with pytest.raises(ValueError, match="delay >= 0"):
        RefusalGuard(rate=1, delay=-1)


def test_clients_whose_allowance_has_refilled_are_forgotten_past_the_cap():
    clock = Clock()
    guard = RefusalGuard(rate=1, delay=DELAY, clock=clock)
    for n in range(MAX_CLIENTS):
        guard.record(f"old-{n}")
    clock.now += 10  # every old client's allowance refilled
    assert guard.record("flooding") == 0
    assert len(guard) == 1  # the old ones went, the new one stays
    assert [guard.record("flooding") for _ in range(2)] == [0, DELAY]


@pytest.fixture(scope="module")
def server():
    # An allowance of one refusal: a client's second refusal within two seconds waits.
    running = ThreadServer(
        {"refusals_per_second": 0.5, "refusal_delay": DELAY},
        max_num_seqs=2,
        max_model_len=256,
        kv_cache_memory_bytes=32 << 20,
    )
    yield running
    running.stop()


def client(server, address: str) -> httpx.AsyncClient:
    transport = httpx.AsyncHTTPTransport(local_address=address)
    return httpx.AsyncClient(base_url=server.base_url, transport=transport, timeout=120)


def test_a_client_past_its_allowance_waits_for_its_refusals_alone(server):
    """The flooding client's second refusal is answered DELAY s late; while it waits,
    another client's refusal and the flooding client's own valid request are answered."""
    bad = {"prompt": "hi", "max_tokens": 2, "repetition_penalty": 1e300}
    good = {"prompt": "hi", "max_tokens": 2}

    async def scenario() -> None:
        async with (
            client(server, "127.0.0.3") as flooding,
            client(server, "127.0.0.3") as same_client,
            client(server, "127.0.0.4") as other,
        ):
            first = await flooding.post("/v1/completions", json=bad)
            assert first.status_code == 400, first.text
            assert "repetition_penalty" in first.json()["error"]["message"]
            started = time.monotonic()
            late = asyncio.create_task(flooding.post("/v1/completions", json=bad))
            refused = await other.post("/v1/completions", json=bad)
            assert refused.status_code == 400 and not late.done()
            accepted = await same_client.post("/v1/completions", json=good)
            assert accepted.status_code == 200 and not late.done(), accepted.text
            response = await late
            assert response.status_code == 400
            assert response.json()["error"]["param"] == first.json()["error"]["param"]
            assert time.monotonic() - started >= DELAY

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def costly_server():
    # An allowance of four refusals, 10 ms of checks: one expensive refusal spends it.
    running = ThreadServer(
        {"refusals_per_second": 2, "refusal_delay": 1.0},
        max_num_seqs=2,
        max_model_len=256,
        kv_cache_memory_bytes=32 << 20,
    )
    yield running
    running.stop()


def test_an_expensive_refusal_spends_the_allowance_of_many(costly_server):
    """12,000 chat messages (about as many as the body-cost bound lets through) are
    validated before their count is refused (tens of ms or more: many refusals' worth):
    the client's next cheap refusal waits, another client's does not. Charged one refusal
    each, the client would have three left."""
    many = {"messages": [{"role": "user", "content": "hi"}] * 12_000, "max_tokens": 2}
    bad = {"prompt": "hi", "max_tokens": 2, "repetition_penalty": 1e300}

    async def scenario() -> None:
        async with (
            client(costly_server, "127.0.0.5") as costly,
            client(costly_server, "127.0.0.6") as other,
        ):
            expensive = await costly.post("/v1/chat/completions", json=many)
            assert expensive.status_code == 400, expensive.text
            assert expensive.json()["error"]["param"] == "messages"
            started = time.monotonic()
            late = asyncio.create_task(costly.post("/v1/completions", json=bad))
            refused = await other.post("/v1/completions", json=bad)
            assert refused.status_code == 400 and not late.done()
            assert (await late).status_code == 400
            assert time.monotonic() - started >= 1.0

    asyncio.run(scenario())
