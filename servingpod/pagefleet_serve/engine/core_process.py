"""The engine core in a process of its own: the child's end (`frontend.process_link` is
the frontend's).

The child loads the model, says `CoreReady`, then runs `EngineCore` on its main thread;
one thread of it forwards the frontend's messages from the pipe into the loop and another
sends a `Heartbeat` twice a second, so a stalled core is told from a busy one. The child
never outlives the server: it ignores SIGTERM/SIGINT (the frontend drains first, then sends
`Shutdown`), stops when its pipe closes, and Linux kills it when its parent dies
(PR_SET_PDEATHSIG), even by SIGKILL. With tensor parallelism the child is rank 0, and
its workers (`engine.executor.multiproc`) die with it the same way.
"""

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from pagefleet_serve.config import EngineConfig
from pagefleet_serve.cpu_placement import place_core_threads
from pagefleet_serve.engine.core import EngineCore
from pagefleet_serve.engine.lifetime import die_with_parent
from pagefleet_serve.engine.llm_engine import LLMEngine
from pagefleet_serve.messages import CoreFailed, Heartbeat, StepOutputs

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5


# -- the child ---------------------------------------------------------------------------------
def core_main(
    conn,
    config: EngineConfig,
    placement,
    parent_pid: int,
    log_level: str,
    load_tokenizer: Callable[[EngineConfig], object],
    imports_seconds: float = 0.0,
) -> None:
    """`load_tokenizer`: the frontend's (the engine core names no frontend module);
    `imports_seconds`: how long the child took to import the engine (torch)."""
    die_with_parent(parent_pid)
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

    try:
        place_core_threads(placement)
        engine = LLMEngine(config, placement, load_tokenizer(config))
    except BaseException as exc:  # noqa: BLE001 - the frontend reports it and exits
        emit(CoreFailed(f"cannot load model {config.model}: {type(exc).__name__}: {exc}"))
        _exit_now(1)
    ready = engine.ready()
    emit(replace(ready, startup_seconds={"imports": imports_seconds, **ready.startup_seconds}))
    core = EngineCore(engine, emit)
    # A rank lost between steps (or while one waits in a collective) fails the core at
    # once; its own collectives would only fail at the next step.
    engine.executor.watch(lambda reason: _lost_rank(emit, reason))
    threading.Thread(target=_forward, args=(conn, core), name="core-inbox", daemon=True).start()
    threading.Thread(target=_heartbeat, args=(core, emit), name="heartbeat", daemon=True).start()
    core.run()
    engine.close()
    _exit_now(0)


def _lost_rank(emit: Callable[[object], None], reason: str) -> None:
    """A tensor-parallel rank has died: the frontend fails every request and turns
    unhealthy with the reason; the core exits (its other ranks die with it)."""
    logger.error("%s: the engine core stops", reason)
    try:
        emit(CoreFailed(f"engine failed: {reason}"))
    finally:
        _exit_now(1)


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
