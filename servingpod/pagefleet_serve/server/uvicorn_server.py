"""uvicorn, with a graceful drain on the first SIGTERM/SIGINT.

uvicorn's own shutdown closes the listener at once; in Kubernetes, traffic keeps arriving
for a moment after SIGTERM (endpoints are removed asynchronously), so we keep listening,
answer new requests with 503, let in-flight ones finish (up to the shutdown timeout), and
only then let uvicorn shut down. The process then exits 0. A second signal exits at once.
"""

import asyncio
import logging

import uvicorn

from pagefleet_serve.engine.async_engine import AsyncEngine
from pagefleet_serve.server.app import build_app
from pagefleet_serve.server.settings import ServerSettings
from pagefleet_serve.server.state import ServerState

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started:
            settings = self.state.settings
            logger.info(
                "serving %s on http://%s:%d",
                ", ".join(settings.served_model_names),
                settings.host,
                self.bound_port,
            )

    @property
    def bound_port(self) -> int:
        """The port the listener got (the OS picks one when started with port 0)."""
        return self.servers[0].sockets[0].getsockname()[1]

    def handle_exit(self, sig: int, frame) -> None:
        # Not uvicorn's: it would re-raise the signal after shutdown (exit code 143).
        if self.state.draining or self._loop is None:
            logger.warning("second shutdown signal: exiting now")
            self.force_exit = self.should_exit = True
            return
        logger.info(
            "shutdown signal: draining for up to %.0fs", self.state.settings.shutdown_timeout
        )
        self.state.draining = True  # /ready is 503 from now on
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        await self.state.drain(self.state.settings.shutdown_timeout)
        self.should_exit = True


def create_server(
    settings: ServerSettings, engine: AsyncEngine, log_level: str = "info"
) -> DrainingServer:
    """A ready-to-run server for an engine (`.run()`; tests run it in a thread)."""
    state = ServerState(settings, engine)
    config = uvicorn.Config(
        build_app(state),
        host=settings.host,
        port=settings.port,
        log_config=None,
        log_level=log_level,
        timeout_graceful_shutdown=5,
    )
    return DrainingServer(config, state)
