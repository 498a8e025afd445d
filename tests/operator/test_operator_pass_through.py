"""The fields a spec passes through to the pod template (issue 73): what kube-apiserver
would refuse in the Deployment, the operator refuses in its parse, naming the field, so
that the service is Degraded once instead of a 422 on every resync. The API server's side
is tests/operator/pod_validation.py, written from its rules, not from the operator's."""

from __future__ import annotations

import copy

import pytest
from pagefleet_operator.deployment import get_deployment
from pagefleet_operator.spec import SpecError, parse_spec

from tests.operator import pod_validation
from tests.operator.operator_samples import DEFAULT_IMAGE, make_body
from tests.operator.test_operator_reconcile import BUILTIN, FakeKube, condition, run


def deployment_as_written(spec: dict) -> dict:
    """The Deployment the builders make, with the spec's pass-through fields as they are
    written (what the operator applied before it checked them)."""
    deployment = get_deployment(
        make_body(BUILTIN), parse_spec(BUILTIN, default_image=DEFAULT_IMAGE)
    )
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    if "tolerations" in spec:
        pod["tolerations"] = copy.deepcopy(spec["tolerations"])
    if "nodeSelector" in spec:
        pod["nodeSelector"] = copy.deepcopy(spec["nodeSelector"])
    if "resources" in spec:
        container["resources"] = copy.deepcopy(spec["resources"])
    container["env"] += copy.deepcopy(spec.get("engine", {}).get("env", []))
    if "image" in spec.get("engine", {}):
        container["image"] = spec["engine"]["image"]
    return deployment


# (spec fields, the field the operator names, what kube-apiserver says of the Deployment)
REFUSED = [
    (
        {"tolerations": [{"key": "a", "operator": "Exists", "value": "x"}]},
        "tolerations[0].value",
        "value must be empty when `operator` is 'Exists'",
    ),
    (
        {"tolerations": [{"value": "x"}]},
        "tolerations[0].operator",
        "operator must be Exists when `key` is empty",
    ),
    (
        {"tolerations": [{"key": "a", "operator": "Exists", "tolerationSeconds": 5}]},
        "tolerations[0].effect",
        "effect must be 'NoExecute' when `tolerationSeconds` is set",
    ),
    (
        {"tolerations": [{"key": "a", "operator": "Sideways"}]},
        "tolerations[0].operator",
        'Unsupported value: "Sideways"',
    ),
    (
        {"tolerations": [{"key": "a", "operator": "Exists", "effect": "NoRun"}]},
        "tolerations[0].effect",
        'Unsupported value: "NoRun"',
    ),
    ({"tolerations": [{"key": "a b", "operator": "Exists"}]}, "tolerations[0].key", "name part"),
    (
        {"tolerations": [{"key": "gpu", "value": "h100 sxm"}]},
        "tolerations[0].value",
        "a valid label must be an empty string",
    ),
    ({"nodeSelector": {"pool/": "gpu"}}, "nodeSelector.pool/", "name part must be non-empty"),
    ({"nodeSelector": {"pool": "a b"}}, "nodeSelector.pool", "a valid label must be"),
    (
        {"resources": {"limits": {"gpu": "1"}}},
        "resources.limits.gpu",
        "must be a standard resource for containers",
    ),
    (
        {"resources": {"requests": {"cpu": "-1"}}},
        "resources.requests.cpu",
        "must be greater than or equal to 0",
    ),
    (
        {"resources": {"limits": {"example.com/fpga": "500m"}}},
        "resources.limits.example.com/fpga",
        "must be an integer",
    ),
    (
        {"resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "1"}}},
        "resources.requests.cpu",
        "must be less than or equal to cpu limit of 1",
    ),
    (
        {"resources": {"requests": {"example.com/fpga": 1}}},
        "resources.requests.example.com/fpga",
        "Limit must be set for non overcommitable resources",
    ),
    (
        {"resources": {"requests": {"example.com/fpga": 1}, "limits": {"example.com/fpga": 2}}},
        "resources.requests.example.com/fpga",
        "must be equal to example.com/fpga limit of 2",
    ),
    (
        {"engine": {"env": [{"name": "A=B", "value": "1"}]}},
        "engine.env[0].name",
        "printable ASCII characters other than '='",
    ),
    (
        {"engine": {"env": [{"name": "A", "value": "1", "valueFrom": {"fieldRef": {}}}]}},
        "engine.env[0].valueFrom",
        "may not be specified when `value` is not empty",
    ),
    (
        {"engine": {"env": [{"name": "A", "valueFrom": {}}]}},
        "engine.env[0].valueFrom",
        "must specify one of",
    ),
    (
        {"engine": {"env": [{"name": "A", "valueFrom": {"fieldRef": {"fieldPath": "spec.x"}}}]}},
        "engine.env[0].valueFrom.fieldRef.fieldPath",
        'Unsupported value: "spec.x"',
    ),
    (
        {
            "engine": {
                "env": [
                    {
                        "name": "A",
                        "valueFrom": {
                            "resourceFieldRef": {"resource": "limits.cpu", "divisor": "2"}
                        },
                    }
                ]
            }
        },
        "engine.env[0].valueFrom.resourceFieldRef.divisor",
        "only divisor's values 1m and 1 are supported with the cpu resource",
    ),
    (
        {
            "engine": {
                "env": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": ".."}}}]
            }
        },
        "engine.env[0].valueFrom.secretKeyRef.key",
        "must not be '..'",
    ),
    (
        {"engine": {"image": " ghcr.io/pagefleet/servingpod:1"}},
        "engine.image",
        "must not have leading or trailing whitespace",
    ),
]


@pytest.mark.parametrize(("fields", "field", "refusal"), REFUSED)
def test_what_the_api_server_refuses_in_the_pod_the_operator_refuses_in_the_spec(
    fields, field, refusal
):
    spec = {**BUILTIN, **fields}
    errors = pod_validation.validate_deployment(deployment_as_written(spec))
    assert any(refusal in error for error in errors), errors
    with pytest.raises(SpecError) as raised:
        parse_spec(spec, default_image=DEFAULT_IMAGE)
    assert raised.value.field_path == field, str(raised.value)


ACCEPTED = [
    {"tolerations": [{"operator": "Exists"}]},
    {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
    {"tolerations": [{"key": "gpu", "value": "h100"}, {"key": "spot", "operator": "Equal"}]},
    {
        "tolerations": [
            {"key": "a", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60}
        ]
    },
    {"nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb", "pool": ""}},
    {"resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}},
    {"resources": {"limits": {"nvidia.com/gpu": 2, "hugepages-2Mi": "1Gi", "memory": "8Gi"}}},
    {"resources": {"requests": {"nvidia.com/gpu": "1"}, "limits": {"nvidia.com/gpu": "1"}}},
    {
        "engine": {
            "env": [
                {"name": "my.var-1", "value": "x"},
                {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {
                    "name": "TEAM",
                    "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['team']"}},
                },
                {
                    "name": "MEM",
                    "valueFrom": {
                        "resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}
                    },
                },
                {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s.x", "key": ".tok"}}},
                {"name": "CFG", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "a_b"}}},
            ]
        }
    },
]


