"""Monitoring objects of the chart (the operator's ServiceMonitor, the Grafana dashboard
ConfigMap) and the operator's PodMonitor: rendered only when enabled, and valid for the
Prometheus Operator's CRD schema (vendored in prometheus_operator_crds.yaml)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from pagefleet_operator.__main__ import get_parser
from pagefleet_operator.podmonitor import get_pod_monitor
from pagefleet_operator.service import get_service
from pagefleet_operator.spec import parse_spec

from tests.chart.chart_render import (
    CHART_DIR,
    K8S_VERSIONS,
    NAMESPACE,
    find,
    helm,
    operator_container,
    render,
    the,
)

SCHEMAS = yaml.safe_load((Path(__file__).parent / "prometheus_operator_crds.yaml").read_text())
MONITORING_KINDS = ("ServiceMonitor", "PodMonitor")
ENABLED = {
    "operator": {"serviceMonitor": {"enabled": True, "interval": "30s", "labels": {"r": "kps"}}},
    "grafanaDashboard": {"enabled": True, "labels": {"grafana_folder": "LLM"}},
    "servingPod": {"podMonitorByDefault": True},
}


def validate_monitor(obj: dict) -> None:
    schema = {**SCHEMAS[obj["kind"]], "definitions": SCHEMAS["definitions"]}
    jsonschema.Draft7Validator(schema).validate(obj)


def test_nothing_for_monitoring_by_default():
    objects = render()
    assert [o for o in objects if o["kind"] in MONITORING_KINDS] == []
    assert find(objects, "ConfigMap") == []
    args = get_parser().parse_args(operator_container(objects)["args"])
    assert not args.pod_monitor_by_default
    assert args.metrics_port == 8081  # the chart always serves the operator's /metrics


def test_the_service_monitor_scrapes_the_operators_metrics_port():
    objects = render(ENABLED)
    monitor = the(objects, "ServiceMonitor")
    validate_monitor(monitor)
    service = the(objects, "Service")
    # It selects the operator's Service, on the port that reaches the container's /metrics.
    assert monitor["spec"]["selector"]["matchLabels"].items() <= (
        service["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in [p["name"] for p in service["spec"]["ports"]]
    assert (endpoint["interval"], endpoint["honorLabels"]) == ("30s", True)
    assert monitor["metadata"]["labels"]["r"] == "kps"
    container = operator_container(objects)
    args = get_parser().parse_args(container["args"])
    assert args.pod_monitor_by_default
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    assert {"name": port["targetPort"], "containerPort": args.metrics_port, "protocol": "TCP"} in (
        container["ports"]
    )


def test_the_router_service_monitor_finds_the_operators_router_services():
    objects = render({"router": {"serviceMonitor": {"enabled": True, "interval": "15s"}}})
    (monitor,) = [
        o for o in find(objects, "ServiceMonitor") if o["metadata"]["name"].endswith("-routers")
    ]
    validate_monitor(monitor)
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == ("http", "/metrics", "15s")
    # The Service the operator builds for a routed InferenceService, and only that one.
    body = {
        "apiVersion": "pagefleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "ml", "uid": "u1"},
    }
    selector = monitor["spec"]["selector"]["matchLabels"].items()
    for routed in (True, False):
        spec = parse_spec(
            {"model": {"uri": "builtin://smollm2-135m"}, "router": {"enabled": routed}},
            default_image="x",
        )
        service = get_service(body, spec)
        assert (selector <= service["metadata"]["labels"].items()) is routed
        assert endpoint["port"] in [p["name"] for p in service["spec"]["ports"]]
    namespaced = render(
        {
            "router": {"serviceMonitor": {"enabled": True}},
            "operator": {"watchNamespaces": ["team-a"]},
        }
    )
    (monitor,) = [o for o in find(namespaced, "ServiceMonitor")]
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a"]}


def test_the_operators_pod_monitor_is_valid_for_the_crd():
    body = {
        "apiVersion": "pagefleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "ml", "uid": "u1"},
    }
    spec = parse_spec(
        {"model": {"uri": "builtin://smollm2-135m"}, "monitoring": {"podMonitor": True}},
        default_image="x",
    )
    validate_monitor(get_pod_monitor(body, spec))


@pytest.mark.parametrize(
    "bad",
    [
        {"spec": {"selector": {}, "podMetricEndpoints": []}},  # misspelt
        {"spec": {"podMetricsEndpoints": [{"port": "http"}]}},  # no selector
        {"spec": {"selector": {}, "podMetricsEndpoints": [{"interval": "30 s"}]}},
    ],
)
def test_the_vendored_schema_refuses_what_the_api_server_would(bad):
    obj = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor"}
    obj |= {"metadata": {"name": "chat"}, **bad}
    with pytest.raises(jsonschema.ValidationError):
        validate_monitor(obj)


def test_the_dashboard_config_map_holds_the_repos_dashboard():
    objects = render(ENABLED)
    config_map = the(objects, "ConfigMap")
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(config_map, version, strict=True)
    labels = config_map["metadata"]["labels"]
    assert (labels["grafana_dashboard"], labels["grafana_folder"]) == ("1", "LLM")
    assert config_map["metadata"]["namespace"] == NAMESPACE
    (data,) = config_map["data"].values()
    assert json.loads(data) == json.loads((CHART_DIR / "dashboards" / "pagefleet.json").read_text())

    elsewhere = render({"grafanaDashboard": {"enabled": True, "namespace": "monitoring"}})
    assert the(elsewhere, "ConfigMap")["metadata"]["namespace"] == "monitoring"


@pytest.mark.parametrize(
    ("values", "word"),
    [
        ({"operator": {"serviceMonitor": {"enable": True}}}, "enable"),
        ({"operator": {"serviceMonitor": {"interval": "30 seconds"}}}, "interval"),
        ({"operator": {"metricsPort": 80}}, "metricsPort"),
        ({"grafanaDashboard": {"enabled": "yes"}}, "enabled"),
        ({"servingPod": {"podMonitorByDefault": "true"}}, "podMonitorByDefault"),
        ({"router": {"serviceMonitor": {"enable": True}}}, "enable"),
    ],
)
def test_bad_monitoring_values_fail_and_name_the_key(values, word):
    with pytest.raises(helm.HelmError) as caught:
        render(values)
    assert word in str(caught.value)
