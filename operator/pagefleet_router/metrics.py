"""The router's own /metrics (a registry of its own, so a test process can hold many)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .policy import REASONS


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pagefleet:router_requests",
            "Requests forwarded, by pod and the pod's status code.",
            ("pod", "code"),
            registry=self.registry,
        )
        self.decisions = Counter(
            "pagefleet:router_routing_decisions",
            "Routing decisions by reason.",
            ("reason",),
            registry=self.registry,
        )
        for reason in REASONS:
            self.decisions.labels(reason)
        self.retries = Counter(
            "pagefleet:router_retries",
            "Requests retried on another pod after a failure before the first byte.",
            registry=self.registry,
        )
        self.stream_errors = Counter(
            "pagefleet:router_upstream_errors_after_first_byte",
            "Responses cut short by a pod failure after their first byte.",
            registry=self.registry,
        )
        self.no_pod = Counter(
            "pagefleet:router_no_pod",
            "Requests answered 503 because no pod could take them.",
            registry=self.registry,
        )
        self.pods = Gauge(
            "pagefleet:router_pods",
            "Pods discovered, and of those with fresh metrics.",
            ("state",),
            registry=self.registry,
        )
        self.routing_time = Histogram(
            "pagefleet:router_time_to_upstream_headers_seconds",
            "From the request's arrival to the chosen pod's response headers, retries included.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
