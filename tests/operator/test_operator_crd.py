"""The CRD: structurally valid, defaults applied, bad input rejected, objects valid.

The API server is not available here, so its checks are reproduced: the
openAPIV3Schema through jsonschema (draft 4, like OpenAPI 3.0's boolean
exclusiveMinimum), CEL rules through cel-python, unknown fields as kubectl's strict
field validation rejects them, and defaulting as structural schemas do. Built-in
objects are checked against Kubernetes' own OpenAPI schemas with kubernetes-validate.
"""

from __future__ import annotations

import copy
import dataclasses

import celpy
import jsonschema
import kubernetes_validate
import pytest
from operator_samples import CRD_PATH, DEFAULT_IMAGE, EXAMPLES, load_yaml, make_body
from pagefleet_operator.desired import get_desired_objects
from pagefleet_operator.spec import PULL_POLICIES, parse_spec
from pagefleet_serve.config import (
    BYTE_SIZE_PATTERN,
    DTYPES,
    KV_CACHE_DTYPES,
    SPEC_METHODS,
    SpeculativeConfig,
)

K8S_VERSIONS = ["1.30", "1.33"]
CRD = load_yaml(CRD_PATH)
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]


def apply_defaults(schema: dict, value):
    """Structural defaulting: fill missing properties that declare a default, recursively."""
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(sub, value[key])
    elif isinstance(value, list) and "items" in schema:
        value = [apply_defaults(schema["items"], item) for item in value]
    return value


