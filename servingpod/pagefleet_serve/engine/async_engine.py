"""Drives an LLMEngine from one background thread for asyncio callers (the HTTP server).

Callers never touch engine state: `generate()` validates on the caller's side, then hands
the request to the step thread through a queue and reads its outputs from a per-request
mailbox (an asyncio.Queue filled with `call_soon_threadsafe`). Leaving the iterator early
(a disconnected client) aborts the request; its blocks are freed before the next step.

The step thread never ends silently: each of its duties (taking requests, stepping,
publishing stats, delivering outputs) is guarded on its own, and should the loop itself
break, the reason is recorded, every waiting caller is told, and `/health` reports it.
Only `EngineFault`s and unexpected step errors count toward declaring the engine dead; a
request the engine isolated as the cause of a failure fails alone and counts for nothing.
"""

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagefleet_serve.engine.llm_engine import EngineFault, EngineStats, LLMEngine, Request
from pagefleet_serve.outputs import RequestOutput
from pagefleet_serve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


@dataclass
class _Mailbox:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    # A step that has not returned within this bound means the engine has hung.
    STEP_TIMEOUT_S = 120.0
    MAX_CONSECUTIVE_FAILURES = 3

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._mailboxes: dict[str, _Mailbox] = {}
        self._stop = threading.Event()
        self._dead: str | None = None
        self._step_started: float | None = None
        self.last_step_time = time.monotonic()
        self.stats: EngineStats = engine.stats()
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)
        self._thread.start()

    # -- caller side ----------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request, step by step (deltas); raises ValueError for bad input."""
        if self._dead:
            raise EngineDeadError(self._dead)
        async for output in self.run(self.engine.make_request(request_id, prompt, params)):
            yield output

    async def run(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Outputs of a request validated by `make_request`, step by step (deltas)."""
        request_id = request.request_id
        if self._dead:
            raise EngineDeadError(self._dead)
        mailbox = _Mailbox(asyncio.get_running_loop(), asyncio.Queue())
        if request_id in self._mailboxes:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self._mailboxes[request_id] = mailbox
        if self._dead:  # died since the check above: nobody would answer this mailbox
            self._mailboxes.pop(request_id, None)
            raise EngineDeadError(self._dead)
        self._send(("add", request))
        finished = False
        try:
            while not finished:
                item = await mailbox.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)
            self._mailboxes.pop(request_id, None)

    def make_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> Request:
        return self.engine.make_request(request_id, prompt, params)

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    @property
    def default_max_num_queued(self) -> int:
        """As many requests as the KV pool has blocks (each needs one at least, so more
        could never all run at once), and no fewer than one full batch."""
        return max(self.engine.config.max_num_seqs, self.engine.block_manager.num_blocks)

    @property
    def is_healthy(self) -> bool:
        if self._dead or not self._thread.is_alive():
            return False
        started = self._step_started
        return started is None or time.monotonic() - started < self.STEP_TIMEOUT_S

    @property
    def dead_reason(self) -> str | None:
        if self._dead is None and not self._thread.is_alive() and not self._stop.is_set():
            return "the engine step thread has exited"
        return self._dead

    def shutdown(self) -> None:
        self._stop.set()
        self._wakeup.set()
        self._thread.join(timeout=10)

    def _send(self, message: tuple) -> None:
        self._inbox.put(message)
        self._wakeup.set()

    # -- the step thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - the thread must not end without a word
            logger.exception("the engine step loop crashed")
            self._die(f"the engine step loop crashed: {type(exc).__name__}: {exc}")

    def _loop(self) -> None:
        failures = 0
        while not self._stop.is_set():
            self._drain_inbox()
            if not self.engine.has_unfinished_requests():
                self._refresh_stats()
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            self._step_started = time.monotonic()
            try:
                outputs = self.engine.step()
                failures = 0
            except Exception as exc:  # noqa: BLE001 - a step failure must not kill the loop
                failures += 1
                logger.exception("engine step failed (%d in a row)", failures)
                if not isinstance(exc, EngineFault):
                    # Broken outside the model: the step's requests are in an unknown state.
                    self._fail_running(f"engine step failed: {type(exc).__name__}: {exc}")
                outputs = self.engine.step_pending()
                if failures >= self.MAX_CONSECUTIVE_FAILURES:
                    self._deliver(outputs)
                    self._die(f"engine failed {failures} steps in a row; last: {exc!r}")
                    return
            finally:
                self._step_started = None
                self.last_step_time = time.monotonic()
            self._refresh_stats()
            self._deliver(outputs)

    def _refresh_stats(self) -> None:
        try:
            self.stats = self.engine.stats()
        except Exception:  # noqa: BLE001 - stale stats beat a dead loop
            logger.exception("could not read engine stats")

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            mailbox = self._mailboxes.get(output.request_id)
            if mailbox is None:
                continue
            try:
                mailbox.put(output)
            except RuntimeError:  # the caller's event loop has closed: nobody is listening
                logger.warning("dropped output of %s: its event loop is closed", output.request_id)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                if kind == "add":
                    self._add(payload)
                elif kind == "abort":
                    self.engine.abort_request(payload)
            except Exception:  # noqa: BLE001 - one bad message must not stop the others
                logger.exception("engine could not handle %s %s", kind, payload)

    def _add(self, request: Request) -> None:
        try:
            self.engine.add(request)
        except Exception as exc:  # noqa: BLE001 - the request fails, the engine goes on
            if not isinstance(exc, ValueError):
                logger.exception("engine could not add request %s", request.request_id)
            mailbox = self._mailboxes.get(request.request_id)
            if mailbox is not None:
                mailbox.put(exc)

    def _fail_running(self, message: str) -> None:
        """Fail the requests that were in the failed step; waiting ones carry on."""
        for request_id in {seq.request_id for seq in self.engine.scheduler.running}:
            self.engine.abort_request(request_id, reason="error", error=message)

    def _die(self, reason: str) -> None:
        self._dead = reason
        try:
            for request_id in list(self.engine.output_processor.requests):
                self.engine.abort_request(request_id, reason="error", error=reason)
            self._deliver(self.engine.step_pending())
        except Exception:  # noqa: BLE001 - the callers below still hear why
            logger.exception("could not fail the requests of the dead engine one by one")
        # Callers whose request never reached the engine (still in the inbox) wait too.
        for mailbox in list(self._mailboxes.values()):
            try:
                mailbox.put(EngineDeadError(reason))
            except RuntimeError:  # its event loop has closed: nobody is waiting there
                continue
