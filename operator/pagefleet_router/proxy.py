"""The router's HTTP side (aiohttp): the OpenAI routes forwarded to the pod the policy
picks, bytes relayed as they arrive, and the router's own /health, /ready, /metrics.

A /v1/responses response's id is read from the first bytes relayed (the response's JSON,
or its stream's `response.created` event, starts with it) and remembered with its pod, so
that a request naming it (`previous_response_id`, GET or DELETE /v1/responses/{id}) goes
to the pod whose store holds it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
from aiohttp import web

from .bounded_json import parse_prefix
from .discovery import Discovery, PodRegistry, ScrapeSettings, refresh
from .metrics import RouterMetrics
from .pod_table import PodTable
from .policy import Decision, PolicyConfig, choose_pod, is_fresh
from .prefix import PrefixTable, block_hashes, prompt_text
from .tracing import RequestTracing

if TYPE_CHECKING:  # imported with precise routing only (cli)
    from .kv_feed import PreciseRouting

logger = logging.getLogger("pagefleet_router.proxy")

# Per-connection headers (RFC 9110 section 7.6.1) and the ones aiohttp recomputes.
_NOT_FORWARDED = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "x-forwarded-for",  # appended to (`forwarded_for`)
    }
)


def forwarded_for(request: web.Request) -> str:
    """X-Forwarded-For for the pod: what the client's proxies said, then the client's own
    address (the pod trusts the router's entry, the last, with --forwarded-allow-ips, and
    shares its batch fairly between the clients it names)."""
    chain = [v.strip() for v in request.headers.getall("X-Forwarded-For", []) if v.strip()]
    return ", ".join([*chain, request.remote or "unknown"])


PROXIED_ROUTES = (
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/embeddings"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses/{response_id}"),
    ("DELETE", "/v1/responses/{response_id}"),
    ("GET", "/v1/models"),
)
_ATTEMPTS = 2  # the first pod, then one other when the first fails before any byte
# Prompt parts nest a few levels (messages, content parts); the prefix code serializes
# nested parts again, so deeper bodies get no prefix rather than a deep recursion.
_MAX_PREFIX_DEPTH = 32
# A response's id is the first "id" of its JSON and of its stream's first event, ahead of
# its instructions and output: a few hundred bytes in.
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"([^"\\]{1,256})"')
_RESPONSE_ID_SCAN_BYTES = 4096
_PREVIOUS_RESPONSE_ID = re.compile(rb'"previous_response_id"\s*:\s*"([^"\\]{1,256})"')


@dataclass(frozen=True)
class RoutingKey:
    hashes: list[bytes]  # the prompt prefix's block hashes
    model: str | None  # the requested model (an adapter's name routes by adapter)
    response_id: str | None  # the stored response the request continues, reads or deletes
    # The prompt's blocks as the pods name them (precise routing): [] when not known.
    block_names: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class RouterSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    scrape: ScrapeSettings = field(default_factory=ScrapeSettings)
    block_chars: int = 128
    max_prefix_blocks: int = 64
    prefix_table_size: int = 100_000
    response_table_size: int = 100_000
    connect_timeout_s: float = 5.0
    # While no pod is ready and a waker is set (scale from zero): how many requests wait
    # for the first pod, and for how long.
    max_held_requests: int = 256
    hold_timeout_s: float = 300.0
    # The pod's limits (`pagefleet serve`'s flags of the same names): a body over the cap
    # is a 413 before it is read whole; a client has this long to send its headers (also
    # between requests on a kept-alive connection), then its body.
    max_request_body_bytes: int = 4 << 20
    header_read_timeout_s: float = 10.0
    body_read_timeout_s: float = 30.0
    # Only this much of a body is parsed for its prompt prefix: enough for the hashed
    # blocks, and a bounded cost on the event loop whatever the body's size.
    prefix_scan_bytes: int = 64 << 10

    def __post_init__(self) -> None:
        for name in (
            "block_chars",
            "max_prefix_blocks",
            "prefix_table_size",
            "response_table_size",
            "max_request_body_bytes",
            "prefix_scan_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_held_requests < 0:
            raise ValueError(f"max_held_requests must be >= 0, got {self.max_held_requests}")
        for name in (
            "connect_timeout_s",
            "hold_timeout_s",
            "header_read_timeout_s",
            "body_read_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class _UpstreamUnavailable(Exception):
    """The pod failed before sending a byte of its response."""


class Waker(Protocol):
    """Starts the first pod of a service that has none; returns once asked, not once a
    pod is ready (the router learns that from discovery and the pod's /metrics)."""

    async def wake(self) -> None: ...


class _Refused(Exception):
    """A request the router answers itself (its body too large or too slow): the
    response to send."""

    def __init__(self, response: web.Response) -> None:
        self.response = response


class NotHeld(Exception):
    """A request that waited for a pod and got none: the 503 to answer it with."""

    def __init__(self, response: web.Response) -> None:
        self.response = response


class Router:
    def __init__(
        self,
        settings: RouterSettings,
        discovery: Discovery,
        waker: Waker | None = None,
        tracing: RequestTracing | None = None,
        precise: PreciseRouting | None = None,
    ) -> None:
        self.settings = settings
        self.precise = precise
        self.discovery = discovery
        self.waker = waker
        self.tracing = tracing
        self.registry = PodRegistry()
        self.prefix_table = PrefixTable(settings.prefix_table_size)
        # response id -> the pod that answered it (whose store holds it)
        self.response_pods: PodTable[str] = PodTable(settings.response_table_size)
        self.metrics = RouterMetrics()
        self.session: aiohttp.ClientSession | None = None
        self._scrape_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None
        # Set by discovery when the pod list may have changed: the next round starts now.
        self._endpoints_changed = asyncio.Event()
        self._wake_task: asyncio.Task | None = None
        # Set while some pod has fresh metrics; held requests wait on it.
        self._pod_ready = asyncio.Event()
        self._held = 0

    def create_app(self) -> web.Application:
        app = web.Application(client_max_size=self.settings.max_request_body_bytes)
        for method, path in PROXIED_ROUTES:
            app.router.add_route(method, path, self.forward)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.render_metrics)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    def server_options(self) -> dict[str, Any]:
        """aiohttp's server options for the app (web.run_app, web.AppRunner).

        handler_cancellation: a client that leaves cancels its handler, which closes the
        upstream request even while the pod has sent nothing yet (queued, prefilling).
        aiohttp closes a connection that has not sent a whole request's headers within
        its keep-alive timeout of opening or of its last response: the header timeout."""
        return {
            "handler_cancellation": True,
            "keepalive_timeout": self.settings.header_read_timeout_s,
            "access_log": None,
        }

    async def _start(self, _app: web.Application) -> None:
        # No total timeout: a stream lasts as long as its generation.
        self.session = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout())
        await self._refresh()
        self._watch_task = asyncio.create_task(self._watch())
        self._scrape_task = asyncio.create_task(self._scrape_forever())

    async def _stop(self, _app: web.Application) -> None:
        for task in (self._scrape_task, self._watch_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.precise is not None:
            await self.precise.feeds.close()
        await self.session.close()

    async def _watch(self) -> None:
        try:
            await self.discovery.watch(self._endpoints_changed.set)
        except Exception:  # the scrape rounds still read the pod list
            logger.exception("watching the pod list failed")

    async def _refresh(self) -> None:
        try:
            vanished = await refresh(
                self.discovery, self.registry, self.session, self.settings.scrape
            )
        except Exception:  # a discovery failure keeps the last pod list, and the loop
            logger.exception("refreshing the pod list failed")
            return
        for url in vanished:
            self.prefix_table.forget_pod(url)
            self.response_pods.forget_pod(url)
        if self.precise is not None:
            self.precise.feeds.follow([p.url for p in self.registry.states()])
        if self._has_fresh_pod():
            self._pod_ready.set()
        else:
            self._pod_ready.clear()

    @property
    def starting(self) -> bool:
        """No pod is ready and a waker starts one: requests are held (`hold`)."""
        return self.waker is not None and not self._pod_ready.is_set()

    def is_ready(self) -> bool:
        return self.waker is not None or self._has_fresh_pod()

    def _has_fresh_pod(self) -> bool:
        return any(is_fresh(p, self.settings.policy) for p in self.registry.states())

    async def _scrape_forever(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(
                    self._endpoints_changed.wait(), self.settings.scrape.interval_s
                )
            self._endpoints_changed.clear()
            await self._refresh()

    def choose(self, key: RoutingKey, exclude: set[str]) -> Decision | None:
        pods = [p for p in self.registry.states() if p.url not in exclude]
        holder = self.response_pods.get(key.response_id) if key.response_id else None
        cached = None
        if self.precise is not None and key.block_names:
            cached = self.precise.index.cached_blocks(key.block_names)
        return choose_pod(
            key.hashes,
            pods,
            self.prefix_table.get,
            self.settings.policy,
            key.model,
            holder,
            cached,
        )

    async def forward(self, request: web.Request) -> web.StreamResponse:
        if self.tracing is None:
            return await self._forward(request, None)
        with self.tracing.span(request) as span:
            response = await self._forward(request, span)
            span.set_attribute("http.response.status_code", response.status)
            return response

    async def _forward(self, request: web.Request, span: Any | None) -> web.StreamResponse:
        arrived = time.monotonic()
        try:
            body = await self._read_body(request)
        except _Refused as refused:
            return refused.response
        if self.starting:
            try:
                await self.hold()
            except NotHeld as refused:
                return refused.response
            finally:
                if span is not None:
                    span.set_attribute("pagefleet.router.held_seconds", time.monotonic() - arrived)
        key = self._routing_key(request, body)
        tried: set[str] = set()
        for attempt in range(_ATTEMPTS):
            decision = self.choose(key, exclude=tried)
            if decision is None:
                break
            tried.add(decision.url)
            if attempt:
                self.metrics.retries.inc()
            self.metrics.decisions.labels(decision.reason).inc()
            if span is not None:
                span.set_attributes(
                    {
                        "pagefleet.router.pod": decision.url,
                        "pagefleet.router.reason": decision.reason,
                        "pagefleet.router.attempt": attempt,
                    }
                )
            self.registry.acquire(decision.url)
            try:
                upstream = await self._open_upstream(request, decision.url, body, attempt)
                self.registry.record_answer(decision.url, upstream.status)
                try:
                    if upstream.status == 200:
                        self.prefix_table.record(key.hashes, decision.url)
                        if request.method == "DELETE" and key.response_id:
                            self.response_pods.forget(key.response_id)
                    self.metrics.routing_time.observe(time.monotonic() - arrived)
                    learn = upstream.status == 200 and request.path == "/v1/responses"
                    return await self._relay(request, upstream, decision.url, learn)
                finally:
                    upstream.close()  # a no-op once released; else the pod sees a disconnect
            except _UpstreamUnavailable:
                continue
            finally:
                self.registry.release(decision.url)
        self.metrics.no_pod.inc()
        return _error(503, "no pod could take the request", "no_pod_available")

    async def hold(self) -> None:
        """Wait, in a bounded queue, for the first pod to become ready, waking the service.
        A client that leaves cancels this wait (handler cancellation) and so leaves the
        queue; the pods never see its request."""
        if self._held >= self.settings.max_held_requests:
            self.metrics.not_held.labels("queue_full").inc()
            raise NotHeld(
                _error(
                    503,
                    f"the model is starting and {self._held} requests already wait for it "
                    f"(router --max-held-requests {self.settings.max_held_requests}); retry later",
                    "hold_queue_full",
                )
            )
        self._held += 1
        self.metrics.held.set(self._held)
        started = time.monotonic()
        try:
            if self._wake_task is None or self._wake_task.done():
                self._wake_task = asyncio.create_task(self.waker.wake())
            await asyncio.wait_for(self._pod_ready.wait(), self.settings.hold_timeout_s)
        except asyncio.TimeoutError:
            self.metrics.not_held.labels("timeout").inc()
            raise NotHeld(
                _error(
                    503,
                    f"the model is starting: no pod became ready within "
                    f"{self.settings.hold_timeout_s:g} s (router --hold-timeout); retry later",
                    "model_starting_timeout",
                )
            ) from None
        finally:
            self._held -= 1
            self.metrics.held.set(self._held)
            self.metrics.hold_time.observe(time.monotonic() - started)

    async def _read_body(self, request: web.Request) -> bytes:
        """The whole body (it is sent again on a retry), refused with the pod's 413
        before it is read past the cap, and with a 408 when it is slower than the body
        timeout. Either answer closes the connection (aiohttp reads and drops what the
        client still sends for a few seconds first, so that it sees the answer and not a
        reset)."""
        limit = self.settings.max_request_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise _body_too_large(limit)
        body = bytearray()

        async def read() -> None:
            async for chunk in request.content.iter_any():
                body.extend(chunk)
                if len(body) > limit:
                    raise _body_too_large(limit)

        try:
            await asyncio.wait_for(read(), self.settings.body_read_timeout_s)
        except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
            timeout = self.settings.body_read_timeout_s
            message = f"the request body did not arrive within {timeout:g}s"
            response = _error(408, message, "request_timeout", kind="invalid_request_error")
            raise _Refused(_closing(response)) from None
        return bytes(body)

    def _routing_key(self, request: web.Request, body: bytes) -> RoutingKey:
        """The stored response the request's path names, else the body's key; a body that
        is not a request has no prefix or model (the pod answers it with its own error)."""
        if "response_id" in request.match_info:  # GET or DELETE /v1/responses/{id}
            return RoutingKey([], None, request.match_info["response_id"])
        return self.routing_key(request.path, body) or RoutingKey([], None, None)

    def routing_key(self, path: str, body: bytes) -> RoutingKey | None:
        """The prompt prefix's block hashes from the body's first prefix_scan_bytes, the
        requested model, and the stored response a body's `previous_response_id` names;
        None for a body that is not JSON, too deep or not an object."""
        scanned = body[: self.settings.prefix_scan_bytes]
        cut = len(scanned) < len(body)
        try:
            payload = parse_prefix(
                scanned.decode(errors="ignore" if cut else "strict"),
                cut=cut,
                max_depth=_MAX_PREFIX_DEPTH,
            )
        except ValueError:  # UnicodeDecodeError included
            return None
        if not isinstance(payload, dict):
            return None
        model = payload.get("model")
        text = prompt_text(path, payload)
        hashes = block_hashes(text, self.settings.block_chars, self.settings.max_prefix_blocks)
        return RoutingKey(
            hashes,
            model if isinstance(model, str) else None,
            _previous_response_id(path, payload, body if cut else None),
            self.precise.blocks.names(path, payload) if self.precise is not None else [],
        )

    async def _open_upstream(
        self, request: web.Request, url: str, body: bytes, attempt: int
    ) -> aiohttp.ClientResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}
        headers["X-Forwarded-For"] = forwarded_for(request)
        if self.tracing is not None:
            self.tracing.inject(headers)
        try:
            upstream = await self.session.request(
                request.method,
                url + request.path_qs,
                data=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(sock_connect=self.settings.connect_timeout_s),
            )
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
            logger.warning("pod %s failed before responding: %s", url, exc or type(exc).__name__)
            self.registry.mark_failed(url)
            raise _UpstreamUnavailable from exc
        if upstream.status == 503 and attempt + 1 < _ATTEMPTS:
            # A draining pod refuses new work; another pod can take it.
            upstream.close()
            raise _UpstreamUnavailable
        return upstream

    async def _relay(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        url: str,
        learn_response_id: bool = False,
    ) -> web.StreamResponse:
        """Relay the pod's answer; with `learn_response_id`, remember the pod of the
        response id its first bytes carry."""
        self.metrics.requests.labels(url, str(upstream.status)).inc()
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _NOT_FORWARDED}
        response = web.StreamResponse(status=upstream.status, headers=headers)
        await response.prepare(request)
        head = b"" if learn_response_id else None
        chunks = upstream.content.iter_any()
        while True:
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                break
            except (
                aiohttp.ClientPayloadError,
                aiohttp.ClientConnectionError,
                asyncio.TimeoutError,
            ):
                await self._upstream_failed(response, upstream, url)
                return response
            if head is not None:
                head += chunk[: _RESPONSE_ID_SCAN_BYTES - len(head)]
                found = _RESPONSE_ID.search(head)
                if found:
                    self.response_pods.record([found.group(1).decode(errors="replace")], url)
                if found or len(head) >= _RESPONSE_ID_SCAN_BYTES:
                    head = None
            try:
                await response.write(chunk)
            except ConnectionResetError:
                return response  # the client left; the caller closes the upstream request
        await response.write_eof()
        upstream.release()
        return response

    async def _upstream_failed(
        self, response: web.StreamResponse, upstream: aiohttp.ClientResponse, url: str
    ) -> None:
        self.metrics.stream_errors.inc()
        logger.warning("pod %s failed mid-response", url)
        if upstream.content_type != "text/event-stream":
            # Headers are out and the body is cut: dropping the connection is how the
            # client learns it, rather than from a short body that looks complete.
            raise ConnectionResetError(f"pod {url} failed mid-response")
        await response.write(_error_event("the pod serving this stream failed"))
        await response.write_eof()

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, _request: web.Request) -> web.Response:
        """Ready once some pod has fresh metrics: before that the router knows of no pod
        known to answer. A router that wakes the service is ready with no pod at all:
        it must take the request that starts the first one."""
        if self.is_ready():
            return web.json_response({"status": "ready"})
        return _error(503, "no pod with fresh metrics yet", "no_pod_available")

    async def render_metrics(self, _request: web.Request) -> web.Response:
        states = self.registry.states()
        self.metrics.pods.labels("discovered").set(len(states))
        self.metrics.pods.labels("fresh").set(
            sum(is_fresh(p, self.settings.policy) for p in states)
        )
        if self.precise is not None:
            for state in states:
                self.metrics.kv_blocks.labels(state.url).set(
                    self.precise.index.num_blocks(state.url)
                )
        return web.Response(body=self.metrics.render(), content_type="text/plain")