def unknown_fields(schema: dict, value, path: str = "") -> list[str]:
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found = []
    if isinstance(value, dict) and "properties" in schema:
        for key, item in value.items():
            if key not in schema["properties"]:
                found.append(f"{path}.{key}")
            else:
                found += unknown_fields(schema["properties"][key], item, f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            found += unknown_fields(schema["items"], item, f"{path}[{i}]")
    return found


def cel_failures(schema: dict, value) -> list[str]:
    failures = []
    for rule in schema.get("x-kubernetes-validations", []):
        env = celpy.Environment()
        program = env.program(env.compile(rule["rule"]))
        if not program.evaluate({"self": celpy.json_to_cel(value)}):
            failures.append(rule["message"])
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                failures += cel_failures(sub, value[key])
    return failures


def admit(obj: dict) -> tuple[dict, list[str]]:
    """What the API server would store, and why it would refuse it (empty when admitted)."""
    obj = apply_defaults(SCHEMA, copy.deepcopy(obj))
    errors = [e.message for e in jsonschema.Draft4Validator(SCHEMA).iter_errors(obj)]
    errors += [f"unknown field {f}" for f in unknown_fields(SCHEMA, obj)]
    if not errors:
        errors += cel_failures(SCHEMA, obj)
    return obj, errors


def resource(spec: dict) -> dict:
    return {
        "apiVersion": "pagefleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "x"},
        "spec": spec,
    }


BUILTIN = {"model": {"uri": "builtin://smollm2-135m"}}
ENGINE = SCHEMA["properties"]["spec"]["properties"]["engine"]["properties"]


def camel(name: str) -> str:
    first, *rest = name.split("_")
    return first + "".join(word.title() for word in rest)


def test_crd_enums_are_the_engines_vocabulary():
    """What the API server admits is what the pod accepts: the CRD's enums and patterns
    against pagefleet_serve.config, the one place that defines them."""
    assert ENGINE["dtype"]["enum"] == list(DTYPES)
    assert ENGINE["kvCacheDtype"]["enum"] == list(KV_CACHE_DTYPES)
    assert ENGINE["kvCacheMemory"]["pattern"] == BYTE_SIZE_PATTERN
    assert ENGINE["imagePullPolicy"]["enum"] == list(PULL_POLICIES)
    speculative = ENGINE["speculative"]["properties"]
    assert speculative["method"]["enum"] == list(SPEC_METHODS)
    assert set(speculative) == {camel(f.name) for f in dataclasses.fields(SpeculativeConfig)}


def test_crd_identity_and_subresources():
    assert CRD["metadata"]["name"] == "inferenceservices.pagefleet.dev"
    names = CRD["spec"]["names"]
    assert (names["kind"], names["plural"]) == ("InferenceService", "inferenceservices")
    assert "isvc" not in names["shortNames"]
    assert VERSION["name"] == "v1alpha1"
    assert VERSION["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    columns = [c["name"] for c in VERSION["additionalPrinterColumns"]]
    assert columns == ["Model", "Ready", "KV%", "Queue", "Status", "URL", "Age"]


@pytest.mark.parametrize("k8s", K8S_VERSIONS)
def test_crd_is_a_valid_object(k8s):
    kubernetes_validate.validate(CRD, k8s, strict=True)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_admitted_and_parse(path):
    stored, errors = admit(load_yaml(path))
    assert errors == []
    parse_spec(stored["spec"], default_image=DEFAULT_IMAGE)


def test_examples_include_llama_and_a_cpu_builtin():
    specs = {p.name: load_yaml(p)["spec"] for p in EXAMPLES}
    assert "llama.yaml" in specs
    assert any(s["model"]["uri"] == "builtin://smollm2-135m" for s in specs.values())


def test_defaults_are_filled():
    stored, errors = admit(resource(BUILTIN))
    assert errors == []
    assert stored["spec"]["replicas"] == 1
    assert stored["spec"]["engine"]["shutdownTimeoutSeconds"] == 30
    assert stored["spec"]["autoscaling"] == {
        "enabled": False,
        "minReplicas": 1,
        "maxReplicas": 4,
        "targetKVCacheUtilization": 0.8,
        "targetQueueDepth": 4,
        "scaleUpStabilizationSeconds": 0,
        "scaleDownStabilizationSeconds": 300,
        "intervalSeconds": 15,
        "scaleToZeroAfterSeconds": 600,
    }


@pytest.mark.parametrize(
    ("spec", "complaint"),
    [
        ({"model": {}}, "'uri' is a required property"),
        ({}, "'model' is a required property"),
        ({"model": {"uri": "s3://bucket/model"}}, "does not match"),
        ({"model": {"uri": "builtin://gpt-5"}}, "does not match"),
        ({**BUILTIN, "autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, "must not exceed"),
        ({**BUILTIN, "autoscaling": {"minReplicas": 5}}, "must not exceed"),  # default max 4
        ({**BUILTIN, "autoscaling": {"targetKVCacheUtilization": -0.2}}, "minimum"),
        ({**BUILTIN, "autoscaling": {"targetKVCacheUtilization": 0}}, "minimum"),
        ({**BUILTIN, "autoscaling": {"targetQueueDepth": -4}}, "less than the minimum"),
        (
            {**BUILTIN, "autoscaling": {"scaleDownStabilizationSeconds": -1}},
            "less than the minimum",
        ),
        ({**BUILTIN, "replicas": -1}, "less than the minimum"),
        ({**BUILTIN, "autoscaling": {"minReplicas": -1}}, "less than the minimum"),
        ({**BUILTIN, "router": {"replicas": 0}}, "less than the minimum"),
        ({**BUILTIN, "router": {"holdTimeoutSeconds": 0}}, "less than the minimum"),
        ({**BUILTIN, "router": {"maxHeld": 3}}, "unknown field .spec.router.maxHeld"),
        ({**BUILTIN, "engine": {"kvCacheDtype": "fp4"}}, "is not one of"),
        ({**BUILTIN, "engine": {"speculative": {"model": "pvc://claim/draft"}}}, "does not match"),
        ({**BUILTIN, "engine": {"speculative": {"method": "eagle"}}}, "is not one of"),
        ({**BUILTIN, "engine": {"gpuMemoryUtilization": 1.2}}, "maximum"),
        ({**BUILTIN, "engine": {"maxNumSeq": 8}}, "unknown field .spec.engine.maxNumSeq"),
        ({**BUILTIN, "replica": 2}, "unknown field .spec.replica"),
        ({**BUILTIN, "modelCache": {"pvcName": "a", "sizeLimit": "1Gi"}}, "not both"),
        ({**BUILTIN, "resources": {"limits": {"memory": "lots"}}}, "does not match"),
    ],
)
def test_bad_input_is_rejected_by_the_schema(spec, complaint):
    _, errors = admit(resource(spec))
    assert any(complaint in e for e in errors), errors


BODIES = [
    ("llama", {**load_yaml(EXAMPLES[0])["spec"]}),
    ("smollm2", load_yaml(EXAMPLES[1])["spec"]),
    (
        "everything",
        {
            "model": {"uri": "pvc://weights/llama"},
            "engine": {
                "image": "registry.local/pagefleet:dev",
                "speculative": {"model": "builtin://smollm2-135m", "numSpeculativeTokens": 3},
                "imagePullPolicy": "Always",
                "extraArgs": ["--enable-prefix-caching", "true"],
                "apiKeySecretRef": {"name": "keys", "key": "api"},
            },
            "replicas": 3,
            "resources": {"limits": {"cpu": "500m", "memory": "1Gi"}},
            "nodeSelector": {"pool": "gpu"},
            "modelCache": {"sizeLimit": "20Gi"},
            "ingress": {"host": "llm.example.com", "className": "nginx", "tlsSecretName": "tls"},
        },
    ),
    (
        "routed",
        {
            **BUILTIN,
            "router": {"enabled": True, "replicas": 2, "resources": {"limits": {"cpu": "1"}}},
            "autoscaling": {"enabled": True, "minReplicas": 0, "scaleToZeroAfterSeconds": 60},
            "ingress": {"host": "llm.example.com"},
        },
    ),
]


@pytest.mark.parametrize("k8s", K8S_VERSIONS)
@pytest.mark.parametrize(("name", "spec"), BODIES, ids=[b[0] for b in BODIES])
def test_every_built_object_is_valid_kubernetes(name, spec, k8s):
    stored, errors = admit(resource(spec))
    assert errors == []
    body = make_body(stored["spec"], name=name)
    desired = get_desired_objects(body, parse_spec(body["spec"], default_image=DEFAULT_IMAGE))
    built = [obj for obj in desired.values() if obj is not None]
    assert len(built) >= 2
    for obj in built:
        kubernetes_validate.validate(obj, k8s, strict=True)
