"""The frontend of an engine core, for asyncio callers (the HTTP server).

The core (`EngineCore`) runs either in a thread of this process, `AsyncEngine(engine)`, or
in a process of its own, `AsyncEngine.start_core_process(config)` (what `pagefleet serve`
does: the core's steps then share no interpreter lock with the server). Either way the
frontend speaks to it in `core_messages` only, and the core sees token ids only: the
frontend validates requests (once), makes text from the tokens, matches stop strings (one
found aborts that sample in the core) and hands each request's outputs to the queue its
caller gave (`add`), from the thread the core's messages arrive on.

Health: a core that reports failure, a core process that exits or is killed, a core that
stops answering (`HEARTBEAT_TIMEOUT_S`) or a step that runs too long (`STEP_TIMEOUT_S`)
makes the frontend unhealthy, with the reason; requests in flight then end with an error.
"""

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pagefleet_serve.config import EngineConfig
from pagefleet_serve.detokenizer import SampleText
from pagefleet_serve.engine.core import EngineCore
from pagefleet_serve.engine.core_messages import (
    AbortRequest,
    AddRequest,
    CoreFailed,
    CoreReady,
    RequestRejected,
    StepOutputs,
)
from pagefleet_serve.engine.cpu_placement import CpuPlacement
from pagefleet_serve.engine.llm_engine import (
    EngineStats,
    LLMEngine,
    Request,
    RequestLimits,
    prompt_token_ids,
    validate_request,
)
from pagefleet_serve.outputs import CompletionOutput, RequestOutput
from pagefleet_serve.sampling_params import SamplingParams
from pagefleet_serve.structured.grammar import GrammarCompiler

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


@dataclass
class _Mailbox:
    """Where one request's outputs go, and the text made from them so far."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    tag: object
    request: Request
    texts: dict[int, SampleText] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)  # sample indices

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.tag, item))


class _ThreadLink:
    """A core running in a thread of this process."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.thread = threading.Thread(target=core.run, name="engine-step-loop", daemon=True)

    def send(self, message: object) -> None:
        self.core.submit(message)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def silent_for(self) -> float:
        return 0.0  # the thread shares this process: it cannot stall apart from it

    def step_running_s(self) -> float | None:
        started = self.core.step_started
        return None if started is None else time.monotonic() - started

    def exit_reason(self) -> str:
        return "the engine step thread has exited"

    def close(self) -> None:
        self.core.stop()
        self.thread.join(timeout=10)


