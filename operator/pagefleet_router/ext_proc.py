"""The router as the Endpoint Picker (EPP) of a Gateway API Inference Extension
InferencePool: Envoy's external processing stream
(`envoy.service.ext_proc.v3.ExternalProcessor/Process`) over gRPC, the pick made by the
same policy as the HTTP proxy, and gRPC health (`liveness`, `readiness`, the service).

Envoy opens one stream per HTTP request and sends its headers, its body (in chunks with
FULL_DUPLEX_STREAMED, whole with BUFFERED), then the pod's response. The pick needs the
prompt, so the body is buffered to its end (within the router's body cap). The answer
names the chosen pod's `ip:port` and, after it, fallbacks in the policy's next choices,
comma-separated, both in the `x-gateway-destination-endpoint` header and in the
`envoy.lb` dynamic metadata (the same string: proxies read one or the other).
With FULL_DUPLEX_STREAMED Envoy holds the request headers until they are answered, so
their answer carries the destination and follows the body's end, and the body is then
replayed unchanged; with BUFFERED the headers are answered at once and the destination
rides on the body's answer (the headers have not gone upstream yet).

A pick fails with an immediate response that ends this request but not the stream: 503
when no pod qualifies (none ready, or none in the data plane's subset hint), 429 when
every pod's queue is over the limit (shed: the pods would only queue it deeper, and
Envoy has no queue to hold it in), 400 for a body that is not a JSON request, 413 over
the body cap. While the service is scaled to zero the pick waits like a held HTTP
request. The response's status and `usage` are counted against the pod that served it
(`x-gateway-destination-endpoint-served`, else the pick)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import grpc
from aiohttp import web
from envoy_data_plane.envoy.config.core.v3 import HeaderValue, HeaderValueOption, Metadata
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import (
    ProcessingModeBodySendMode as BodyMode,
)
from envoy_data_plane.envoy.service.ext_proc.v3 import (
    BodyMutation,
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    HttpBody,
    HttpHeaders,
    ImmediateResponse,
    ProcessingRequest,
    ProcessingResponse,
    StreamedBodyResponse,
    TrailersResponse,
)
from envoy_data_plane.envoy.type.v3 import HttpStatus, StatusCode
from envoy_data_plane.google.protobuf import Struct, Value
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from .policy import Decision
from .proxy import NotHeld, Router, RoutingKey, error_body

logger = logging.getLogger("pagefleet_router.ext_proc")

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# The Endpoint Picker protocol's metadata namespaces and keys.
LB_NAMESPACE = "envoy.lb"
DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET = "x-gateway-destination-endpoint-subset"

_STORED_RESPONSE = re.compile(r"^/v1/responses/([^/]+)$")
# A response's `usage` is in its JSON's last bytes, or its stream's last events.
_USAGE_TAIL_BYTES = 4096
_USAGE_FIELDS = {
    "prompt": re.compile(rb'"prompt_tokens"\s*:\s*(\d+)'),
    "completion": re.compile(rb'"completion_tokens"\s*:\s*(\d+)'),
}


def endpoint(url: str) -> str:
    """A pod's `ip:port`, as the data plane names endpoints."""
    return urlsplit(url).netloc


class _Refusal(Exception):
    """The request is answered by the router itself (an immediate response)."""

    def __init__(self, status: int, message: str, code: str, kind: str = "server_error") -> None:
        super().__init__(message)
        self.status = status
        self.body = json.dumps(error_body(message, code, kind)).encode()

    @classmethod
    def from_response(cls, response: web.Response) -> _Refusal:
        refusal = cls(response.status, "", "")
        refusal.body = (response.text or "").encode()
        return refusal

    def response(self) -> ProcessingResponse:
        content_type = HeaderValue(key="content-type", raw_value=b"application/json")
        return ProcessingResponse(
            immediate_response=ImmediateResponse(
                status=HttpStatus(code=StatusCode(self.status)),
                headers=HeaderMutation(set_headers=[HeaderValueOption(header=content_type)]),
                body=self.body,
                details=f"pagefleet_router_{self.status}",
            )
        )


@dataclass
class _Exchange:
    """One HTTP request through the stream: what the router learnt of it so far."""

    path: str = "/"
    method: str = "GET"
    subset: frozenset[str] | None = None  # the data plane's subset hint, if any
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0
    answered: bool = False  # the destination was sent
    key: RoutingKey | None = None
    pod: str | None = None  # the pod holding this request in its in-flight count
    tail: bytes = b""  # the response's last bytes (its usage)


