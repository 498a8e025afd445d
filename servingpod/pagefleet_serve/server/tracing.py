"""OpenTelemetry request traces (`--otlp-traces-endpoint`): one span per generation request.

The span is named and attributed as vLLM's (`llm_request`, `gen_ai.*`), so a trace viewer
set up for vLLM reads ours; its parent comes from the request's W3C `traceparent` header
(set by a router or any traced client). opentelemetry is imported only when tracing is
on; when off, the one hook left on the request path (`record_finished`) reads a context
variable and returns.
"""

from __future__ import annotations

import contextvars
import logging
from dataclasses import dataclass
from typing import Any

from pagefleet_serve.outputs import RequestOutput

logger = logging.getLogger(__name__)

SPAN_NAME = "llm_request"
# Only generation requests are traced; health probes and scrapes would be noise.
TRACED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
INSTALL_HINT = "pip install 'pagefleet[tracing]' (opentelemetry-sdk and its OTLP/HTTP exporter)"


@dataclass
class _RequestSpan:
    span: Any  # an opentelemetry Span
    completion_tokens: int = 0  # over every choice (n > 1 runs one engine request each)


_current: contextvars.ContextVar[_RequestSpan | None] = contextvars.ContextVar(
    "pagefleet_request_span", default=None
)


def record_finished(output: RequestOutput, num_generated: int, model_name: str) -> None:
    """Put a finished engine request's numbers on its HTTP request's span, if traced."""
    traced = _current.get()
    if traced is None:
        return
    traced.completion_tokens += num_generated
    attributes: dict[str, Any] = {
        "gen_ai.request.id": output.request_id,
        "gen_ai.response.model": model_name,
        "gen_ai.usage.prompt_tokens": len(output.prompt_token_ids),
        "gen_ai.usage.completion_tokens": traced.completion_tokens,
    }
    t = output.metrics
    if t is not None and t.finished_time is not None:
        attributes["gen_ai.latency.e2e"] = t.finished_time - t.arrival_time
        if t.first_token_time is not None:
            attributes["gen_ai.latency.time_to_first_token"] = t.first_token_time - t.arrival_time
            attributes["gen_ai.latency.time_in_model_decode"] = t.finished_time - t.first_token_time
        if t.first_scheduled_time is not None:
            attributes["gen_ai.latency.time_in_queue"] = t.first_scheduled_time - t.arrival_time
            attributes["gen_ai.latency.time_in_model_inference"] = (
                t.finished_time - t.first_scheduled_time
            )
            if t.first_token_time is not None:
                attributes["gen_ai.latency.time_in_model_prefill"] = (
                    t.first_token_time - t.first_scheduled_time
                )
    traced.span.set_attributes(attributes)


class TracingMiddleware:
    """ASGI middleware: a server span around each generation request, parented by its
    `traceparent`. Pure ASGI (not BaseHTTPMiddleware) so the span's context reaches the
    tasks that stream the engine's outputs."""

    def __init__(self, app: Any, tracer: Any) -> None:
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.app = app
        self.tracer = tracer
        self.kind = SpanKind.SERVER
        self.propagator = TraceContextTextMapPropagator()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] not in TRACED_PATHS:
            await self.app(scope, receive, send)
            return
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        parent = self.propagator.extract(carrier)
        with self.tracer.start_as_current_span(SPAN_NAME, context=parent, kind=self.kind) as span:
            token = _current.set(_RequestSpan(span))
            try:
                await self.app(scope, receive, send)
            finally:
                _current.reset(token)


def install_tracing(app: Any, endpoint: str | None) -> None:
    """With an OTLP/HTTP endpoint (e.g. http://collector:4318/v1/traces), trace requests.

    The tracer provider is the app's own, not OpenTelemetry's process-wide one: nothing
    else in the process is changed. Spans leave in batches from a background thread.
    """
    if not endpoint:
        return
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise ValueError(f"--otlp-traces-endpoint needs OpenTelemetry: {INSTALL_HINT}") from exc
    provider = TracerProvider(resource=Resource.create({"service.name": "pagefleet-serve"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    app.add_middleware(TracingMiddleware, tracer=provider.get_tracer("pagefleet_serve"))
    logger.info("tracing requests to %s", endpoint)
