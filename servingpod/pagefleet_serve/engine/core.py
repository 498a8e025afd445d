"""The engine core: one loop that takes messages (`pagefleet_serve.messages`), steps an
`LLMEngine` and emits what happened, as token ids. The same class runs in a thread of the
caller's process (`ThreadLink`, a frontend's `CoreLink`) and in a process of its own
(`core_process`, what `pagefleet serve` uses); only how messages travel differs.

The loop never ends silently: each of its duties (taking requests, stepping, reading stats)
is guarded on its own, and should the loop itself break, every request is failed and a
`CoreFailed` says why. A LoRA adapter to load is read in a thread of its own, so that its
files never hold up a step, and the loop registers it between two steps. A constraint to
compile goes to the grammar compiler as it arrives, not through the loop
(`CompileRequests`): the request that needs it waits for it before it is even sent. Only
`EngineFault`s and unexpected step errors count toward giving up; a request the engine
isolated as the cause of a failure fails alone.
"""

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from pagefleet_serve.engine.compile_requests import CompileRequests
from pagefleet_serve.engine.executor.distributed import WorkerLost
from pagefleet_serve.engine.llm_engine import EngineFault, LLMEngine
from pagefleet_serve.messages import (
    PROTOCOL_VERSION,
    AbortRequest,
    AddRequest,
    CoreFailed,
    CoreReady,
    LoadLoRAAdapter,
    LoRAAdaptersChanged,
    RequestLimits,
    RequestRejected,
    Shutdown,
    StepOutputs,
    UnloadLoRAAdapter,
)
from pagefleet_serve.model.lora import LoRAAdapter, LoRAError, LoRAFileError
from pagefleet_serve.outputs import RequestOutput

logger = logging.getLogger(__name__)

# How long the loop waits for a message while it has nothing to step.
_IDLE_WAIT_S = 1.0


def core_ready(engine: LLMEngine) -> CoreReady:
    """What a frontend needs to know of an engine: its first message."""
    limits = RequestLimits(
        engine.max_model_len, engine.model_config.vocab_size, engine.config.max_num_seqs
    )
    return CoreReady(
        version=PROTOCOL_VERSION,
        model_name=engine.model_name,
        limits=limits,
        num_blocks=engine.block_manager.num_blocks,
        stats=engine.stats(),
        startup_seconds=dict(engine.startup_seconds),
        lora_adapters=engine.loras.infos(),
        lora_enabled=engine.config.enable_lora,
        pooling=engine.pooling,
    )


@dataclass(frozen=True)
class _AdapterRead:
    """The loop's own message: a LoRA adapter's files have been read (or failed to be)."""

    request: LoadLoRAAdapter
    future: "Future[LoRAAdapter]"