class EndpointPicker:
    """The ext_proc service: one `_Stream` per gRPC stream."""

    def __init__(self, router: Router, max_fallbacks: int = 2) -> None:
        if max_fallbacks < 0:
            raise ValueError(f"ext_proc fallbacks must be >= 0, got {max_fallbacks}")
        self.router = router
        self.max_fallbacks = max_fallbacks

    async def process(
        self, requests: AsyncIterator[ProcessingRequest], _context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ProcessingResponse]:
        stream = _Stream(self)
        try:
            async for message in requests:
                for response in await stream.handle(message):
                    yield response
        finally:
            stream.end_exchange()

    async def pick(self, exchange: _Exchange, key: RoutingKey) -> list[str]:
        """The pods' endpoints, the pick first; raises a `_Refusal` when none qualifies."""
        router = self.router
        if router.starting:
            try:
                await router.hold()
            except NotHeld as refused:
                raise _Refusal.from_response(refused.response) from None
        excluded = set()
        if exchange.subset is not None:
            excluded = {
                p.url for p in router.registry.states() if endpoint(p.url) not in exchange.subset
            }
        picks: list[Decision] = []
        while len(picks) <= self.max_fallbacks:
            decision = router.choose(key, exclude=excluded)
            if decision is None:
                break
            picks.append(decision)
            excluded.add(decision.url)
        if not picks:
            router.metrics.no_pod.inc()
            where = "in the endpoint subset hint" if exchange.subset is not None else "ready"
            raise _Refusal(503, f"no pod {where} could take the request", "no_pod_available")
        if picks[0].reason == "all_busy":
            router.metrics.shed.inc()
            limit = router.settings.policy.max_queue_depth
            raise _Refusal(
                429,
                f"every pod has more than {limit:g} requests waiting (router --max-queue-depth); "
                "retry later",
                "overloaded",
            )
        router.metrics.decisions.labels(picks[0].reason).inc()
        exchange.pod = picks[0].url
        router.registry.acquire(exchange.pod)
        return [endpoint(p.url) for p in picks]


