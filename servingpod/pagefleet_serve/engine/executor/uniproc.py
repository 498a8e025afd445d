"""One rank: the model runs in the core's own runner, with nothing to reach or lose."""

from collections.abc import Callable

from pagefleet_serve.engine.executor.abstract import Executor
from pagefleet_serve.model.tensor_parallel import NO_PARALLEL


class UniprocExecutor(Executor):
    def __init__(self) -> None:
        super().__init__(NO_PARALLEL)

    def on_every_rank(self, method: str, *args: object):
        return getattr(self.runner, method)(*args)

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """No other rank to lose."""

    def close(self) -> None:
        """No other rank to end."""