class EngineCore:
    MAX_CONSECUTIVE_FAILURES = 3

    def __init__(self, engine: LLMEngine, emit: Callable[[object], None]) -> None:
        """`emit` receives each message for the frontend, on the loop's thread."""
        self.engine = engine
        self.emit = emit
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self.failed: str | None = None
        self.step_started: float | None = None  # time.monotonic() of the running step
        self._failures = 0  # steps failed in a row
        self._compiles = CompileRequests(lambda: self.engine.grammar_compiler, emit)

    def submit(self, message: object) -> None:
        """Hand the loop a message (any thread); a compile starts at once."""
        if self._compiles.handle(message):
            return
        self._inbox.put(message)
        self._wakeup.set()

    def stop(self) -> None:
        self._stop.set()
        self._wakeup.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def run(self) -> None:
        """The loop, until `stop()` or a `Shutdown` message."""
        try:
            self._loop()
        except BaseException as exc:  # the loop must not end without a word
            logger.exception("the engine step loop crashed")
            self._fail(f"the engine step loop crashed: {type(exc).__name__}: {exc}")

    def _loop(self) -> None:
        while not self._stop.is_set() and self.failed is None:
            if not self.run_once():
                self._wakeup.wait(timeout=_IDLE_WAIT_S)
                self._wakeup.clear()

    def run_once(self) -> bool:
        """Take the messages waiting, then run one step if there is work and emit its
        outputs (the loop's body; a caller that steps the core itself calls it): False
        when there was no work (the stats are emitted instead)."""
        self.take_messages()
        if not self.engine.has_unfinished_requests():
            self._emit_outputs([])
            return False
        self.step_started = time.monotonic()
        try:
            outputs = self.engine.step()
            self._failures = 0
        except WorkerLost as exc:  # no step can run again
            logger.error("engine failed: %s", exc)
            self._fail(f"engine failed: {exc}")
            return True
        except Exception as exc:  # a step failure must not kill the loop
            self._failures += 1
            logger.exception("engine step failed (%d in a row)", self._failures)
            if not isinstance(exc, EngineFault):
                # Broken outside the model: the step's requests are in an unknown state.
                self._fail_running(f"engine step failed: {type(exc).__name__}: {exc}")
            outputs = self.engine.step_pending()
            if self._failures >= self.MAX_CONSECUTIVE_FAILURES:
                self._emit_outputs(outputs)
                self._fail(f"engine failed {self._failures} steps in a row; last: {exc!r}")
                return True
        finally:
            self.step_started = None
        self._emit_outputs(outputs)
        return True

    def _emit_outputs(self, outputs: list[RequestOutput]) -> None:
        try:
            stats = self.engine.stats()
        except Exception:  # stale stats beat a dead loop
            logger.exception("could not read engine stats")
            stats = None
        if outputs or stats is not None:
            self.emit(StepOutputs(outputs, stats))

    def take_messages(self) -> None:
        """Handle the messages waiting (the loop's thread, or the one that steps it)."""
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                self._handle(message)
            except Exception:  # one bad message must not stop the others
                logger.exception("engine could not handle %r", message)

    def _handle(self, message: object) -> None:
        if isinstance(message, AddRequest):
            self._add(message)
        elif isinstance(message, AbortRequest):
            self.engine.abort_request(
                message.request_id, message.reason, sample_index=message.sample_index
            )
        elif isinstance(message, Shutdown):
            self.stop()
        elif isinstance(message, LoadLoRAAdapter):
            self._read_adapter(message)
        elif isinstance(message, _AdapterRead):
            load = message.request
            self._answer_lora(
                load.op_id, lambda: self._add_adapter(message), load.lora_path, load.from_client
            )
        elif isinstance(message, UnloadLoRAAdapter):
            self._answer_lora(message.op_id, lambda: self.engine.unload_lora(message.lora_name))
        else:
            raise TypeError(f"unknown message type {type(message).__name__}")

    def _add(self, message: AddRequest) -> None:
        request = message.request
        try:
            self.engine.add(request)
        except Exception as exc:  # the request fails, the engine goes on
            invalid = isinstance(exc, ValueError)
            if not invalid:
                logger.exception("engine could not add request %s", request.request_id)
            self.emit(RequestRejected(request.request_id, str(exc), invalid))

    def _read_adapter(self, message: LoadLoRAAdapter) -> None:
        """Read the adapter's files in a reader thread of its own, within the time limit;
        the loop registers it when done."""
        try:
            future = self.engine.loras.start_read(
                message.lora_name, message.lora_path, message.allowed_root
            )
        except LoRAError as exc:
            failed: Future[LoRAAdapter] = Future()
            failed.set_exception(exc)
            future = failed
        future.add_done_callback(lambda done: self.submit(_AdapterRead(message, done)))

    def _add_adapter(self, read: _AdapterRead) -> None:
        self.engine.add_lora(read.future.result())

    def _answer_lora(
        self,
        op_id: str,
        change: Callable[[], None],
        lora_path: str = "",
        from_client: bool = False,
    ) -> None:
        """Make an adapter change and tell the frontend how it went (a client whose path
        cannot be read learns nothing of the server's files: the log does)."""
        error, status = None, 200
        try:
            change()
        except LoRAFileError as exc:
            error, status = str(exc), exc.status
            if from_client:
                logger.warning("LoRA adapter load refused: %s", exc)
                error = exc.public_message(lora_path)
        except LoRAError as exc:
            error, status = str(exc), exc.status
        except Exception as exc:  # the frontend hears of it, the loop goes on
            logger.exception("could not change the LoRA adapters")
            error, status = f"{type(exc).__name__}: {exc}", 500
        self.emit(LoRAAdaptersChanged(op_id, self.engine.loras.infos(), error, status))

    def _fail_running(self, message: str) -> None:
        """Fail the requests that were in the failed step; waiting ones carry on."""
        for request_id in self.engine.running_request_ids():
            self.engine.abort_request(request_id, reason="error", error=message)

    def _fail(self, reason: str) -> None:
        self.failed = reason
        try:
            for request_id in self.engine.unfinished_request_ids():
                self.engine.abort_request(request_id, reason="error", error=reason)
            self.emit(StepOutputs(self.engine.step_pending(), None))
        except Exception:  # the frontend still hears why, below
            logger.exception("could not fail the requests of the failed engine one by one")
        self.emit(CoreFailed(reason))


class ThreadLink:
    """A core running in a thread of this process: a frontend's `CoreLink` to `engine`
    (`EngineCoreClient(engine.config, ThreadLink(engine), engine.tokenizer)`)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.ready = core_ready(engine)
        self.core: EngineCore | None = None
        self.thread: threading.Thread | None = None

    def start(self, on_message: Callable[[object], None], on_lost: Callable[[str], None]) -> None:
        self.core = EngineCore(self.engine, on_message)
        self.thread = threading.Thread(target=self.core.run, name="engine-step-loop", daemon=True)
        self.thread.start()

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
        if not self.thread.is_alive():
            self.engine.close()  # its tensor-parallel workers, if any
            # Let the engine (its model and KV pool) go though the client lives on: FastAPI
            # keeps the endpoint functions of every app it built in a module-level cache,
            # and through their closures the server state and this link.
            self.engine = self.core.engine = None  # type: ignore[assignment]