class _Stream:
    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker
        self.router = picker.router
        # What Envoy sends of the bodies (its first message says; BUFFERED is the mode the
        # GIE guides used before full duplex).
        self.request_mode = BodyMode.BUFFERED
        self.response_mode = BodyMode.NONE
        self.exchange = _Exchange()

    async def handle(self, message: ProcessingRequest) -> list[ProcessingResponse]:
        if message.protocol_config is not None:
            self.request_mode = message.protocol_config.request_body_mode
            self.response_mode = message.protocol_config.response_body_mode
        try:
            if message.request_headers is not None:
                return await self._request_headers(
                    message.request_headers, message.metadata_context
                )
            if message.request_body is not None:
                return await self._request_body(message.request_body)
            if message.request_trailers is not None:
                return await self._request_trailers()
            if message.response_headers is not None:
                return self._response_headers(message.response_headers, message.metadata_context)
            if message.response_body is not None:
                return self._response_body(message.response_body)
            if message.response_trailers is not None:
                return [ProcessingResponse(response_trailers=TrailersResponse())]
        except _Refusal as refusal:
            self.end_exchange()
            return [refusal.response()]
        return []

    async def _request_headers(
        self, headers: HttpHeaders, metadata: Metadata | None
    ) -> list[ProcessingResponse]:
        self.end_exchange()
        if self.request_mode == BodyMode.STREAMED:
            raise _Refusal(
                500,
                "the Endpoint Picker needs the whole body before the request headers go "
                "upstream: set the ext_proc request_body_mode to FULL_DUPLEX_STREAMED or "
                "BUFFERED, not STREAMED",
                "unsupported_processing_mode",
            )
        fields = _header_map(headers)
        self.exchange = _Exchange(
            path=fields.get(":path", "/").split("?", 1)[0],
            method=fields.get(":method", "GET"),
            subset=_subset(metadata),
        )
        if headers.end_of_stream or self.request_mode == BodyMode.NONE:
            return [await self._destination(headers_answer=True)]
        if self.request_mode == BodyMode.FULL_DUPLEX_STREAMED:
            return []  # answered with the destination once the body has arrived
        return [ProcessingResponse(request_headers=HeadersResponse())]

    async def _request_body(self, body: HttpBody) -> list[ProcessingResponse]:
        exchange = self.exchange
        exchange.chunks.append(body.body)
        exchange.size += len(body.body)
        limit = self.router.settings.max_request_body_bytes
        if exchange.size > limit:
            raise _Refusal(
                413,
                f"the request body is larger than this server accepts ({limit} bytes; "
                "router --max-request-body-bytes)",
                "request_too_large",
                "invalid_request_error",
            )
        # BUFFERED sends the whole body (BUFFERED_PARTIAL as much as Envoy buffers) at once.
        if body.end_of_stream or self.request_mode != BodyMode.FULL_DUPLEX_STREAMED:
            return await self._answer_body(end_of_stream=True)
        return []

    async def _request_trailers(self) -> list[ProcessingResponse]:
        responses = []
        if not self.exchange.answered and self.request_mode == BodyMode.FULL_DUPLEX_STREAMED:
            responses = await self._answer_body(end_of_stream=False)
        return [*responses, ProcessingResponse(request_trailers=TrailersResponse())]

    async def _answer_body(self, end_of_stream: bool) -> list[ProcessingResponse]:
        if self.request_mode != BodyMode.FULL_DUPLEX_STREAMED:
            return [await self._destination(headers_answer=False)]
        chunks = self.exchange.chunks or [b""]
        replayed = [
            ProcessingResponse(
                request_body=BodyResponse(
                    response=CommonResponse(
                        body_mutation=BodyMutation(
                            streamed_response=StreamedBodyResponse(
                                body=chunk, end_of_stream=end_of_stream and i == len(chunks) - 1
                            )
                        )
                    )
                )
            )
            for i, chunk in enumerate(chunks)
        ]
        return [await self._destination(headers_answer=True), *replayed]

    async def _destination(self, headers_answer: bool) -> ProcessingResponse:
        """The answer that names the pods: to the request headers or to the body."""
        exchange = self.exchange
        exchange.key = self._routing_key(b"".join(exchange.chunks))
        endpoints = ",".join(await self.picker.pick(exchange, exchange.key))
        exchange.answered = True
        header = HeaderValue(key=DESTINATION, raw_value=endpoints.encode())
        common = CommonResponse(
            header_mutation=HeaderMutation(set_headers=[HeaderValueOption(header=header)])
        )
        metadata = Struct(
            fields={
                LB_NAMESPACE: Value(
                    struct_value=Struct(fields={DESTINATION: Value(string_value=endpoints)})
                )
            }
        )
        if headers_answer:
            return ProcessingResponse(
                request_headers=HeadersResponse(response=common), dynamic_metadata=metadata
            )
        return ProcessingResponse(
            request_body=BodyResponse(response=common), dynamic_metadata=metadata
        )

    def _routing_key(self, body: bytes) -> RoutingKey:
        exchange = self.exchange
        stored = _STORED_RESPONSE.match(exchange.path)
        if stored and exchange.method in ("GET", "DELETE"):
            return RoutingKey([], None, stored.group(1))
        if not body and exchange.method == "GET":
            return RoutingKey([], None, None)
        key = self.router.routing_key(exchange.path, body)
        if key is None:
            raise _Refusal(
                400,
                "the request body is not a JSON object (an OpenAI request)",
                "invalid_json",
                "invalid_request_error",
            )
        return key

    def _response_headers(
        self, headers: HttpHeaders, metadata: Metadata | None
    ) -> list[ProcessingResponse]:
        exchange = self.exchange
        served = self._served_pod(metadata)
        if served is not None and exchange.pod is not None and served != exchange.pod:
            self.router.registry.release(exchange.pod)
            self.router.registry.acquire(served)
            exchange.pod = served
        status = _header_map(headers).get(":status", "0")
        if exchange.pod is not None:
            self.router.metrics.requests.labels(exchange.pod, status).inc()
            self.router.registry.record_answer(exchange.pod, int(status) if status.isdigit() else 0)
            if status == "200" and exchange.key is not None:
                self.router.prefix_table.record(exchange.key.hashes, exchange.pod)
        if headers.end_of_stream:
            self.end_exchange()
        return [ProcessingResponse(response_headers=HeadersResponse())]

    def _response_body(self, body: HttpBody) -> list[ProcessingResponse]:
        exchange = self.exchange
        exchange.tail = (exchange.tail + body.body)[-_USAGE_TAIL_BYTES:]
        if body.end_of_stream:
            self._count_usage()
            self.end_exchange()
        if self.response_mode != BodyMode.FULL_DUPLEX_STREAMED:
            return [ProcessingResponse(response_body=BodyResponse())]
        streamed = StreamedBodyResponse(body=body.body, end_of_stream=body.end_of_stream)
        return [
            ProcessingResponse(
                response_body=BodyResponse(
                    response=CommonResponse(body_mutation=BodyMutation(streamed_response=streamed))
                )
            )
        ]

    def _served_pod(self, metadata: Metadata | None) -> str | None:
        values = _metadata_values(metadata, LB_NAMESPACE, SERVED)
        if not values:
            return None
        by_endpoint = {endpoint(p.url): p.url for p in self.router.registry.states()}
        return by_endpoint.get(values[0])

    def _count_usage(self) -> None:
        exchange = self.exchange
        if exchange.pod is None:
            return
        for kind, pattern in _USAGE_FIELDS.items():
            found = pattern.findall(exchange.tail)
            if found:
                self.router.metrics.usage_tokens.labels(exchange.pod, kind).inc(int(found[-1]))

    def end_exchange(self) -> None:
        """The request is over (answered, refused, or the stream closed)."""
        if self.exchange.pod is not None:
            self.router.registry.release(self.exchange.pod)
        self.exchange = _Exchange()