class AsyncEngine:
    # A step that has not returned within this bound means the engine has hung.
    STEP_TIMEOUT_S = 120.0
    # A core process that has sent nothing (not even a heartbeat, twice a second) for this
    # long has hung. Not less: on a 2-core machine at load 10, a healthy core's heartbeats
    # have been late by 4s. A silent core turns /health and /ready to 503; requests are
    # refused only once the core is gone (`dead_reason`), a stall may pass.
    HEARTBEAT_TIMEOUT_S = 10.0
    MAX_CONSECUTIVE_FAILURES = EngineCore.MAX_CONSECUTIVE_FAILURES

    def __init__(self, engine: LLMEngine) -> None:
        """A core in a thread of this process, over `engine` (which stops making text: the
        frontend does)."""
        self.engine = engine
        tokenizer = engine.detach_tokenizer()
        link = _ThreadLink(EngineCore(engine, self._on_message))
        ready = CoreReady.of(engine)
        # The engine's own compiler: a constraint compiled here to validate it is then
        # found in its cache when the core adds the request.
        self._setup(engine.config, ready, tokenizer, engine.grammar_compiler, link)
        link.thread.start()

    @classmethod
    def start_core_process(
        cls, config: EngineConfig, placement: CpuPlacement | None = None, log_level: str = "info"
    ) -> "AsyncEngine":
        """A core in a process of its own (loads the model there; raises RuntimeError
        when it cannot start), with this process's tokenizer for text."""
        from pagefleet_serve.engine.core_process import CoreProcess
        from pagefleet_serve.model.loader import load_tokenizer

        self = cls.__new__(cls)
        self.engine = None
        link = CoreProcess(config, self._on_message, self._on_core_lost, placement, log_level)
        try:
            tokenizer = load_tokenizer(config.model)  # while the core loads the model
            link.wait_ready()
        except BaseException:
            link.close()
            raise
        # The core compiles each constraint again with its own compiler (same tokenizer
        # files); this one validates, so a bad constraint is a ValueError here, not an error
        # the core reports after the request was accepted.
        grammar_compiler = None
        if tokenizer is not None:
            grammar_compiler = GrammarCompiler(
                tokenizer,
                link.ready.vocab_size,
                link.ready.grammar_stop_token_ids,
                config.structured_outputs_compile_timeout,
            )
        self._setup(config, link.ready, tokenizer, grammar_compiler, link)
        link.start_reading()
        return self

    def _setup(
        self,
        config: EngineConfig,
        ready: CoreReady,
        tokenizer,
        grammar_compiler: GrammarCompiler | None,
        link,
    ) -> None:
        self.config = config
        self.model_name = ready.model_name
        self.tokenizer = tokenizer
        self.grammar_compiler = grammar_compiler
        self.limits = RequestLimits(ready.max_model_len, ready.vocab_size, ready.max_num_seqs)
        self.num_blocks = ready.num_blocks
        self.stats: EngineStats = ready.stats
        self._link = link
        self._mailboxes: dict[str, _Mailbox] = {}
        self._dead: str | None = None
        self._closing = False

    # -- what callers use ----------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    def make_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> Request:
        """Validate (and tokenize text, start compiling a structured output's constraint:
        await `grammar_compiled` before `add`); the core trusts what this returns.
        ValueError."""
        prompt = prompt_token_ids(prompt, self.tokenizer, self.model_name)
        return validate_request(
            request_id, prompt, params, self.limits, self.grammar_compiler, wait_for_grammar=False
        )

    async def grammar_compiled(self, request: Request) -> None:
        """Wait, on the event loop and holding no thread, until the request's constraint
        has compiled (at once when cached); ValueError if it cannot be, or not within the
        compile timeout. Other requests are validated and run meanwhile."""
        constraint = request.params.structured_outputs
        if constraint is not None:
            await asyncio.wrap_future(self.grammar_compiler.compile_async(constraint))

    def add(self, request: Request, queue: asyncio.Queue, tag: object = None) -> None:
        """Queue a request from `make_request`. Its outputs (deltas, text included) arrive
        on `queue` as `(tag, output)`, the last one finished; or `(tag, exception)` when it
        could not run. Call from the event loop that reads `queue`."""
        request_id = request.request_id
        if self._dead:
            raise EngineDeadError(self._dead)
        if request_id in self._mailboxes:
            raise ValueError(f"request_id {request_id!r} is already in use")
        mailbox = _Mailbox(asyncio.get_running_loop(), queue, tag, request)
        self._mailboxes[request_id] = mailbox
        if self._dead:  # died since the check above: nobody would answer this mailbox
            self._mailboxes.pop(request_id, None)
            raise EngineDeadError(self._dead)
        self._link.send(AddRequest(request))

    def abort(self, request_id: str) -> None:
        """Stop a request (its blocks are freed before the core's next step); no more of
        its outputs are delivered."""
        if self._mailboxes.pop(request_id, None) is not None:
            self._link.send(AbortRequest(request_id))

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request, step by step (deltas); raises ValueError for bad input.
        Leaving the iterator early aborts the request."""
        request = self.make_request(request_id, prompt, params)
        await self.grammar_compiled(request)
        queue: asyncio.Queue = asyncio.Queue()
        self.add(request, queue)
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
        elif isinstance(message, RequestRejected):
            mailbox = self._mailboxes.pop(message.request_id, None)
            if mailbox is not None:
                error = ValueError if message.invalid else RuntimeError
                mailbox.put(error(message.error))
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
        output.prompt_token_ids = mailbox.request.prompt_token_ids
        output.outputs = [s for s in output.outputs if self._add_text(mailbox, s)]
        if len(mailbox.finished) == mailbox.request.params.n:
            output.finished = True
        if output.finished:
            self._mailboxes.pop(output.request_id, None)
        try:
            mailbox.put(output)
        except RuntimeError:  # the caller's event loop has closed: nobody is listening
            logger.warning("dropped output of %s: its event loop is closed", output.request_id)

    def _add_text(self, mailbox: _Mailbox, sample: CompletionOutput) -> bool:
        """Make the text of a sample's delta, ending the sample at a stop string; False
        for a delta of a sample already ended here."""
        if sample.index in mailbox.finished:
            return False
        if self.tokenizer is not None:
            request = mailbox.request
            text = mailbox.texts.get(sample.index)
            if text is None:
                text = SampleText(self.tokenizer, request.prompt_token_ids, request.params)
                mailbox.texts[sample.index] = text
            for position, token_id in enumerate(sample.token_ids):
                if text.add(token_id):
                    del sample.token_ids[position + 1 :]
                    if sample.logprobs is not None:
                        del sample.logprobs[position + 1 :]
                    break
            if text.stopped and sample.finish_reason != "stop":
                if sample.finish_reason is None:  # the core runs it still: stop it there
                    self._link.send(AbortRequest(request.request_id, "stop", sample.index))
                sample.finish_reason = "stop"
            sample.text = text.release(sample.finish_reason is not None)
        if sample.finish_reason is not None:
            mailbox.finished.add(sample.index)
        return True

    def _fail_request(self, request_id: str, exc: Exception) -> None:
        """An output that could not be handled here (its text, say) fails its request,
        which the core then stops; the other requests go on."""
        logger.error("could not handle an output of %s", request_id, exc_info=exc)
        mailbox = self._mailboxes.pop(request_id, None)
        if mailbox is None:
            return
        self._link.send(AbortRequest(request_id))
        error = RuntimeError(f"could not handle the engine's output: {type(exc).__name__}: {exc}")
        try:
            mailbox.put(error)
        except RuntimeError:  # its event loop has closed: nobody is waiting there
            pass

    def _fail_all(self, reason: str) -> None:
        self._dead = reason
        for request_id in list(self._mailboxes):
            mailbox = self._mailboxes.pop(request_id, None)
            if mailbox is None:
                continue
            try:
                mailbox.put(EngineDeadError(reason))
            except RuntimeError:  # its event loop has closed: nobody is waiting there
                continue
