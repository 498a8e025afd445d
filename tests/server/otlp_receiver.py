"""An OTLP/HTTP trace receiver on loopback for the tracing tests (not a test module): it
decodes the real protobuf exports the OpenTelemetry SDK sends."""

from __future__ import annotations

import http.server
import threading

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as trace_service

SPAN_KIND_SERVER = 2  # opentelemetry.proto.trace.v1.Span.SpanKind
SPAN_KIND_INTERNAL = 1


class OTLPReceiver(http.server.ThreadingHTTPServer):
    """The trace half of an OpenTelemetry collector's OTLP/HTTP receiver (protobuf)."""

    def __init__(self) -> None:
        self.spans: list = []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = trace_service.ExportTraceServiceRequest.FromString(body)
                for resource_spans in request.resource_spans:
                    for scope_spans in resource_spans.scope_spans:
                        receiver.spans.extend(scope_spans.spans)
                reply = trace_service.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *_) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}/v1/traces"
        threading.Thread(target=self.serve_forever, daemon=True).start()


def attributes(span) -> dict:
    values = {}
    for item in span.attributes:
        value = item.value
        values[item.key] = getattr(value, value.WhichOneof("value"))
    return values