def _header_map(headers: HttpHeaders) -> dict[str, str]:
    """Envoy sends a header's value in raw_value (bytes), older versions in value."""
    if headers.headers is None:
        return {}
    return {
        h.key.lower(): h.raw_value.decode(errors="replace") if h.raw_value else h.value
        for h in headers.headers.headers
    }


def _metadata_values(metadata: Metadata | None, namespace: str, key: str) -> list[str] | None:
    """A filter metadata entry as strings: a list's items, or a comma-separated string's
    parts; None when the entry is absent."""
    if metadata is None or namespace not in metadata.filter_metadata:
        return None
    entry = metadata.filter_metadata[namespace].fields.get(key)
    if entry is None:
        return None
    if entry.list_value is not None:
        return [v.string_value for v in entry.list_value.values if v.string_value]
    if entry.string_value is not None:
        return [part.strip() for part in entry.string_value.split(",") if part.strip()]
    return []


def _subset(metadata: Metadata | None) -> frozenset[str] | None:
    values = _metadata_values(metadata, SUBSET_NAMESPACE, SUBSET)
    return None if values is None else frozenset(values)


class ExtProcServer:
    """The gRPC server beside the router's HTTP one, on the same event loop."""

    def __init__(self, router: Router, host: str, port: int, max_fallbacks: int = 2) -> None:
        self.router = router
        self.address = f"{host}:{port}"
        self.picker = EndpointPicker(router, max_fallbacks)
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._readiness: asyncio.Task | None = None

    def attach(self, app: web.Application) -> None:
        """Start and stop with the router's HTTP app."""
        app.on_startup.append(lambda _app: self.start())
        app.on_cleanup.append(lambda _app: self.stop())

    async def start(self) -> None:
        server = self._server = grpc.aio.server()
        process = grpc.stream_stream_rpc_method_handler(
            self.picker.process,
            request_deserializer=ProcessingRequest.FromString,
            response_serializer=ProcessingResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {"Process": process}),)
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self.port = server.add_insecure_port(self.address)
        await server.start()
        await self.health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        self._readiness = asyncio.create_task(self._track_readiness())
        logger.info("Endpoint Picker (ext_proc gRPC) on port %d", self.port)

    async def _track_readiness(self) -> None:
        """Ready (and the service with it) while the HTTP /ready would answer 200."""
        while True:
            ready = self.router.is_ready()
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if ready
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            for service in ("readiness", SERVICE):
                await self.health.set(service, status)
            await asyncio.sleep(min(self.router.settings.scrape.interval_s, 1.0))

    async def stop(self) -> None:
        if self._readiness is not None:
            self._readiness.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._readiness
        await self.health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace=5)
