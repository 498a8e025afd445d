"""spec.gateway.inferencePool (and spec.engine.kvEvents, the pods' side of a KV-aware
gateway): an inference.networking.k8s.io/v1 InferencePool of the
serving pods whose Endpoint Picker is the router's ext_proc port, checked against the
Gateway API Inference Extension's own published v1 CRD (vendored in
data/gateway-api-inference-extension with its licence, admitted as the API server would:
defaults, schema and CEL rules); the router turned on with it; the operator's default;
the pool owned by the service; its Gateway parents' conditions in the service's status,
and a condition where the cluster lacks the CRD."""

from __future__ import annotations

import json

import kubernetes_validate
import pytest
import yaml
from pagefleet_operator.desired import get_desired_objects
from pagefleet_operator.names import EXT_PROC_PORT, HTTP_PORT
from pagefleet_operator.spec import SpecError, parse_spec
from pagefleet_serve.config import KVEventsConfig

from tests.operator import apiserver_validation
from tests.operator.operator_samples import CRD_PATH, DEFAULT_IMAGE, REPO, load_yaml, make_body
from tests.operator.test_operator_monitoring import ClusterKube
from tests.operator.test_operator_reconcile import condition, run

POOL_CRD = yaml.safe_load(
    (
        REPO
        / "tests/operator/data/gateway-api-inference-extension"
        / "inferencepools.inference.networking.k8s.io.yaml"
    ).read_text()
)
POOL_SCHEMA = next(v for v in POOL_CRD["spec"]["versions"] if v["name"] == "v1")["schema"][
    "openAPIV3Schema"
]
ISVC_SCHEMA = load_yaml(CRD_PATH)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
BUILTIN = {"model": {"uri": "builtin://smollm2-135m"}}
POOLED = {**BUILTIN, "gateway": {"inferencePool": {"enabled": True}}}
POOL_SERVED = ("inference.networking.k8s.io/v1",)


def desired_of(spec: dict, **options) -> dict:
    body = make_body(spec)
    return get_desired_objects(
        body, parse_spec(body["spec"], default_image=DEFAULT_IMAGE, **options)
    )


