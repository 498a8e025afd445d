"""The router's own /metrics (a registry of its own, so a test process can hold many)."""

from __future__ import annotations

from pagefleet_serve import metric_names as names
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
        self.shed = Counter(
            "pagefleet:router_shed",
            "Endpoint Picker requests answered 429 because every pod's queue was over the limit.",
            registry=self.registry,
        )
        self.usage_tokens = Counter(
            "pagefleet:router_usage_tokens",
            "Tokens of the responses the Endpoint Picker saw pass (their `usage`), by pod "
            "and kind (prompt, completion).",
            ("pod", "kind"),
            registry=self.registry,
        )
        self.kv_blocks = Gauge(
            "pagefleet:router_kv_cached_blocks",
            "Blocks each pod's KV cache holds, as its KV events told (precise routing).",
            ("pod",),
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

        # The operator's autoscaler reads it (a model scaled to zero with requests held).
        self.held = Gauge(
            names.ROUTER_HELD_REQUESTS,
            "Requests waiting for the first ready pod (the service scaled to zero or starting).",
            registry=self.registry,
        )
        self.hold_time = Histogram(
            "pagefleet:router_hold_time_seconds",
            "Time a request waited for the first ready pod, whatever the outcome.",
            buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=self.registry,
        )
        self.not_held = Counter(
            "pagefleet:router_hold_refusals",
            "Requests answered 503 while no pod was ready: queue_full or timeout.",
            ("reason",),
            registry=self.registry,
        )
        for reason in ("queue_full", "timeout"):
            self.not_held.labels(reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)
