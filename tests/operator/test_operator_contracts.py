"""The serving pod's contracts checked against the parts on the other side of them: the
liveness probe against how long the engine may look unhealthy and recover, service links
against the environment variables `pagefleet serve` reads, and the CRD against a spec with
minReplicas equal to maxReplicas (a fixed replica count with autoscaling's other
settings), admitted as the API server would."""

from __future__ import annotations

import argparse
import re

import pytest
from pagefleet_operator.deployment import get_deployment
from pagefleet_operator.router import get_pod_service, get_router_deployment
from pagefleet_operator.service import get_service
from pagefleet_operator.spec import parse_spec
from pagefleet_serve.cli import build_parser

from tests.operator import apiserver_validation
from tests.operator.operator_samples import CRD_PATH, DEFAULT_IMAGE, load_yaml, make_body

SCHEMA = load_yaml(CRD_PATH)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
SPEC = {"model": {"uri": "builtin://smollm2-135m"}, "router": {"enabled": True}}
# The kubelet restarts a pod whose liveness fails this long in a row at the least. /health
# turns 503 while the core has been silent for its heartbeat timeout (10 s); on a loaded
# node a healthy core's heartbeats run seconds late and a long step or a compile pauses
# it, so a stall must be allowed to last three timeouts before the pod is killed.
MIN_LIVENESS_WINDOW_S = 30


def built(name: str = "demo") -> tuple[dict, object]:
    body = make_body(SPEC, name=name)
    return body, parse_spec(body["spec"], default_image=DEFAULT_IMAGE)


def pod_spec(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def test_the_serving_pods_liveness_outlasts_a_stall_the_engine_recovers_from():
    body, spec = built()
    [container] = pod_spec(get_deployment(body, spec))["containers"]
    probe = container["livenessProbe"]
    assert probe["httpGet"]["path"] == "/health"
    assert probe["periodSeconds"] * probe["failureThreshold"] >= MIN_LIVENESS_WINDOW_S
    assert probe["timeoutSeconds"] <= probe["periodSeconds"]


def service_link_variables(service: dict) -> set[str]:
    """The variables the kubelet injects into pods of the Service's namespace for it when
    service links are on (Docker-links style, as kubelet's envvars.FromServices)."""
    prefix = service["metadata"]["name"].upper().replace("-", "_")
    names = {f"{prefix}_SERVICE_HOST", f"{prefix}_SERVICE_PORT", f"{prefix}_PORT"}
    for port in service["spec"]["ports"]:
        names.add(f"{prefix}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}")
        base = f"{prefix}_PORT_{port['port']}_{port['protocol']}"
        names |= {base, f"{base}_PROTO", f"{base}_PORT", f"{base}_ADDR"}
    return names


def serve_environment_variables() -> set[str]:
    """Every PAGEFLEET_* variable `pagefleet serve` reads (each flag's help names it)."""
    parser = build_parser("serve")
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    helps = [action.help or "" for action in commands.choices["serve"]._actions]
    return {name for text in helps for name in re.findall(r"\[env: (\w+)\]", text)}


def test_service_links_are_off_because_an_inference_service_named_pagefleet_clobbers_flags():
    """An InferenceService named `pagefleet` gets Services whose links would set
    PAGEFLEET_PORT=tcp://... in every pod of the namespace: the serving pod's --port. Both
    pods the operator builds must turn service links off (Kubernetes' default is on)."""
    body, spec = built("pagefleet")
    services = [get_service(body, spec), get_pod_service(body, spec)]
    injected = set().union(*(service_link_variables(s) for s in services if s))
    assert "PAGEFLEET_PORT" in injected & serve_environment_variables()
    for deployment in (get_deployment(body, spec), get_router_deployment(body, spec)):
        assert pod_spec(deployment).get("enableServiceLinks", True) is False


@pytest.mark.parametrize("replicas", [1, 3])
def test_the_crd_admits_min_replicas_equal_to_max_replicas(replicas):
    autoscaling = {"enabled": True, "minReplicas": replicas, "maxReplicas": replicas}
    obj = {
        "apiVersion": "pagefleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "fixed"},
        "spec": {"model": {"uri": "builtin://smollm2-135m"}, "autoscaling": autoscaling},
    }
    stored, errors = apiserver_validation.admit(SCHEMA, obj)
    assert errors == []
    assert stored["spec"]["autoscaling"]["minReplicas"] == replicas
    spec = parse_spec(stored["spec"], default_image=DEFAULT_IMAGE)
    assert spec.autoscaling.min_replicas == spec.autoscaling.max_replicas == replicas