@pytest.mark.parametrize("fields", ACCEPTED)
def test_what_the_api_server_accepts_the_operator_accepts(fields):
    spec = {**BUILTIN, **fields}
    body = make_body(spec)
    deployment = get_deployment(body, parse_spec(spec, default_image=DEFAULT_IMAGE))
    assert pod_validation.validate_deployment(deployment) == []


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"ingress": {"host": "10.0.0.1"}}, "ingress.host"),
        ({"ingress": {"host": "LLM.example.com"}}, "ingress.host"),
        ({"ingress": {"host": "llm.example.com", "className": "Nginx"}}, "ingress.className"),
        (
            {"ingress": {"host": "llm.example.com", "annotations": {"a b": "c"}}},
            "ingress.annotations.a b",
        ),
        (
            {"monitoring": {"podMonitorLabels": {"release": "kube prometheus"}}},
            "monitoring.podMonitorLabels.release",
        ),
        (
            {"router": {"enabled": True, "resources": {"limits": {"cpu": "-1"}}}},
            "router.resources.limits.cpu",
        ),
        (
            {"engine": {"apiKeySecretRef": {"name": "Keys", "key": "api"}}},
            "engine.apiKeySecretRef.name",
        ),
        (
            {"model": {"uri": "hf://org/m", "tokenSecretRef": {"name": "hf", "key": "."}}},
            "model.tokenSecretRef.key",
        ),
    ],
)
def test_values_other_objects_carry_are_checked_too(fields, field):
    """The Ingress' host, class and annotation keys, the PodMonitor's labels, the router's
    resources and the Secret references: each as its API would refuse it."""
    with pytest.raises(SpecError) as raised:
        parse_spec({**BUILTIN, **fields}, default_image=DEFAULT_IMAGE)
    assert raised.value.field_path == field, str(raised.value)


def test_a_toleration_the_api_server_refuses_is_degraded_and_nothing_is_applied():
    """Issue 73: `value: x` with `operator: Exists` passed the CRD and the operator, and
    the API server refused the Deployment on every resync."""
    spec = {**BUILTIN, "tolerations": [{"key": "a", "operator": "Exists", "value": "x"}]}
    kube = FakeKube(make_body(spec))
    outcome = run(kube)
    degraded = condition(kube, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "InvalidSpec")
    assert degraded["message"] == (
        "spec.tolerations[0].value: must be empty when operator is Exists"
    )
    assert outcome.changes == () and [w for w in kube.writes if w[0] != "status"] == []
