"""The frontend's client of an engine core, for asyncio callers (the HTTP server).

The core runs behind a `CoreLink`: in a process of its own (`ProcessLink`, what
`pagefleet serve` uses: the core's steps then share no interpreter lock with the server;
`start_core_process` builds that client on a started link), in a thread of this process
(the engine's `ThreadLink`, for tests and embedding) or stepped by its caller (the engine's
`InlineLink`, the offline `LLM`'s). Either way the client speaks to it in `messages` only,
and the core sees token ids only. A request takes two calls: `process_input` (the one
entry point: template, tokenize and validate with `InputProcessor`, and have the core
compile a structured output's constraint, whose answer the caller waits for) and `add`;
the text is made here (`OutputProcessor`: a stop string found aborts that sample in the
core), and each request's outputs go where its caller said (`add`), from the thread the
core's messages arrive on.

Health: a core that reports failure, a core process that exits or is killed, a core that
stops answering (`HEARTBEAT_TIMEOUT_S`) or a step that runs too long (`STEP_TIMEOUT_S`)
makes the client unhealthy, with the reason; requests in flight then end with an error.

LoRA adapters: the client knows which the core serves (from `CoreReady`, then from each
answer to a load or unload, which cross the seam as messages like requests do).
"""

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pagefleet_serve.config import EngineConfig
from pagefleet_serve.frontend.input_processor import InputProcessor, Prompt
from pagefleet_serve.frontend.output_processor import OutputProcessor
from pagefleet_serve.frontend.process_link import ProcessLink
from pagefleet_serve.frontend.tokenizer import Tokenizer
from pagefleet_serve.messages import (
    AbortRequest,
    AddRequest,
    CancelCompile,
    CompileConstraint,
    ConstraintCompiled,
    CoreFailed,
    CoreReady,
    EngineStats,
    LoadLoRAAdapter,
    LoRAAdapterInfo,
    LoRAAdaptersChanged,
    Request,
    RequestLimits,
    RequestRejected,
    StepOutputs,
    UnloadLoRAAdapter,
)
from pagefleet_serve.outputs import RequestOutput
from pagefleet_serve.sampling_params import SamplingParams
from pagefleet_serve.structured.constraint import CompileQueueFull

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class LoRAAdapterError(ValueError):
    """The core refused a LoRA adapter change; `status` says whose fault (400 the
    adapter's, 404 unknown, 409 in use, 500 the engine's)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class CoreLink(Protocol):
    """How messages reach a core and how its health is read; `ready` is what the core said
    when it had loaded the model."""

    ready: CoreReady

    def start(self, on_message: Callable[[object], None], on_lost: Callable[[str], None]) -> None:
        """Start delivering the core's messages (from a thread of the link's)."""

    def send(self, message: object) -> None: ...

    @property
    def alive(self) -> bool: ...

    def silent_for(self) -> float:
        """Seconds since the core was last heard from."""

    def step_running_s(self) -> float | None:
        """How long the core's current step has run; None between steps."""

    def exit_reason(self) -> str: ...

    def close(self) -> None: ...


# Where one request's outputs go: its deltas, the last one finished, or the exception that
# ended it (called from the thread the core's messages arrive on).
Deliver = Callable[[RequestOutput | BaseException], None]


def deliver_to(queue: asyncio.Queue, tag: object = None) -> Deliver:
    """Outputs put on `queue` as `(tag, output)`, on the event loop running now (from any
    thread); RuntimeError once that loop has closed."""
    loop = asyncio.get_running_loop()

    def deliver(item: RequestOutput | BaseException) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, (tag, item))

    return deliver


@dataclass
class ProcessedInput:
    """An API request's engine requests (one per prompt, sharing their params) and, with a
    constraint, the core's compile of it: the requests may be added once it is done without
    an error (ValueError: it cannot be compiled; CompileQueueFull: not now)."""

    requests: list[Request]
    compiled: Future | None = None
    op_id: str | None = None  # of the compile


