"""uvicorn, with a graceful drain on the first SIGTERM/SIGINT.

uvicorn's own shutdown closes the listener at once; in Kubernetes, traffic keeps arriving
for a moment after SIGTERM (endpoints are removed asynchronously), so we keep listening,
answer new requests with 503, let in-flight ones finish (up to the shutdown timeout), and
only then let uvicorn shut down. The process then exits 0. A second signal exits at once.

uvicorn closes idle keep-alive connections but puts no deadline on a request that is being
sent: `GuardedH11Protocol` adds one for the headers and one for the body, so a client that
sends slowly or stops half-way cannot hold a connection for ever, and it can cap the
connections one client address holds open.

Admission counts requests, not sockets: uvicorn's own `limit_concurrency` counts open
connections, so a crowd of connections that send nothing turned every request, and the
probes, into 503s (and the liveness probe restarted the pod). `ConcurrencyGate` counts
requests whose headers have arrived, and the probes (`PROBE_PATHS`) pass it always: a busy
pod is told apart from a dead one.
"""

import asyncio
import collections
import contextlib
import functools
import json
import logging

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagefleet_serve.frontend.core_client import EngineCoreClient
from pagefleet_serve.server.app import build_app
from pagefleet_serve.server.errors import APIError, unavailable
from pagefleet_serve.server.forwarded import LastHopForwardedFor
from pagefleet_serve.server.lora_file_watcher import LoRAFileWatcher
from pagefleet_serve.server.settings import ServerSettings
from pagefleet_serve.server.state import ServerState

logger = logging.getLogger(__name__)

# What the kubelet and Prometheus ask: never behind the public admission gate.
PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})


class ConcurrencyGate:
    """ASGI middleware: at most `limit` requests in flight (streams until they end), probes
    aside; the next one gets 503 at once. A connection counts only once it has sent a
    request's headers."""

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.in_flight = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBE_PATHS:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            logger.warning("%d requests in flight (--limit-concurrency): 503", self.in_flight)
            busy = unavailable(
                f"the server has {self.in_flight} requests in flight (its limit); retry later",
                code="server_busy",
            )
            busy.headers = {"Retry-After": "1"}
            await busy.response()(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with read deadlines: a request's headers must arrive within
    `header_timeout` seconds of the connection being ready for them, and its body within
    `body_timeout` seconds of its headers. Past a deadline the connection is closed, after
    a 408 when the request is known and nothing has been answered yet. With
    `max_connections_per_client`, a connection beyond that many open from one address is
    closed at once (`per_client` is the server's count, shared by its connections)."""

    def __init__(
        self,
        *args,
        header_timeout: float,
        body_timeout: float,
        max_connections_per_client: int | None = None,
        per_client: collections.Counter | None = None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.max_connections_per_client = max_connections_per_client
        self._per_client = per_client if per_client is not None else collections.Counter()
        self._counted_as: str | None = None  # the client address this connection counts for
        self._deadline: asyncio.TimerHandle | None = None
        self._awaiting: object = None  # the h11 state the deadline is for

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if self.max_connections_per_client is not None and self.client:
            host = self.client[0]
            if self._per_client[host] >= self.max_connections_per_client:
                logger.warning(
                    "%s holds %d connections already: closing", host, self._per_client[host]
                )
                transport.close()
                return
            self._per_client[host] += 1
            self._counted_as = host
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        if self._counted_as is not None:
            self._per_client[self._counted_as] -= 1
            if not self._per_client[self._counted_as]:
                del self._per_client[self._counted_as]
            self._counted_as = None
        super().connection_lost(exc)

    def _watch(self) -> None:
        """Arm the deadline for what the client owes now: headers (IDLE) or body
        (SEND_BODY); a deadline already running for the same thing keeps running."""
        awaiting = self.conn.their_state
        if awaiting is self._awaiting or self.transport.is_closing():
            return
        self._cancel_deadline()
        self._awaiting = awaiting
        timeout = {h11.IDLE: self.header_timeout, h11.SEND_BODY: self.body_timeout}.get(awaiting)
        if timeout is not None:
            self._deadline = self.loop.call_later(timeout, self._expired, awaiting)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self, awaiting) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if awaiting is h11.SEND_BODY and self.cycle is not None and not self.cycle.response_started:
            self._send_408(f"the request body did not arrive within {self.body_timeout:g}s")
            self.cycle.disconnected = True  # the app's late answer goes nowhere
        self.transport.close()

    def _send_408(self, message: str) -> None:
        body = json.dumps(APIError(408, message, code="request_timeout").body()).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        try:
            for event in (
                h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"),
                h11.Data(data=body),
                h11.EndOfMessage(),
            ):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:  # h11 cannot answer in this state: just close
            logger.debug("could not send 408 before closing", exc_info=True)


class DrainingServer(uvicorn.Server):
    """`lora_file_watcher` (--lora-modules-file) polls on the server's loop while it serves."""

    def __init__(
        self,
        config: uvicorn.Config,
        state: ServerState,
        lora_file_watcher: LoRAFileWatcher | None = None,
    ) -> None:
        super().__init__(config)
        self.state = state
        self.lora_file_watcher = lora_file_watcher
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started:
            if self.lora_file_watcher is not None:
                self._watch_task = asyncio.ensure_future(self.lora_file_watcher.run())
            settings = self.state.settings
            logger.info(
                "serving %s on http://%s:%d",
                ", ".join(settings.served_model_names),
                settings.host,
                self.bound_port,
            )

    async def shutdown(self, sockets=None) -> None:
        # Before the app's lifespan ends, which shuts the engine down.
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
        await super().shutdown(sockets)

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
    settings: ServerSettings,
    engine: EngineCoreClient,
    log_level: str = "info",
    lora_file_watcher: LoRAFileWatcher | None = None,
) -> DrainingServer:
    """A ready-to-run server for an engine (`.run()`; tests run it in a thread)."""
    state = ServerState(settings, engine)
    config = uvicorn.Config(
        LastHopForwardedFor(
            ConcurrencyGate(build_app(state), settings.limit_concurrency),
            settings.forwarded_allow_ips,
        ),
        host=settings.host,
        port=settings.port,
        log_config=None,
        log_level=log_level,
        timeout_graceful_shutdown=5,
        proxy_headers=False,  # LastHopForwardedFor reads them
        http=functools.partial(
            GuardedH11Protocol,
            header_timeout=settings.header_read_timeout,
            body_timeout=settings.body_read_timeout,
            max_connections_per_client=settings.max_connections_per_client,
            per_client=collections.Counter(),
        ),
    )
    return DrainingServer(config, state, lora_file_watcher)
