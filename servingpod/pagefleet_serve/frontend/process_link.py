"""The frontend's end of an engine core in a process of its own (`engine.core_process`
is the child's end): starts the process, waits for its `CoreReady`, reads its messages
and tells a stalled core (no `Heartbeat` for a while) from a busy one.

This is the one place the frontend names the engine core: `_run_core`, the spawned
child's entry, imports it there; this process never does.
"""

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable

from pagefleet_serve.config import EngineConfig
from pagefleet_serve.cpu_placement import CpuPlacement
from pagefleet_serve.messages import (
    PROTOCOL_VERSION,
    CoreFailed,
    CoreReady,
    Heartbeat,
    Shutdown,
    StepOutputs,
)

logger = logging.getLogger(__name__)

_SHUTDOWN_WAIT_S = 10.0


class ProcessLink:
    """Starts the core process; `wait_ready()` waits until it has loaded the model (raises
    RuntimeError with the core's reason when it cannot start), so the caller can do its own
    loading meanwhile; `start()` then hands every message to `on_message` and a lost
    core's reason to `on_lost`, from a reader thread (a `CoreLink`)."""

    def __init__(
        self,
        config: EngineConfig,
        placement: CpuPlacement | None = None,
        log_level: str = "info",
    ) -> None:
        self._on_message: Callable[[object], None] = lambda message: None
        self._on_lost: Callable[[str], None] = lambda reason: None
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self.process = context.Process(
            target=_run_core,
            args=(child_conn, config, placement, os.getpid(), log_level),
            name="pagefleet-engine-core",
            # A daemonic process may not start processes: a tensor-parallel core (rank 0)
            # starts its workers, so it is not one (close() ends it all the same, and it
            # dies with this process: PR_SET_PDEATHSIG).
            daemon=config.world_size == 1,
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

    def start(self, on_message: Callable[[object], None], on_lost: Callable[[str], None]) -> None:
        self._on_message, self._on_lost = on_message, on_lost
        threading.Thread(target=self._read, name="engine-core-reader", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                if not self._closing:
                    self._on_lost(self.exit_reason())
                return
            except Exception:  # one unreadable message must not stop the rest
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
            except Exception:  # as above: the next message is still read
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


def _run_core(conn, config: EngineConfig, placement, parent_pid: int, log_level: str) -> None:
    """The spawned child's entry point: the engine core is imported there, not here."""
    started = time.monotonic()
    from pagefleet_serve.engine.core_process import core_main
    from pagefleet_serve.frontend.tokenizer import load_engine_tokenizer

    imports = time.monotonic() - started
    core_main(
        conn,
        config,
        placement,
        parent_pid,
        log_level,
        load_engine_tokenizer,
        imports_seconds=imports,
    )
