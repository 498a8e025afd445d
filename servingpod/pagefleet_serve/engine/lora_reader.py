"""Reads of LoRA adapter files off the step loop, each in a thread of its own with a time
limit.

A read can block for good: a hung NFS or PVC mount, a stalled download. With one reader
thread for every read, one such read wedged every later load and read-back, and then the
pod (their requests filled --limit-concurrency); and since an executor's threads are
joined at exit, the pod ignored SIGTERM until the read returned. Here each read has its
own daemon thread, fails when its time is up (its requests or its load fail; the next
read starts at once), and never holds the process at exit. A thread still blocked past
its time cannot be stopped, only counted: past `max_reads` threads, no read starts.
"""

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from pagefleet_serve.model.lora import LoRAError

T = TypeVar("T")
# Reads in progress at once, those past their time included.
MAX_READS = 8


class LoRAReadsBusy(LoRAError):
    status = 503


class AdapterReader:
    def __init__(self, timeout_s: float, max_reads: int = MAX_READS) -> None:
        self.timeout_s = timeout_s
        self.max_reads = max_reads
        self._lock = threading.Lock()
        self._threads = 0  # reading now, past their time or not

    def start(self, read: Callable[[], T], what: str) -> Future[T]:
        """`read()` in a thread of its own: its future has the result, or the read's
        error, or a LoRAError once `timeout_s` have gone by. LoRAReadsBusy (nothing
        started) with `max_reads` reads in progress."""
        with self._lock:
            if self._threads >= self.max_reads:
                raise LoRAReadsBusy(
                    f"{what}: {self._threads} adapter reads are in progress, the most this "
                    "server runs at once (some may be blocked on their storage); retry later"
                )
            self._threads += 1
        future: Future[T] = Future()

        def settle(outcome: Callable[[Any], None], value: Any) -> None:
            with self._lock:
                if not future.done():
                    outcome(value)

        def run() -> None:
            try:
                result = read()
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                settle(future.set_exception, exc)
            else:
                settle(future.set_result, result)
            finally:
                with self._lock:
                    self._threads -= 1

        expired = LoRAError(
            f"{what}: its files were not read within {self.timeout_s:g} s "
            "(--lora-read-timeout); is its storage reachable?"
        )
        timer = threading.Timer(self.timeout_s, settle, (future.set_exception, expired))
        timer.daemon = True

        def stop_timer(_: Future) -> None:
            timer.cancel()
            # The timer's function and arguments hold the future, whose callbacks hold the
            # timer: a cycle that would keep the adapter's megabytes resident until the
            # garbage collector ran. Cancelled, the timer calls nothing: let go of them.
            timer.function, timer.args = _nothing, ()

        future.add_done_callback(stop_timer)
        threading.Thread(target=run, name="lora-reader", daemon=True).start()
        timer.start()
        return future


def _nothing(*_: Any) -> None:
    """What a cancelled timer would call (never)."""