def _previous_response_id(path: str, payload: dict, cut_body: bytes | None) -> str | None:
    """A /v1/responses body's `previous_response_id`, from its parsed prefix; from the
    whole body when the prefix was cut (a long `input` comes first, as the SDK sends)."""
    if path != "/v1/responses":
        return None
    if cut_body is None:
        found = payload.get("previous_response_id")
        return found if isinstance(found, str) else None
    at = cut_body.find(b'"previous_response_id"')  # a plain scan, not a regex one
    match = _PREVIOUS_RESPONSE_ID.match(cut_body, at) if at >= 0 else None
    return match.group(1).decode(errors="replace") if match else None


def error_body(message: str, code: str, kind: str = "server_error") -> dict:
    """An OpenAI-style error, as the pods answer one."""
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def _error(status: int, message: str, code: str, kind: str = "server_error") -> web.Response:
    return web.json_response(error_body(message, code, kind), status=status)


def _body_too_large(limit: int) -> _Refused:
    message = (
        f"the request body is larger than this server accepts ({limit} bytes; "
        f"router --max-request-body-bytes)"
    )
    response = _error(413, message, "request_too_large", kind="invalid_request_error")
    return _Refused(_closing(response))


def _closing(response: web.Response) -> web.Response:
    response.headers["Connection"] = "close"
    response.force_close()
    return response


def _error_event(message: str) -> bytes:
    """The OpenAI-style error event, then [DONE], as the pods end a failed stream."""
    error = {"message": message, "type": "server_error", "param": None, "code": "upstream_failed"}
    return f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode()
