"""Fairness between clients in the frontend thread.

Request bodies become token ids in one thread (a fast tokenizer must not be used by two
threads at once), so a client that sends many expensive bodies at once would make every
other client wait behind all of them. `FairExecutor` keeps one queue per client and runs
them in turn, one job from each client that has work: a victim waits behind at most one job
of each other client, however many that client queued. The client is the peer's address,
the key the compile queue's per-client budget and the engine's scheduler use too;
`ClientMiddleware` records it for the request being handled (`current_client`), and a job
in the frontend thread runs as its client, so that the endpoints need not pass it.
"""

import collections
import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

_CLIENT: contextvars.ContextVar[str] = contextvars.ContextVar("pagefleet_client", default="")


def current_client() -> str:
    """The address of the client whose request is being handled ("" outside one)."""
    return _CLIENT.get()


class ClientMiddleware:
    """ASGI middleware: each HTTP request's handlers see its client's address."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            client = scope.get("client")
            _CLIENT.set(client[0] if client else "")
        await self.app(scope, receive, send)


class FairExecutor:
    """One worker thread running submitted callables, round-robin over their clients (first
    in, first out within one client)."""

    def __init__(self, name: str) -> None:
        self._lock = threading.Condition()
        # client -> its waiting jobs; the order of the keys is the order of turns
        self._queues: collections.OrderedDict[str, collections.deque] = collections.OrderedDict()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, client: str, work: Callable[[], Any]) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the frontend thread is shut down")
            self._queues.setdefault(client, collections.deque()).append((work, future))
            self._lock.notify()
        return future

    def queued(self) -> dict[str, int]:
        """Jobs waiting, per client (not the one running)."""
        with self._lock:
            return {client: len(jobs) for client, jobs in self._queues.items()}

    def shutdown(self) -> None:
        """Cancel what waits; the job running finishes; the thread ends after it."""
        with self._lock:
            self._closed = True
            for jobs in self._queues.values():
                for _, future in jobs:
                    future.cancel()
            self._queues.clear()
            self._lock.notify()

    def _next(self) -> tuple[str, Callable[[], Any], Future] | None:
        with self._lock:
            while not self._queues and not self._closed:
                self._lock.wait()
            if self._closed:
                return None
            client, jobs = next(iter(self._queues.items()))
            work, future = jobs.popleft()
            del self._queues[client]
            if jobs:  # its next job waits for every other client's turn
                self._queues[client] = jobs
            return client, work, future

    def _run(self) -> None:
        while (job := self._next()) is not None:
            client, work, future = job
            if not future.set_running_or_notify_cancel():
                continue  # its caller stopped waiting
            _CLIENT.set(client)  # the job sees its client, as its endpoint did
            try:
                result = work()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, which re-raises it
                future.set_exception(exc)
            else:
                future.set_result(result)
