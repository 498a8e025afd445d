"""The operator's own Prometheus series, served on its /metrics (`--metrics-port`).

Per-resource series carry `namespace` and `inferenceservice` labels and are removed when
the resource is deleted. Autoscaler reasons are a short fixed vocabulary (Decision.signal),
never the free-text reason, so the series count stays bounded.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from .autoscale import Decision
from .reconcile import Outcome

PREFIX = "pagefleet_operator"
RESOURCE_LABELS = ("namespace", "inferenceservice")


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()

        def counter(name: str, doc: str, labels: tuple[str, ...]) -> Counter:
            return Counter(f"{PREFIX}_{name}", doc, labels, registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"{PREFIX}_{name}", doc, RESOURCE_LABELS, registry=self.registry)

        self.reconciles = counter(
            "reconciles",
            "Reconciliations by result: applied (something was written), unchanged, "
            "degraded (a problem in the spec or the cluster) or error (API trouble, retried).",
            ("result",),
        )
        self.apply_errors = counter(
            "apply_errors", "Writes of a child object the API server refused, by kind.", ("kind",)
        )
        self.scrapes = counter(
            "scrapes", "Scrapes of ready serving pods' /metrics by the autoscaler.", RESOURCE_LABELS
        )
        self.scrape_failures = counter(
            "scrape_failures",
            "Scrapes of ready serving pods that gave no usable metrics.",
            RESOURCE_LABELS,
        )
        self.last_scrape = gauge(
            "last_successful_scrape_timestamp_seconds",
            "When the autoscaler last read metrics from at least one pod (time() minus this "
            "is the age of its data).",
        )
        self.recommended = gauge(
            "autoscaler_recommended_replicas", "The autoscaler's latest recommendation."
        )
        self.decisions = counter(
            "autoscaler_decisions",
            "Autoscaler rounds by direction (up, down, hold, stabilizing) and by the signal "
            "that set the recommendation (kv_cache, queue_depth, no_metrics, missing_metrics, "
            "idle, scaled_to_zero, held_requests).",
            (*RESOURCE_LABELS, "direction", "signal"),
        )
        self.desired_replicas = gauge("desired_replicas", "Replicas the spec asks for.")
        self.ready_replicas = gauge("ready_replicas", "Ready serving pods.")

    def serve(self, port: int, address: str = "0.0.0.0") -> None:
        """Serve /metrics from a daemon thread; kopf's own health endpoint is separate."""
        start_http_server(port, address, registry=self.registry)

    def record_reconcile(self, namespace: str, name: str, outcome: Outcome) -> None:
        if outcome.failed_kind is not None:
            self.apply_errors.labels(outcome.failed_kind).inc()
        if outcome.problem is not None:
            result = "degraded"
        else:
            result = "applied" if outcome.changes else "unchanged"
        self.reconciles.labels(result).inc()
        self.desired_replicas.labels(namespace, name).set(outcome.desired_replicas)
        self.ready_replicas.labels(namespace, name).set(outcome.ready_replicas)

    def record_reconcile_error(self, kind: str | None) -> None:
        """API trouble; `kind` when it was a write of that kind that failed."""
        if kind is not None:
            self.apply_errors.labels(kind).inc()
        self.reconciles.labels("error").inc()

    def record_autoscale(self, namespace: str, name: str, decision: Decision, now: float) -> None:
        attempts = decision.scraped_pods + decision.unscraped_pods
        self.scrapes.labels(namespace, name).inc(attempts)
        self.scrape_failures.labels(namespace, name).inc(decision.unscraped_pods)
        if decision.scraped_pods:
            self.last_scrape.labels(namespace, name).set(now)
        self.recommended.labels(namespace, name).set(decision.recommended)
        self.decisions.labels(namespace, name, decision.direction, decision.signal).inc()

    def forget(self, namespace: str, name: str) -> None:
        """Drop a deleted resource's series, so they stop being exported."""
        labels = {"namespace": namespace, "inferenceservice": name}
        for metric in (
            self.scrapes,
            self.scrape_failures,
            self.last_scrape,
            self.recommended,
            self.decisions,
            self.desired_replicas,
            self.ready_replicas,
        ):
            metric.remove_by_labels(labels)
