"""The core's side of the frontend's `CompileConstraint`s: each is handed to the engine's
grammar compiler as the message arrives, off the step loop (the compiler is thread-safe
and only queues the work), and answered by a `ConstraintCompiled` from the thread that
finishes it. The compile is cached, so the request the frontend sends once the answer has
come finds its grammar compiled; a `CancelCompile` (the caller's client left) stops that
caller's wait, and a compile nobody waits for any more is dropped.

The pending compiles' futures are the compiler's, shared by every request of one
constraint and kept in its cache: their callbacks hold this object weakly, so that a
cached future does not keep the core (and its model) alive after it is dropped.
"""

import logging
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future

from pagefleet_serve.messages import CancelCompile, CompileConstraint, ConstraintCompiled
from pagefleet_serve.structured.constraint import CompileQueueFull
from pagefleet_serve.structured.grammar import GrammarCompiler

logger = logging.getLogger(__name__)


class CompileRequests:
    def __init__(
        self,
        compiler: Callable[[], GrammarCompiler | None],
        emit: Callable[[object], None],
    ) -> None:
        """`compiler`: the engine's grammar compiler (None: the model has no tokenizer);
        `emit`: sends a message to the frontend (from any thread)."""
        self._compiler = compiler
        self._emit = emit
        self._lock = threading.Lock()
        self._waiting: dict[str, Future] = {}  # by op_id: a caller with a client waits

    def handle(self, message: object) -> bool:
        """Take a compile message (any thread); False for any other message."""
        if isinstance(message, CompileConstraint):
            self._compile(message)
        elif isinstance(message, CancelCompile):
            with self._lock:
                future = self._waiting.pop(message.op_id, None)
            compiler = self._compiler()
            if future is not None and compiler is not None:
                compiler.stop_waiting(future)
        else:
            return False
        return True

    def _compile(self, message: CompileConstraint) -> None:
        constraint, op_id = message.constraint, message.op_id
        compiler = self._compiler()
        if compiler is None:
            error = f"{constraint.field}: this model has no tokenizer to compile it with"
            self._emit(ConstraintCompiled(op_id, error, 400))
            return
        try:
            future = compiler.compile_async(constraint, message.client)
        except CompileQueueFull as exc:
            self._emit(ConstraintCompiled(op_id, str(exc), 429))
            return
        except RuntimeError as exc:  # closed: the core is shutting down
            self._emit(ConstraintCompiled(op_id, str(exc), 500))
            return
        if message.client is not None:
            with self._lock:
                self._waiting[op_id] = future
        answer = weakref.WeakMethod(self._answer)

        def compiled(done: Future) -> None:
            if (method := answer()) is not None:
                method(op_id, done)

        future.add_done_callback(compiled)

    def _answer(self, op_id: str, future: Future) -> None:
        with self._lock:
            self._waiting.pop(op_id, None)
        error = future.exception()
        if error is None:
            answer = ConstraintCompiled(op_id)
        elif isinstance(error, ValueError):
            answer = ConstraintCompiled(op_id, str(error), 400)
        else:
            answer = ConstraintCompiled(op_id, str(error), 500)
        try:
            self._emit(answer)
        except Exception:  # the frontend is gone: nobody waits for the answer
            logger.debug("could not answer compile %s", op_id, exc_info=True)
