"""A core stepped by its caller, in the caller's thread: the offline `LLM`'s `CoreLink`.

The same `EngineCore` as the server's, taking the same messages and emitting the same
outputs; only nothing runs until the caller calls `step()` (one pass of the core's loop:
the messages waiting, then one engine step). A message sent is handled at once, so that
a request added is unfinished work as soon as `add` returns, and a caller that steps
until the engine has none left has every output.
"""

import time
from collections.abc import Callable

from pagefleet_serve.engine.core import EngineCore
from pagefleet_serve.engine.llm_engine import LLMEngine


class InlineLink:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.ready = engine.ready()
        self.core: EngineCore | None = None
        self._closed = False

    def start(self, on_message: Callable[[object], None], on_lost: Callable[[str], None]) -> None:
        self.core = EngineCore(self.engine, on_message)

    def send(self, message: object) -> None:
        self.core.submit(message)
        self.core.take_messages()

    def step(self) -> None:
        """One pass of the core's loop: its outputs reach the client before this returns."""
        self.core.run_once()

    @property
    def alive(self) -> bool:
        return not self._closed and self.core.failed is None

    def silent_for(self) -> float:
        return 0.0  # it runs when its caller steps it: it cannot stall apart from it

    def step_running_s(self) -> float | None:
        started = self.core.step_started
        return None if started is None else time.monotonic() - started

    def exit_reason(self) -> str:
        return self.core.failed or "the engine has been closed"

    def close(self) -> None:
        self._closed = True
        self.engine.close()
