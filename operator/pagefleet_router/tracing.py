"""Router request spans (`--otlp-traces-endpoint`): one server span per forwarded request,
parented by the client's `traceparent`, whose own context goes to the pod in the
`traceparent` it forwards, so a trace runs client -> router -> the pod's `llm_request`.
Built only when tracing is on (the operator image may lack OpenTelemetry otherwise)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, MutableMapping
from typing import Any

from aiohttp import web

SPAN_NAME = "router_request"
_CONTEXT_HEADERS = ("traceparent", "tracestate")


class RequestTracing:
    def __init__(self, tracer: Any) -> None:
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.tracer = tracer
        self.kind = SpanKind.SERVER
        self.propagator = TraceContextTextMapPropagator()

    @contextlib.contextmanager
    def span(self, request: web.Request) -> Iterator[Any]:
        carrier = {key.lower(): value for key, value in request.headers.items()}
        parent = self.propagator.extract(carrier)
        attributes = {"http.request.method": request.method, "url.path": request.path}
        with self.tracer.start_as_current_span(
            SPAN_NAME, context=parent, kind=self.kind, attributes=attributes
        ) as span:
            yield span

    def inject(self, headers: MutableMapping[str, str]) -> None:
        """Replace the client's trace context with the current (router) span's."""
        for key in [k for k in headers if k.lower() in _CONTEXT_HEADERS]:
            del headers[key]
        self.propagator.inject(headers)
