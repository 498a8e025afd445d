"""The chart's NetworkPolicy checked against the objects it is about, not against strings:
its pod selector must select the serving pods the operator builds (or it protects
nothing), its port must be the serving container's port, and the peers it admits must
select the operator's own pods (the chart's Deployment, in the release namespace) and the
router pods the operator builds; the KV cache event ports, which a router with precise
routing follows, admit the router pods alone. Real Helm renders the chart; the
operator's pure builders make the serving and router Deployments."""

from __future__ import annotations

import pytest
from pagefleet_operator.deployment import get_deployment
from pagefleet_operator.router import get_router_deployment
from pagefleet_operator.spec import parse_spec

from tests.chart.chart_render import NAMESPACE, find, render

SERVING_NAMESPACE = "ml"
BODY = {
    "apiVersion": "pagefleet.dev/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "demo", "namespace": SERVING_NAMESPACE, "uid": "u", "generation": 1},
    "spec": {
        "model": {"uri": "hf://org/model"},
        "router": {"enabled": True, "preciseRouting": True},
        "engine": {"kvEvents": {"enabled": True}},
    },
}


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """A Kubernetes LabelSelector's meaning: every matchLabels pair and every
    matchExpressions requirement holds (an empty selector selects everything)."""
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for requirement in selector.get("matchExpressions", []):
        key, operator, values = (
            requirement["key"],
            requirement["operator"],
            requirement.get("values", []),
        )
        holds = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not holds:
            return False
    return True


def http_rule(policy: dict) -> dict:
    [rule] = [r for r in policy["ingress"] if r["ports"] == [{"port": "http", "protocol": "TCP"}]]
    return rule


def pod_template(deployment: dict) -> tuple[dict[str, str], dict]:
    template = deployment["spec"]["template"]
    return template["metadata"]["labels"], template["spec"]


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return render({"servingPod": {"networkPolicy": {"enabled": True, "namespaces": ["ml"]}}})


@pytest.fixture(scope="module")
def policy(objects) -> dict:
    [policy] = find(objects, "NetworkPolicy")
    assert policy["metadata"]["namespace"] == SERVING_NAMESPACE
    return policy["spec"]


@pytest.fixture(scope="module")
def built() -> dict[str, dict]:
    spec = parse_spec(BODY["spec"], default_image="ghcr.io/pagefleet/servingpod:0.1.0")
    return {
        "serving": get_deployment(BODY, spec),
        "router": get_router_deployment(BODY, spec),
    }


def test_the_policy_selects_the_serving_pods_and_no_router_pod(policy, built):
    serving_labels, _ = pod_template(built["serving"])
    router_labels, _ = pod_template(built["router"])
    assert selects(policy["podSelector"], serving_labels)
    assert not selects(policy["podSelector"], router_labels)  # it restricts the pods only
    assert policy["policyTypes"] == ["Ingress"]


def test_the_policy_opens_the_serving_containers_port(policy, built):
    _, pod = pod_template(built["serving"])
    ports = {p["name"] for c in pod["containers"] for p in c["ports"]}
    for rule in policy["ingress"]:  # http, then the KV cache events'
        assert {p["port"] for p in rule["ports"]} <= ports
    assert len(policy["ingress"]) == 2


def test_the_policy_admits_the_operator_and_the_router_and_nothing_else(policy, objects, built):
    """Peers: the operator's pods in the release namespace (it scrapes /metrics) and the
    router pods in the serving namespace; a pod of any other kind is not admitted. The
    KV cache event ports admit the router pods alone (the operator never reads them)."""
    operator_labels, _ = pod_template(
        next(d for d in find(objects, "Deployment") if d["metadata"]["namespace"] == NAMESPACE)
    )
    router_labels, _ = pod_template(built["router"])
    namespaces = {
        NAMESPACE: {"kubernetes.io/metadata.name": NAMESPACE},
        SERVING_NAMESPACE: {"kubernetes.io/metadata.name": SERVING_NAMESPACE},
    }

    def admitted(namespace: str, labels: dict[str, str], rule: dict) -> bool:
        for peer in rule["from"]:
            # A peer without namespaceSelector means the policy's own namespace.
            in_namespace = (
                selects(peer["namespaceSelector"], namespaces[namespace])
                if "namespaceSelector" in peer
                else namespace == SERVING_NAMESPACE
            )
            if in_namespace and selects(peer.get("podSelector", {}), labels):
                return True
        return False

    http = http_rule(policy)
    assert admitted(NAMESPACE, operator_labels, http)
    assert admitted(SERVING_NAMESPACE, router_labels, http)
    assert not admitted(SERVING_NAMESPACE, {"app": "someone-else"}, http)
    assert not admitted(SERVING_NAMESPACE, operator_labels, http)  # the operator's, elsewhere
    [kv] = [rule for rule in policy["ingress"] if rule is not http]
    assert {p["port"] for p in kv["ports"]} == {"kv-events", "kv-replay"}
    assert admitted(SERVING_NAMESPACE, router_labels, kv)
    assert not admitted(NAMESPACE, operator_labels, kv)
    assert not admitted(SERVING_NAMESPACE, {"app": "someone-else"}, kv)
    # the router those ports are open to follows them there
    _, router_pod = pod_template(built["router"])
    assert "--kv-events-endpoint=tcp://{host}:5557" in router_pod["containers"][0]["args"]
