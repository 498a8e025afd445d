"""OpenTelemetry traces for the operator and the router (`--otlp-traces-endpoint`, vLLM's
flag name): a tracer of their own exporting over OTLP/HTTP in batches, or None when off.

The SDK is imported only when tracing is on: with it off neither process loads it, and
the code on their hot paths checks one None. The provider is not installed process-wide,
so nothing else in the process changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

INSTALL_HINT = "pip install 'pagefleet[tracing]' (opentelemetry-sdk and its OTLP/HTTP exporter)"


def get_tracer(endpoint: str | None, service_name: str) -> Any | None:
    """A tracer exporting to `endpoint` (e.g. http://collector:4318/v1/traces), or None."""
    if not endpoint:
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise ValueError(f"--otlp-traces-endpoint needs OpenTelemetry: {INSTALL_HINT}") from exc
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider.get_tracer(service_name)


@contextlib.contextmanager
def maybe_span(
    tracer: Any | None, name: str, attributes: Mapping[str, Any], **options: Any
) -> Iterator[Any | None]:
    """A span from `tracer` (made current), or None with tracing off."""
    if tracer is None:
        yield None
        return
    with tracer.start_as_current_span(name, attributes=dict(attributes), **options) as span:
        yield span
