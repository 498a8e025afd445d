"""The engine core in a process of its own, and this process's end of its pipe.

The child loads the model, says `CoreReady`, then runs `EngineCore` on its main thread;
one thread of it forwards the frontend's messages from the pipe into the loop and another
sends a `Heartbeat` twice a second, so a stalled core is told from a busy one. The child
never outlives the server: it ignores SIGTERM/SIGINT (the frontend drains first, then sends
`Shutdown`), stops when its pipe closes, and Linux kills it when its parent dies
(PR_SET_PDEATHSIG), even by SIGKILL.
"""

import ctypes
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable

from pagefleet_serve.config import EngineConfig
from pagefleet_serve.engine.core import EngineCore
from pagefleet_serve.engine.core_messages import (
    PROTOCOL_VERSION,
    CoreFailed,
    CoreReady,
    Heartbeat,
    Shutdown,
    StepOutputs,
)
from pagefleet_serve.engine.cpu_placement import CpuPlacement, place_core_threads

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
_PR_SET_PDEATHSIG = 1
_SHUTDOWN_WAIT_S = 10.0


class CoreProcess:
    """Starts the core process; `wait_ready()` waits until it has loaded the model (raises
    RuntimeError with the core's reason when it cannot start), so the caller can do its own
    loading meanwhile; `start_reading()` then hands every message to `on_message` and a
    lost core's reason to `on_lost`, from a reader thread."""

    def __init__(
        self,
        config: EngineConfig,
        on_message: Callable[[object], None],
        on_lost: Callable[[str], None],
        placement: CpuPlacement | None = None,
        log_level: str = "info",
    ) -> None:
        self._on_message = on_message
        self._on_lost = on_lost
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self.process = context.Process(
            target=_core_main,
            args=(child_conn, config, placement, os.getpid(), log_level),
            name="pagefleet-engine-core",
            daemon=True,
        )
        self.process.start()
        child_conn.close()
        self._send_lock = threading.Lock()
        self._closing = False
        self.last_heard = time.monotonic()
        self._step: tuple[float | None, float] = (None, self.last_heard)
        self.ready: CoreReady | None = None

    def wait_ready(self) -> CoreReady:
        try:
            while not self._conn.poll(0.5):
                if not self.process.is_alive():
                    raise EOFError
            message = self._conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"the engine core did not start: {self.exit_reason()}") from None
        if isinstance(message, CoreFailed):
            self.process.join(_SHUTDOWN_WAIT_S)
            raise RuntimeError(message.reason)
        if not isinstance(message, CoreReady) or message.version != PROTOCOL_VERSION:
            self.close()
            raise RuntimeError(
                f"the engine core speaks another protocol: {message!r} "
                f"(this frontend speaks version {PROTOCOL_VERSION})"
            )
        logger.info("engine core process %d ready", self.process.pid)
        self.ready = message
        return message

    def start_reading(self) -> None:
        threading.Thread(target=self._read, name="engine-core-reader", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                if not self._closing:
                    self._on_lost(self.exit_reason())
                return
            except Exception:  # noqa: BLE001 - one unreadable message must not stop the rest
                logger.exception("could not read a message from the engine core")
                continue
            self.last_heard = time.monotonic()
            if isinstance(message, Heartbeat):
                self._step = (message.step_running_s, self.last_heard)
                continue
            if isinstance(message, StepOutputs):
                self._step = (None, self.last_heard)
            try:
                self._on_message(message)
            except Exception:  # noqa: BLE001 - as above: the next message is still read
                logger.exception("could not handle %s from the engine core", type(message).__name__)

    def send(self, message: object) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError):  # the core is gone: the reader reports why
            logger.debug("could not send %r to the engine core", message, exc_info=True)

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def silent_for(self) -> float:
        return time.monotonic() - self.last_heard

    def step_running_s(self) -> float | None:
        running, heard = self._step
        return None if running is None else running + time.monotonic() - heard

    def exit_reason(self) -> str:
        self.process.join(timeout=2)
        code = self.process.exitcode
        if code is None:
            return "the engine core process closed its pipe"
        if code < 0:
            return f"the engine core process was killed by {signal.Signals(-code).name}"
        return f"the engine core process exited with code {code}"

    def close(self) -> None:
        """Ask the core to stop, and make sure it has."""
        self._closing = True
        self.send(Shutdown())
        self.process.join(_SHUTDOWN_WAIT_S)
        if self.process.is_alive():
            logger.warning("the engine core did not stop in %.0fs: killing it", _SHUTDOWN_WAIT_S)
            self.process.kill()
            self.process.join(_SHUTDOWN_WAIT_S)
        self._conn.close()


# -- the child ---------------------------------------------------------------------------------
def _core_main(conn, config: EngineConfig, placement, parent_pid: int, log_level: str) -> None:
    _die_with_parent(parent_pid)
    # The frontend owns shutdown: it drains on SIGTERM, then sends Shutdown.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s",
    )
    send_lock = threading.Lock()

    def emit(message: object) -> None:
        if isinstance(message, StepOutputs):
            for output in message.outputs:
                output.prompt_token_ids = []  # the frontend has them: not resent every step
        with send_lock:
            conn.send(message)

    from pagefleet_serve.engine.llm_engine import LLMEngine

    try:
        place_core_threads(placement)
        engine = LLMEngine(config)
    except BaseException as exc:  # noqa: BLE001 - the frontend reports it and exits
        emit(CoreFailed(f"cannot load model {config.model}: {type(exc).__name__}: {exc}"))
        _exit_now(1)
    engine.detach_tokenizer()  # the core sees token ids only (its grammar compiler keeps it)
    emit(CoreReady.of(engine))
    core = EngineCore(engine, emit)
    threading.Thread(target=_forward, args=(conn, core), name="core-inbox", daemon=True).start()
    threading.Thread(target=_heartbeat, args=(core, emit), name="heartbeat", daemon=True).start()
    core.run()
    _exit_now(0)


def _exit_now(code: int) -> None:
    """Exit without the interpreter's teardown, which collects the model's objects one by
    one (tens of seconds on a loaded machine) while the frontend waits to exit."""
    logging.shutdown()
    os._exit(code)


def _forward(conn, core: EngineCore) -> None:
    """The frontend's messages into the loop; a closed pipe (the frontend is gone) stops it."""
    try:
        while True:
            core.submit(conn.recv())
    except (EOFError, OSError):
        core.stop()


def _heartbeat(core: EngineCore, emit: Callable[[object], None]) -> None:
    while not core.stopped:
        started = core.step_started
        try:
            emit(Heartbeat(None if started is None else time.monotonic() - started))
        except (OSError, ValueError):
            core.stop()
            return
        time.sleep(HEARTBEAT_INTERVAL_S)


def _die_with_parent(parent_pid: int) -> None:
    """Have Linux SIGKILL this process when its parent dies (no orphan survives a killed
    server); elsewhere the closed pipe stops it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before the call above
        os._exit(1)
