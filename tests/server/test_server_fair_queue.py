"""The frontend thread's fair queue on its own: clients take turns, one job each, first in
first out within a client; errors reach their caller; a job whose caller left is skipped;
shutting down cancels what waits."""

import threading

import pytest
from pagefleet_serve.server.fair_queue import FairExecutor


def hold(executor: FairExecutor, client: str) -> tuple[threading.Event, object]:
    """A job of `client` that holds the thread (running, once this returns) until the
    event is set."""
    started, release = threading.Event(), threading.Event()
    future = executor.submit(client, lambda: started.set() or release.wait())
    assert started.wait(10)
    return release, future


def test_clients_take_turns_one_job_each_in_their_own_order():
    executor = FairExecutor("test-frontend")
    ran: list[str] = []
    release, first = hold(executor, "a")  # the thread is busy while the rest queue
    futures = [executor.submit("a", lambda i=i: ran.append(f"a{i}")) for i in range(4)]
    futures += [executor.submit("b", lambda i=i: ran.append(f"b{i}")) for i in range(2)]
    futures.append(executor.submit("c", lambda: ran.append("c0")))
    assert executor.queued() == {"a": 4, "b": 2, "c": 1}
    release.set()
    for future in [first, *futures]:
        future.result(timeout=10)
    assert ran == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]
    executor.shutdown()


def test_an_error_reaches_its_caller_and_a_cancelled_job_never_runs():
    executor = FairExecutor("test-frontend")
    ran: list[str] = []
    release, _ = hold(executor, "a")
    failing = executor.submit("a", lambda: 1 / 0)
    skipped = executor.submit("b", lambda: ran.append("skipped"))
    assert skipped.cancel()  # its caller stopped waiting
    after = executor.submit("b", lambda: ran.append("after") or "done")
    release.set()
    with pytest.raises(ZeroDivisionError):
        failing.result(timeout=10)
    assert after.result(timeout=10) == "done" and ran == ["after"]
    executor.shutdown()


def test_shutdown_cancels_what_waits_and_refuses_more():
    executor = FairExecutor("test-frontend")
    release, running = hold(executor, "a")
    waiting = executor.submit("b", lambda: None)
    executor.shutdown()
    assert waiting.cancelled()
    release.set()
    assert running.result(timeout=10) is True
    with pytest.raises(RuntimeError, match="shut down"):
        executor.submit("a", lambda: None)
