"""Monitoring in the operator: the PodMonitor it plans (only when asked for, only where the
Prometheus Operator's CRD is served), and its own /metrics after reconciles and
autoscaler rounds, read over real HTTP."""

from __future__ import annotations

import logging
import socket
import urllib.request

import pytest
from pagefleet_operator import handlers
from pagefleet_operator.__main__ import get_parser
from pagefleet_operator.autoscale import PodSample
from pagefleet_operator.config import OperatorConfig
from pagefleet_operator.deployment import get_deployment
from pagefleet_operator.kube import KubeError
from pagefleet_operator.podmonitor import get_pod_monitor
from pagefleet_operator.reconcile import reconcile
from pagefleet_operator.scaler import autoscale_once
from pagefleet_operator.spec import SpecError, parse_spec
from pagefleet_operator.telemetry import OperatorMetrics
from prometheus_client.parser import text_string_to_metric_families

from tests.operator.operator_samples import DEFAULT_IMAGE, make_body
from tests.operator.test_operator_reconcile import BUILTIN, FakeKube, condition, run

MONITORED = {**BUILTIN, "monitoring": {"podMonitor": True}}


class ClusterKube(FakeKube):
    """The test double plus API discovery: which optional CRDs the cluster serves."""

    def __init__(self, body: dict, served: tuple[str, ...] = ("monitoring.coreos.com/v1",)):
        super().__init__(body)
        self.served = served
        self.discovery: list[tuple[str, str]] = []
        self.discovery_error: KubeError | None = None

    def discovers(self, api_version: str, plural: str) -> bool:
        self.discovery.append((api_version, plural))
        if self.discovery_error is not None:
            raise self.discovery_error
        return api_version in self.served


def test_the_pod_monitor_scrapes_the_serving_pods_named_port():
    body = make_body(
        {
            **BUILTIN,
            "monitoring": {
                "podMonitor": True,
                "podMonitorLabels": {
                    "release": "kube-prometheus-stack",
                    "app.kubernetes.io/managed-by": "someone-else",
                },
            },
        }
    )
    spec = parse_spec(body["spec"], default_image=DEFAULT_IMAGE)
    monitor = get_pod_monitor(body, spec)
    pod = get_deployment(body, spec)["spec"]["template"]
    # Its selector picks exactly the serving pods, on the port that serves /metrics.
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    ports = [p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])]
    assert endpoint == {"port": "http", "path": "/metrics"} and "http" in ports
    labels = monitor["metadata"]["labels"]
    assert labels["release"] == "kube-prometheus-stack"
    assert labels["app.kubernetes.io/managed-by"] == "pagefleet-operator"  # ours win
    assert monitor["metadata"]["ownerReferences"][0]["uid"] == "uid-demo"


def test_no_pod_monitor_unless_asked_and_no_discovery_then():
    kube = ClusterKube(make_body(BUILTIN))
    run(kube)
    assert kube.get("PodMonitor", "ml", "demo") is None
    assert kube.discovery == []
    assert "Monitored" not in [c["type"] for c in kube.body()["status"]["conditions"]]


def test_pod_monitor_created_where_served_and_removed_when_turned_off():
    kube = ClusterKube(make_body(MONITORED))
    outcome = run(kube)
    assert ("created", "PodMonitor") in [(c.verb, c.kind) for c in outcome.changes]
    assert kube.get("PodMonitor", "ml", "demo")["apiVersion"] == "monitoring.coreos.com/v1"
    assert kube.discovery == [("monitoring.coreos.com/v1", "podmonitors")]
    monitored = condition(kube, "Monitored")
    assert (monitored["status"], monitored["reason"]) == ("True", "PodMonitorApplied")
    assert run(kube).changes == ()  # idempotent

    body = kube.body()
    body["spec"]["monitoring"]["podMonitor"] = False
    kube.put("InferenceService", body)
    outcome = run(kube)
    assert [(c.verb, c.kind) for c in outcome.changes] == [("deleted", "PodMonitor")]
    assert kube.get("PodMonitor", "ml", "demo") is None
    assert "Monitored" not in [c["type"] for c in kube.body()["status"]["conditions"]]


def test_a_missing_crd_is_a_condition_not_a_failure():
    kube = ClusterKube(make_body(MONITORED), served=())
    outcome = run(kube)
    assert [c.kind for c in outcome.changes] == ["Deployment", "Service"]
    assert ("apply", "PodMonitor", "demo") not in kube.writes
    monitored = condition(kube, "Monitored")
    assert (monitored["status"], monitored["reason"]) == ("False", "PodMonitorCRDMissing")
    assert "spec.monitoring.podMonitor" in monitored["message"]
    assert condition(kube, "Degraded")["status"] == "False"  # the pods still serve

    kube.served = ("monitoring.coreos.com/v1",)  # the Prometheus Operator got installed
    run(kube)
    assert kube.get("PodMonitor", "ml", "demo") is not None
    assert condition(kube, "Monitored")["status"] == "True"


def test_api_trouble_in_discovery_is_a_retry_not_a_missing_crd():
    kube = ClusterKube(make_body(MONITORED))
    run(kube)
    kube.discovery_error = KubeError(503, "discovery unavailable")
    with pytest.raises(KubeError):
        run(kube)
    assert condition(kube, "Monitored")["status"] == "True"  # unchanged
    assert kube.get("PodMonitor", "ml", "demo") is not None  # not deleted either


