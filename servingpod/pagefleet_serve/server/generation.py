"""One API request's run through the engine, as one stream of choice deltas.

A request becomes one engine request per prompt (a completions prompt may be a batch); each
yields `n` samples. The engine puts their outputs straight on this generation's one queue;
they are merged into choice indices (prompt * n + sample), coalesced after the first token
when asked to, and interleaved with keep-alive ticks while nothing arrives. Leaving the
stream, or `close()`, aborts every engine request still running; `cancel()` (graceful
drain) ends the stream with `RequestCancelled`.
"""

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagefleet_serve.frontend.core_client import EngineCoreClient, deliver_to
from pagefleet_serve.messages import Request
from pagefleet_serve.outputs import CompletionOutput, TokenLogprob
from pagefleet_serve.server.metrics import RequestTracker

if TYPE_CHECKING:
    from pagefleet_serve.server.state import ServerState


class RequestFailed(Exception):
    """The engine failed this request (HTTP 500)."""


class RequestCancelled(Exception):
    """The server ended this request before it finished (graceful drain ran out of time)."""


@dataclass
class _EngineRequest:
    request: Request  # made by the core client's process_input
    prompt_index: int
    tracker: RequestTracker
    queued: bool = True  # accepted, no output yet (counts against the queue limit)
    done: bool = False
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served

    @property
    def request_id(self) -> str:
        return self.request.request_id


_CANCEL = object()


class Generation:
    def __init__(self, state: "ServerState", requests: list[Request]) -> None:
        """Takes queue slots from `state` for engine requests made by `process_input`
        (APIError 429/503); they share one SamplingParams."""
        self.state = state
        self.engine: EngineCoreClient = state.engine
        self.params = requests[0].params
        self.requests = [
            _EngineRequest(request, i, state.metrics.track()) for i, request in enumerate(requests)
        ]
        self.admission = state.admit(len(requests), self.cancel)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._started = False
        self._cancel_reason: str | None = None
        self._closed = False
        # Embedding requests' vectors, by prompt index, as they finish.
        self.embeddings: dict[int, list[float]] = {}
        # Prompt logprobs (when asked for), by prompt index, from each first output.
        self.prompt_logprobs: dict[int, list[TokenLogprob | None]] = {}

    @property
    def num_choices(self) -> int:
        return len(self.requests) * self.params.n

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.request.prompt_token_ids) for r in self.requests)

    @property
    def num_cached_tokens(self) -> int:
        return sum(r.num_cached_tokens for r in self.requests)

    async def stream(
        self, keepalive_s: float | None, coalesce_s: float
    ) -> AsyncIterator[list[CompletionOutput]]:
        """Batches of choice deltas; an empty batch is a keep-alive tick (after `keepalive_s`
        of silence). The first token goes out at once; later deltas that arrive within
        `coalesce_s` of the last batch are merged into the next one."""
        loop = asyncio.get_running_loop()
        self._start()
        last_sent: float | None = None
        try:
            while not all(r.done for r in self.requests):
                try:
                    items = [await asyncio.wait_for(self._queue.get(), keepalive_s)]
                except asyncio.TimeoutError:
                    yield []
                    continue
                if last_sent is not None and coalesce_s > 0:
                    while (wait := last_sent + coalesce_s - loop.time()) > 0:
                        try:
                            items.append(await asyncio.wait_for(self._queue.get(), wait))
                        except asyncio.TimeoutError:
                            break
                while not self._queue.empty():
                    items.append(self._queue.get_nowait())
                deltas = self._absorb(items)
                if deltas:
                    yield deltas
                    last_sent = loop.time()
        finally:
            self.close()

    def cancel(self, reason: str) -> None:
        """End the stream with RequestCancelled (and abort what still runs)."""
        self._cancel_reason = reason
        self._queue.put_nowait((None, _CANCEL))

    def close(self) -> None:
        """Abort every engine request still running and give back queue slots; idempotent."""
        if self._closed:
            return
        self._closed = True
        for request in self.requests:
            if not request.done:
                request.tracker.abort()
                self.engine.abort(request.request_id)
        self.admission.close()

    def _start(self) -> None:
        """Hand the engine requests to the engine, their outputs to come on our queue."""
        if self._started:
            return
        self._started = True
        for request in self.requests:
            try:
                self.engine.add(request.request, deliver_to(self._queue, request))
            except Exception as exc:  # noqa: BLE001 - whatever the engine said, it failed
                self._queue.put_nowait((request, exc))

    def _absorb(self, items: list[tuple]) -> list[CompletionOutput]:
        merged: dict[int, CompletionOutput] = {}
        for request, item in items:
            if item is _CANCEL:
                raise RequestCancelled(self._cancel_reason)
            if isinstance(item, Exception):
                raise RequestFailed(f"the engine could not run this request: {item}")
            if request.queued:
                request.queued = False
                self.admission.release_slot()
            request.tracker.observe(item)
            request.done = item.finished
            request.num_cached_tokens = max(request.num_cached_tokens, item.num_cached_tokens)
            if item.error:
                raise RequestFailed(f"the engine failed while running this request: {item.error}")
            if item.embedding is not None:
                self.embeddings[request.prompt_index] = item.embedding
            if item.prompt_logprobs is not None:
                self.prompt_logprobs[request.prompt_index] = item.prompt_logprobs
            for sample in item.outputs:
                index = request.prompt_index * self.params.n + sample.index
                delta = CompletionOutput(
                    index,
                    sample.text,
                    list(sample.token_ids),
                    sample.logprobs,
                    sample.finish_reason,
                    sample.reasoning,
                    sample.num_reasoning_tokens,
                    sample.stop_reason,
                )
                if index in merged:
                    merged[index].extend(delta)
                else:
                    merged[index] = delta
        return sorted(merged.values(), key=lambda d: d.index)