def test_the_pool_selects_the_serving_pods_and_names_the_routers_ext_proc_service():
    stored, errors = apiserver_validation.admit(
        ISVC_SCHEMA, {**make_body(POOLED), "metadata": {"name": "demo"}}
    )
    assert errors == []
    assert stored["spec"]["gateway"]["inferencePool"]["failureMode"] == "FailClose"  # CRD default
    desired = desired_of(stored["spec"])
    pool, epp, router = (
        desired["InferencePool"],
        desired["EndpointPickerService"],
        desired["RouterDeployment"],
    )
    pods = desired["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pods.items()
    assert pool["spec"]["targetPorts"] == [{"number": HTTP_PORT}]
    assert pool["spec"]["endpointPickerRef"] == {
        "group": "",
        "kind": "Service",
        "name": "demo-epp",
        "port": {"number": EXT_PROC_PORT},
        "failureMode": "FailClose",
    }
    assert pool["metadata"]["ownerReferences"][0]["uid"] == "uid-demo"
    # The picker's Service reaches the router pods' ext_proc port, which the router serves.
    (port,) = epp["spec"]["ports"]
    assert (epp["metadata"]["name"], port["port"]) == ("demo-epp", EXT_PROC_PORT)
    template = router["spec"]["template"]
    assert epp["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    (container,) = template["spec"]["containers"]
    assert {"name": port["targetPort"], "containerPort": EXT_PROC_PORT, "protocol": "TCP"} in (
        container["ports"]
    )
    assert f"--ext-proc-port={EXT_PROC_PORT}" in container["args"]


@pytest.mark.parametrize("failure_mode", ["FailClose", "FailOpen"])
def test_the_rendered_pool_is_admitted_by_the_upstream_v1_crd(failure_mode):
    spec = {**BUILTIN, "gateway": {"inferencePool": {"enabled": True, "failureMode": failure_mode}}}
    desired = desired_of(spec)
    pool = desired["InferencePool"]
    stored, errors = apiserver_validation.admit(POOL_SCHEMA, pool)
    assert errors == []
    assert stored["spec"]["endpointPickerRef"]["failureMode"] == failure_mode
    assert stored["spec"]["appProtocol"] == "http"  # the upstream default: the pods speak HTTP/1.1
    assert (pool["apiVersion"], pool["kind"]) == (
        f"{POOL_CRD['spec']['group']}/v1",
        POOL_CRD["spec"]["names"]["kind"],
    )
    for slot, obj in desired.items():
        if obj is not None and slot != "InferencePool":
            kubernetes_validate.validate(obj, "1.33", strict=True)


def test_the_upstream_crd_refuses_what_the_pool_must_not_be():
    """The check above can fail: the vendored schema refuses a pool without a picker port
    or with a repeated target port, in the API server's words."""
    pool = desired_of(POOLED)["InferencePool"]
    no_port = {**pool, "spec": {**pool["spec"], "endpointPickerRef": {"name": "demo-epp"}}}
    _, errors = apiserver_validation.admit(POOL_SCHEMA, no_port)
    assert any("port is required when kind is 'Service'" in e for e in errors), errors
    twice = {**pool, "spec": {**pool["spec"], "targetPorts": [{"number": 8000}] * 2}}
    _, errors = apiserver_validation.admit(POOL_SCHEMA, twice)
    assert any("port number must be unique" in e for e in errors), errors


def test_a_pool_turns_the_router_on_and_an_explicit_router_off_is_refused():
    assert parse_spec(POOLED, default_image=DEFAULT_IMAGE).router.enabled
    with pytest.raises(SpecError, match=r"gateway\.inferencePool\.enabled: .*router"):
        parse_spec({**POOLED, "router": {"enabled": False}}, default_image=DEFAULT_IMAGE)
    with pytest.raises(SpecError, match="must be one of FailClose, FailOpen, got 'Sometimes'"):
        parse_spec(
            {**BUILTIN, "gateway": {"inferencePool": {"failureMode": "Sometimes"}}},
            default_image=DEFAULT_IMAGE,
        )
    assert desired_of(BUILTIN)["InferencePool"] is None


def test_the_operators_default_gives_every_service_a_pool_unless_it_says_otherwise():
    assert desired_of(BUILTIN, inference_pool_default=True)["InferencePool"] is not None
    off = {**BUILTIN, "gateway": {"inferencePool": {"enabled": False}}}
    assert desired_of(off, inference_pool_default=True)["InferencePool"] is None
    # A service that keeps its router off keeps it off, and gets no pool.
    no_router = {**BUILTIN, "router": {"enabled": False}}
    desired = desired_of(no_router, inference_pool_default=True)
    assert desired["InferencePool"] is None and desired["RouterDeployment"] is None


def test_without_the_crd_the_rest_is_applied_and_a_condition_says_what_to_install():
    kube = ClusterKube(make_body(POOLED), served=())
    run(kube)
    assert kube.get("InferencePool", "ml", "demo") is None
    assert kube.get("Service", "ml", "demo-epp") is not None
    assert kube.get("Deployment", "ml", "demo-router") is not None
    pooled = condition(kube, "InferencePool")
    assert (pooled["status"], pooled["reason"]) == ("False", "InferencePoolCRDMissing")
    assert "install the Gateway API Inference Extension's CRDs" in pooled["message"]
    assert condition(kube, "Degraded")["status"] == "False"


def test_the_pool_is_created_owned_and_its_gateways_conditions_surface():
    kube = ClusterKube(make_body(POOLED), served=POOL_SERVED)
    outcome = run(kube)
    assert ("created", "InferencePool") in [(c.verb, c.kind) for c in outcome.changes]
    pool = kube.get("InferencePool", "ml", "demo")
    assert pool["metadata"]["ownerReferences"][0]["uid"] == "uid-demo"
    assert condition(kube, "InferencePool")["reason"] == "NotAttached"

    def parent(accepted: str, resolved: str, reason: str = "Accepted") -> dict:
        return {
            "parentRef": {"name": "inference-gateway", "kind": "Gateway"},
            "conditions": [
                {"type": "Accepted", "status": accepted, "reason": reason, "message": ""},
                {
                    "type": "ResolvedRefs",
                    "status": resolved,
                    "reason": "InvalidExtensionRef" if resolved == "False" else "ResolvedRefs",
                    "message": "Service demo-epp has no ready endpoints",
                },
            ],
        }

    live = kube.objects[("InferencePool", "ml", "demo")]  # as the gateway's controller writes
    live["status"] = {"parents": [parent("True", "False")]}
    run(kube)
    pooled = condition(kube, "InferencePool")
    assert (pooled["status"], pooled["reason"]) == ("False", "InvalidExtensionRef")
    assert pooled["message"].startswith("Gateway ml/inference-gateway: ResolvedRefs is False")
    live["status"] = {"parents": [parent("True", "True")]}
    run(kube)
    pooled = condition(kube, "InferencePool")
    assert (pooled["status"], pooled["message"]) == (
        "True",
        "accepted by Gateway ml/inference-gateway",
    )
    # Turned off, the pool and the picker's Service go.
    kube.objects[("InferenceService", "ml", "demo")]["spec"] = {
        **BUILTIN,
        "gateway": {"inferencePool": {"enabled": False}},
    }
    outcome = run(kube)
    deleted = [(c.verb, c.kind) for c in outcome.changes if c.verb == "deleted"]
    assert ("deleted", "InferencePool") in deleted
    assert kube.get("InferencePool", "ml", "demo") is None
    assert kube.get("Service", "ml", "demo-epp") is None


def test_kv_events_on_request_give_the_pods_vllms_flag_and_their_ports():
    desired = desired_of({**BUILTIN, "engine": {"kvEvents": {"enabled": True}}})
    (container,) = desired["Deployment"]["spec"]["template"]["spec"]["containers"]
    (flag,) = [e["value"] for e in container["env"] if e["name"] == "PAGEFLEET_KV_EVENTS_CONFIG"]
    config = KVEventsConfig.from_json(flag)  # the pod's own parser takes it
    assert (config.endpoint, config.replay_endpoint) == ("tcp://*:5557", "tcp://*:5558")
    assert json.loads(flag)["enable_kv_cache_events"] is True
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ports["kv-events"], ports["kv-replay"]) == (5557, 5558)
    (plain,) = desired_of(BUILTIN)["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert "kv-events" not in {p["name"] for p in plain["ports"]}
    assert all(e["name"] != "PAGEFLEET_KV_EVENTS_CONFIG" for e in plain["env"])