class EngineCoreClient:
    # A step that has not returned within this bound means the engine has hung.
    STEP_TIMEOUT_S = 120.0
    # A core process that has sent nothing (not even a heartbeat, twice a second) for this
    # long has hung. Not less: on a 2-core machine at load 10, a healthy core's heartbeats
    # have been late by 4s. A silent core turns /health and /ready to 503; requests are
    # refused only once the core is gone (`dead_reason`), a stall may pass.
    HEARTBEAT_TIMEOUT_S = 10.0

    def __init__(self, config: EngineConfig, link: CoreLink, tokenizer: Tokenizer | None) -> None:
        """A client of the core behind `link` (ready), making text with `tokenizer`."""
        ready = link.ready
        self.config = config
        self.model_name = ready.model_name
        self.inputs = InputProcessor(tokenizer, ready.model_name, ready.limits)
        self.outputs = OutputProcessor(tokenizer)
        self.num_blocks = ready.num_blocks
        self.stats: EngineStats = ready.stats
        # The core's start-up phases and this process's time from its start to here.
        self.startup_seconds = {**ready.startup_seconds, "total": _seconds_since_start()}
        logger.info("engine ready %.1fs after the process started", self.startup_seconds["total"])
        # The LoRA adapters the core serves, by name, and whether it can serve any.
        self.lora_enabled = ready.lora_enabled
        # How the core pools when it serves embeddings (task embed); None: it generates.
        self.pooling = ready.pooling
        self.lora_adapters: dict[str, LoRAAdapterInfo] = {a.name: a for a in ready.lora_adapters}
        self._lora_changes: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._link = link
        self._mailboxes: dict[str, Deliver] = {}
        self._compiles: dict[str, Future] = {}  # by op_id: waiting for the core's answer
        self._dead: str | None = None
        self._closing = False
        link.start(self._on_message, self._on_core_lost)

    # -- what callers use ----------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.inputs.tokenizer

    @property
    def limits(self) -> RequestLimits:
        return self.inputs.limits

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    def process_input(
        self,
        prompts: Mapping[str, Prompt],
        params: SamplingParams,
        *,
        lora_name: str | None = None,
        pooling: bool = False,
        client: str | None = None,
    ) -> ProcessedInput:
        """The one entry point of a request: each prompt (by its request id, in order; a
        batch stops at its first bad prompt) templated, tokenized and validated (see
        `InputProcessor.process`), and the core asked to compile the constraint they
        share: wait for it (`compiled`) before `add`. `lora_name`: one of
        `lora_adapters`, as the caller resolved it (None: the base model);
        `client`: who sent it (None: offline, a caller always served), for the
        scheduler's fairness between clients and the compile queue's per-client budget.
        ValueError."""
        requests = [
            self.inputs.process(
                request_id,
                prompt,
                params,
                lora_name=lora_name,
                pooling=pooling,
                client=client or "",
            )
            for request_id, prompt in prompts.items()
        ]
        constraint = params.structured_outputs
        if constraint is None or self._closing or self.dead_reason is not None:
            return ProcessedInput(requests)  # none to compile, or `add` refuses them
        op_id = uuid.uuid4().hex
        compiled: Future = Future()
        # Its waiter may be an asyncio task that is cancelled (its client left): running,
        # so that the cancel does not reach it and the core's answer can still be set.
        compiled.set_running_or_notify_cancel()
        self._compiles[op_id] = compiled
        self._link.send(CompileConstraint(op_id, constraint, client))
        return ProcessedInput(requests, compiled, op_id)

    async def compiled(self, processed: ProcessedInput) -> None:
        """Wait, on the event loop and holding no thread, until the core has compiled the
        constraint of `processed` (at once without one, or when cached): ValueError if it
        cannot be, CompileQueueFull if not now. Cancelled (the client left), the compile
        is dropped if nobody else waits for it."""
        if processed.compiled is None:
            return
        try:
            await asyncio.wrap_future(processed.compiled)
        finally:
            if processed.op_id is not None and self._compiles.pop(processed.op_id, None):
                self._link.send(CancelCompile(processed.op_id))

    async def load_lora_adapter(
        self,
        lora_name: str,
        lora_path: str,
        from_client: bool = False,
        allowed_root: str | None = None,
    ) -> None:
        """Have the core read and serve an adapter (its files are read off the core's
        step loop); `from_client`: a client's path, read only under `allowed_root`.
        LoRAAdapterError."""
        await self._change_lora(
            LoadLoRAAdapter(uuid.uuid4().hex, lora_name, lora_path, from_client, allowed_root)
        )

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """Stop serving an adapter (refused, 409, while requests use it).
        LoRAAdapterError."""
        await self._change_lora(UnloadLoRAAdapter(uuid.uuid4().hex, lora_name))

    async def _change_lora(self, message: LoadLoRAAdapter | UnloadLoRAAdapter) -> None:
        if self._dead:
            raise EngineDeadError(self._dead)
        loop = asyncio.get_running_loop()
        answer: asyncio.Future = loop.create_future()
        self._lora_changes[message.op_id] = (loop, answer)
        try:
            self._link.send(message)
            result: LoRAAdaptersChanged = await answer
        finally:
            self._lora_changes.pop(message.op_id, None)
        if result.error is not None:
            raise LoRAAdapterError(result.status, result.error)

    def add(self, request: Request, deliver: Deliver) -> None:
        """Queue a request from `process_input` (its constraint compiled). Its outputs
        (deltas, text included, the last one finished; or the exception that ended it)
        go to `deliver`."""
        request_id = request.request_id
        if self._dead:
            raise EngineDeadError(self._dead)
        if request_id in self._mailboxes:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.outputs.add_request(request)
        self._mailboxes[request_id] = deliver
        if self._dead:  # died since the check above: nobody would answer this mailbox
            self._forget(request_id)
            raise EngineDeadError(self._dead)
        self._link.send(AddRequest(request))

    def abort(self, request_id: str, final_output: bool = False) -> None:
        """Stop a request (its blocks are freed before the core's next step); no more of
        its outputs are delivered, unless `final_output`: then its last one (finish reason
        "abort") comes with the core's next step."""
        if final_output:
            running = request_id in self._mailboxes
        else:
            running = self._forget(request_id) is not None
        if running:
            self._link.send(AbortRequest(request_id))

    async def generate(
        self, request_id: str, prompt: Prompt, params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request, step by step (deltas); raises ValueError for bad input.
        Leaving the iterator early aborts the request."""
        processed = self.process_input({request_id: prompt}, params)
        await self.compiled(processed)
        queue: asyncio.Queue = asyncio.Queue()
        self.add(processed.requests[0], deliver_to(queue))
        finished = False
        try:
            while not finished:
                _, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    @property
    def default_max_num_queued(self) -> int:
        """As many requests as the KV pool has blocks (each needs one at least, so more
        could never all run at once), and no fewer than one full batch."""
        return max(self.limits.max_num_seqs, self.num_blocks)

    @property
    def is_healthy(self) -> bool:
        return self.unhealthy_reason is None

    @property
    def dead_reason(self) -> str | None:
        """Why the core is gone for good, if it is."""
        if self._dead is None and not self._link.alive and not self._closing:
            return self._link.exit_reason()
        return self._dead

    @property
    def unhealthy_reason(self) -> str | None:
        if self._closing:
            return "the engine has been shut down"
        if (dead := self.dead_reason) is not None:
            return dead
        silent = self._link.silent_for()
        if silent > self.HEARTBEAT_TIMEOUT_S:
            return f"the engine core has not answered for {silent:.0f}s"
        running = self._link.step_running_s()
        if running is not None and running > self.STEP_TIMEOUT_S:
            return f"an engine step has not returned in {running:.0f}s"
        return None

    def shutdown(self) -> None:
        """Stop the core (and its process); idempotent."""
        if self._closing:
            return
        self._closing = True
        self._link.close()

    # -- what the core says (on its thread, or this process's pipe reader) --------------
    def _on_message(self, message: object) -> None:
        if isinstance(message, StepOutputs):
            if message.stats is not None:
                self.stats = message.stats
            for output in message.outputs:
                try:
                    self._deliver(output)
                except Exception as exc:  # noqa: BLE001 - only this request is at fault
                    self._fail_request(output.request_id, exc)
        elif isinstance(message, ConstraintCompiled):
            compiled = self._compiles.pop(message.op_id, None)
            if compiled is not None:
                _settle_compile(compiled, message)
        elif isinstance(message, RequestRejected):
            mailbox = self._forget(message.request_id)
            if mailbox is not None:
                error = ValueError if message.invalid else RuntimeError
                mailbox(error(message.error))
        elif isinstance(message, LoRAAdaptersChanged):
            self.lora_adapters = {a.name: a for a in message.adapters}
            waiting = self._lora_changes.get(message.op_id)
            if waiting is not None:
                loop, answer = waiting
                loop.call_soon_threadsafe(_settle, answer, message)
        elif isinstance(message, CoreFailed):
            self._fail_all(message.reason)
        else:
            logger.warning("ignored a message of unknown type from the engine core: %r", message)

    def _on_core_lost(self, reason: str) -> None:
        if not self._closing:
            logger.error("%s", reason)
            self._fail_all(reason)

    def _deliver(self, output: RequestOutput) -> None:
        mailbox = self._mailboxes.get(output.request_id)
        if mailbox is None:  # aborted, or finished here by a stop string
            return
        output, stopped = self.outputs.process(output)
        for sample_index in stopped:  # the core runs them still: stop them there
            self._link.send(AbortRequest(output.request_id, "stop", sample_index))
        if output.finished:
            self._mailboxes.pop(output.request_id, None)
        try:
            mailbox(output)
        except RuntimeError:  # the caller's event loop has closed: nobody is listening
            logger.warning("dropped output of %s: its event loop is closed", output.request_id)

    def _forget(self, request_id: str) -> Deliver | None:
        self.outputs.abort(request_id)
        return self._mailboxes.pop(request_id, None)

    def _fail_request(self, request_id: str, exc: Exception) -> None:
        """An output that could not be handled here (its text, say) fails its request,
        which the core then stops; the other requests go on."""
        logger.error("could not handle an output of %s", request_id, exc_info=exc)
        mailbox = self._forget(request_id)
        if mailbox is None:
            return
        self._link.send(AbortRequest(request_id))
        error = RuntimeError(f"could not handle the engine's output: {type(exc).__name__}: {exc}")
        with contextlib.suppress(RuntimeError):  # its event loop has closed: nobody waits
            mailbox(error)

    def _fail_all(self, reason: str) -> None:
        # The first reason is the cause: a core that reports its failure (a lost rank) then
        # exits, and its pipe's end must not replace why with "exited with code 1".
        if self._dead is None:
            self._dead = reason
        for op_id in list(self._compiles):
            compiled = self._compiles.pop(op_id, None)
            if compiled is not None:
                with contextlib.suppress(InvalidStateError):
                    compiled.set_exception(EngineDeadError(reason))
        for loop, answer in list(self._lora_changes.values()):
            try:
                loop.call_soon_threadsafe(_settle, answer, EngineDeadError(reason))
            except RuntimeError:  # its event loop has closed: nobody is waiting there
                continue
        for request_id in list(self._mailboxes):
            mailbox = self._forget(request_id)
            if mailbox is None:
                continue
            try:
                mailbox(EngineDeadError(reason))
            except RuntimeError:  # its event loop has closed: nobody is waiting there
                continue


def _settle(answer: asyncio.Future, result: object) -> None:
    """Resolve a waiting adapter change (on its event loop), unless it was given up."""
    if answer.done():
        return
    if isinstance(result, BaseException):
        answer.set_exception(result)
    else:
        answer.set_result(result)


def _settle_compile(compiled: Future, answer: ConstraintCompiled) -> None:
    """Resolve a compile waited for with the core's answer."""
    if answer.error is None:
        outcome: BaseException | None = None
    elif answer.status == 400:
        outcome = ValueError(answer.error)
    elif answer.status == 429:
        outcome = CompileQueueFull(answer.error)
    else:
        outcome = RuntimeError(answer.error)
    with contextlib.suppress(InvalidStateError):  # settled already (the engine died)
        if outcome is None:
            compiled.set_result(None)
        else:
            compiled.set_exception(outcome)


def start_core_process(config: EngineConfig, link: ProcessLink) -> EngineCoreClient:
    """A client of the core `link` started (it loads the model in its own process;
    RuntimeError when it cannot start), with this process's tokenizer for text, loaded
    meanwhile. The caller starts the link before importing this module, so the core's
    imports and load also overlap this module's (transformers)."""
    from pagefleet_serve.frontend.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(config.model)  # while the core loads the model
        link.wait_ready()
    except BaseException:
        link.close()
        raise
    return EngineCoreClient(config, link, tokenizer)


def _seconds_since_start() -> float:
    """Seconds since this process started (Linux: /proc/self/stat's start time, in clock
    ticks since boot); 0.0 where that cannot be read."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of the whole line
        return max(time.clock_gettime(time.CLOCK_BOOTTIME) - started, 0.0)
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0