def test_the_operator_default_applies_only_where_the_spec_is_silent():
    on = {"default_image": DEFAULT_IMAGE, "pod_monitor_default": True, "now": lambda: "T"}
    kube = ClusterKube(make_body(BUILTIN))
    reconcile(kube, kube.body(), **on)
    assert kube.get("PodMonitor", "ml", "demo") is not None
    kube = ClusterKube(make_body({**BUILTIN, "monitoring": {"podMonitor": False}}))
    reconcile(kube, kube.body(), **on)
    assert kube.get("PodMonitor", "ml", "demo") is None

    config = OperatorConfig(default_image=DEFAULT_IMAGE, pod_monitor_default=True)
    assert config.spec_options()["pod_monitor_default"] is True
    args = get_parser().parse_args(["--pod-monitor-by-default", "--metrics-port", "9100"])
    assert args.pod_monitor_by_default and args.metrics_port == 9100
    # Off unless asked: test operators and local runs never fight over a port.
    default = get_parser().parse_args([])
    assert not default.pod_monitor_by_default and default.metrics_port == 0


def test_bad_pod_monitor_labels_name_the_field():
    spec = {**BUILTIN, "monitoring": {"podMonitorLabels": {"release": 1}}}
    with pytest.raises(SpecError, match=r"spec\.monitoring\.podMonitorLabels\.release"):
        parse_spec(spec, default_image=DEFAULT_IMAGE)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_operator_metrics_over_http_after_reconciles_and_autoscaling(monkeypatch):
    import kopf

    warnings = []  # kopf posts Events only inside a running operator
    monkeypatch.setattr(kopf, "warn", lambda body, reason, message: warnings.append(reason))
    metrics = OperatorMetrics()
    port = free_port()
    metrics.serve(port, "127.0.0.1")
    spec = {**BUILTIN, "replicas": 2, "autoscaling": {"enabled": True, "maxReplicas": 6}}
    kube = ClusterKube(make_body(spec))
    memo = {
        "kube": kube,
        "config": OperatorConfig(default_image=DEFAULT_IMAGE),
        "metrics": metrics,
    }
    log = logging.getLogger("test")
    handlers._reconcile(kube.body(), memo, log)  # creates: applied
    kube.mark_deployment_ready(2)
    handlers._reconcile(kube.body(), memo, log)  # status only: unchanged
    kube.fail_apply = KubeError(422, "spec.template: Invalid value")
    handlers._reconcile(kube.body(), memo, log)  # refused: degraded, by kind
    kube.fail_apply = None
    assert warnings == ["ApplyFailed"]

    busy = [PodSample("a", True, 0.95, 10), PodSample("b", True)]  # b: scrape failed
    decision = autoscale_once(
        kube, kube.body(), default_image=DEFAULT_IMAGE, scrape=lambda _: busy, clock=lambda: 1e9
    )
    metrics.record_autoscale("ml", "demo", decision, 1e9)

    series = scrape(port)
    demo = (("inferenceservice", "demo"), ("namespace", "ml"))
    total = "pagefleet_operator_reconciles_total"
    assert series[(total, (("result", "applied"),))] == 1
    assert series[(total, (("result", "unchanged"),))] == 1
    assert series[(total, (("result", "degraded"),))] == 1
    assert series[("pagefleet_operator_apply_errors_total", (("kind", "Deployment"),))] == 1
    assert series[("pagefleet_operator_desired_replicas", demo)] == 2
    assert series[("pagefleet_operator_ready_replicas", demo)] == 2
    assert series[("pagefleet_operator_scrapes_total", demo)] == 2
    assert series[("pagefleet_operator_scrape_failures_total", demo)] == 1
    assert series[("pagefleet_operator_last_successful_scrape_timestamp_seconds", demo)] == 1e9
    # One pod of two reports, with 10 waiting: 3 replicas by queue depth (target 4 each).
    assert (decision.replicas, decision.direction, decision.signal) == (3, "up", "queue_depth")
    assert series[("pagefleet_operator_autoscaler_recommended_replicas", demo)] == (
        decision.recommended
    )
    decision_key = tuple(
        sorted((*demo, ("direction", decision.direction), ("signal", decision.signal)))
    )
    assert series[("pagefleet_operator_autoscaler_decisions_total", decision_key)] == 1

    handlers.forget_service(body=kube.body(), memo=memo)
    names = {name for name, labels in scrape(port) if ("inferenceservice", "demo") in labels}
    assert names == set()


@pytest.mark.parametrize(
    ("samples", "current", "direction", "signal"),
    [
        ([PodSample("a", True, 0.1, 12)], 1, "up", "queue_depth"),
        ([PodSample("a", True, 0.95, 0)], 1, "up", "kv_cache"),
        ([PodSample("a", True)], 1, "hold", "no_metrics"),
        ([PodSample("a", True, 0.1, 0), PodSample("b", True)], 2, "hold", "missing_metrics"),
    ],
)
def test_autoscaler_decisions_name_their_signal(samples, current, direction, signal):
    spec = {**BUILTIN, "replicas": current, "autoscaling": {"enabled": True}}
    kube = FakeKube(make_body(spec))
    decision = autoscale_once(
        kube, kube.body(), default_image=DEFAULT_IMAGE, scrape=lambda _: samples, clock=lambda: 1e9
    )
    assert (decision.direction, decision.signal) == (direction, signal), decision.reason
