"""The CRD: structurally valid, defaults applied, bad input rejected with the messages
kube-apiserver gives, objects valid.

The API server is not available here, so its admission is reproduced in
apiserver_validation.py: strict field validation, structural defaulting, the schema's
checks in kube-openapi's and apiextensions-apiserver's words, and the CEL rules through
cel-python, reported at their fieldPath. Built-in objects are checked against
Kubernetes' own OpenAPI schemas with kubernetes-validate.
"""

from __future__ import annotations

import dataclasses

import kubernetes_validate
import pytest
from pagefleet_operator.desired import get_desired_objects
from pagefleet_operator.spec import PULL_POLICIES, parse_spec
from pagefleet_serve.config import (
    BYTE_SIZE_PATTERN,
    DTYPES,
    KV_CACHE_DTYPES,
    SPEC_METHODS,
    SpeculativeConfig,
)

from tests.operator import apiserver_validation
from tests.operator.operator_samples import (
    CRD_PATH,
    DEFAULT_IMAGE,
    EXAMPLES,
    REPO,
    load_yaml,
    make_body,
)

K8S_VERSIONS = ["1.30", "1.33"]
CRD = load_yaml(CRD_PATH)
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]


def admit(obj: dict) -> tuple[dict, list[str]]:
    """What the API server would store, and why it would refuse it (empty when admitted)."""
    return apiserver_validation.admit(SCHEMA, obj)


def resource(spec: dict) -> dict:
    return {
        "apiVersion": "pagefleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "x"},
        "spec": spec,
    }


BUILTIN = {"model": {"uri": "builtin://smollm2-135m"}}
EXAMPLE_DIR = REPO / "examples"
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


SPEC = SCHEMA["properties"]["spec"]["properties"]
URI_PATTERN = SPEC["model"]["properties"]["uri"]["pattern"]
DRAFT_PATTERN = ENGINE["speculative"]["properties"]["model"]["pattern"]
QUANTITY_PATTERN = SPEC["resources"]["properties"]["limits"]["additionalProperties"]["pattern"]
BLOCKED = apiserver_validation.BLOCKED_NOTE


def too_small(path: str, value, bound, exclusive: bool = False) -> str:
    relation = "greater than" if exclusive else "greater than or equal to"
    return f"{path}: Invalid value: {value}: {path} in body should be {relation} {bound}"


def mismatch(path: str, value: str, pattern: str) -> str:
    return f"{path}: Invalid value: \"{value}\": {path} in body should match '{pattern}'"


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"model": {}}, ["spec.model.uri: Required value", BLOCKED]),
        ({}, ["spec.model: Required value", BLOCKED]),
        (
            {"model": {"uri": "s3://bucket/model"}},
            [mismatch("spec.model.uri", "s3://bucket/model", URI_PATTERN)],
        ),
        (
            {"model": {"uri": "builtin://gpt-5"}},
            [mismatch("spec.model.uri", "builtin://gpt-5", URI_PATTERN)],
        ),
        (
            {"model": {"uri": "hf://org/" + "m" * 1020}},
            [
                "spec.model.uri: Too long: may not be more than 1024 bytes",
                BLOCKED,
            ],
        ),
        (
            {**BUILTIN, "autoscaling": {"minReplicas": 5, "maxReplicas": 2}},
            [
                "spec.autoscaling.minReplicas: Invalid value: autoscaling.minReplicas must not "
                "exceed autoscaling.maxReplicas"
            ],
        ),
        (  # the default maxReplicas is 4
            {**BUILTIN, "autoscaling": {"minReplicas": 5}},
            [
                "spec.autoscaling.minReplicas: Invalid value: autoscaling.minReplicas must not "
                "exceed autoscaling.maxReplicas"
            ],
        ),
        (
            {**BUILTIN, "autoscaling": {"targetKVCacheUtilization": -0.2}},
            [too_small("spec.autoscaling.targetKVCacheUtilization", -0.2, 0, exclusive=True)],
        ),
        (
            {**BUILTIN, "autoscaling": {"targetKVCacheUtilization": 0}},
            [too_small("spec.autoscaling.targetKVCacheUtilization", 0, 0, exclusive=True)],
        ),
        (
            {**BUILTIN, "autoscaling": {"targetQueueDepth": -4}},
            [too_small("spec.autoscaling.targetQueueDepth", -4, 1)],
        ),
        (
            {**BUILTIN, "autoscaling": {"scaleDownStabilizationSeconds": -1}},
            [too_small("spec.autoscaling.scaleDownStabilizationSeconds", -1, 0)],
        ),
        ({**BUILTIN, "replicas": -1}, [too_small("spec.replicas", -1, 0)]),
        (
            {**BUILTIN, "autoscaling": {"minReplicas": -1}},
            [too_small("spec.autoscaling.minReplicas", -1, 0)],
        ),
        ({**BUILTIN, "router": {"replicas": 0}}, [too_small("spec.router.replicas", 0, 1)]),
        (
            {**BUILTIN, "router": {"holdTimeoutSeconds": 0}},
            [too_small("spec.router.holdTimeoutSeconds", 0, 1)],
        ),
        (
            {**BUILTIN, "router": {"maxHeld": 3}},
            ['strict decoding error: unknown field "spec.router.maxHeld"'],
        ),
        (
            {**BUILTIN, "engine": {"kvCacheDtype": "fp4"}},
            [
                'spec.engine.kvCacheDtype: Unsupported value: "fp4": supported values: '
                '"auto", "fp8", "int8"',
                BLOCKED,
            ],
        ),
        (
            {**BUILTIN, "engine": {"speculative": {"model": "pvc://claim/draft"}}},
            [mismatch("spec.engine.speculative.model", "pvc://claim/draft", DRAFT_PATTERN)],
        ),
        (
            {**BUILTIN, "engine": {"speculative": {"method": "eagle"}}},
            [
                'spec.engine.speculative.method: Unsupported value: "eagle": supported '
                'values: "ngram", "draft_model"',
                BLOCKED,
            ],
        ),
        (
            {**BUILTIN, "engine": {"gpuMemoryUtilization": 1.2}},
            [
                "spec.engine.gpuMemoryUtilization: Invalid value: 1.2: "
                "spec.engine.gpuMemoryUtilization in body should be less than or equal to 1"
            ],
        ),
        (
            {**BUILTIN, "engine": {"maxNumSeq": 8}},
            ['strict decoding error: unknown field "spec.engine.maxNumSeq"'],
        ),
        ({**BUILTIN, "replica": 2}, ['strict decoding error: unknown field "spec.replica"']),
        (
            {**BUILTIN, "kvCache": {"offload": {"pvcName": "kv", "sizeLimit": "1Gi"}}},
            [
                "spec.kvCache.offload.sizeLimit: Forbidden: set either kvCache.offload.pvcName "
                "or kvCache.offload.sizeLimit, not both"
            ],
        ),
        (
            {**BUILTIN, "kvCache": {"offload": {}}},
            [
                "spec.kvCache.offload.hostMemoryGiB: Required value: set "
                "kvCache.offload.hostMemoryGiB, or pvcName or sizeLimit for block files"
            ],
        ),
        (
            {**BUILTIN, "replicas": "two"},
            [
                'spec.replicas: Invalid value: "string": spec.replicas in body must be of '
                'type integer: "string"',
                BLOCKED,
            ],
        ),
        (
            {**BUILTIN, "modelCache": {"pvcName": "a", "sizeLimit": "1Gi"}},
            [
                "spec.modelCache.sizeLimit: Forbidden: set either modelCache.pvcName or "
                "modelCache.sizeLimit, not both"
            ],
        ),
        (
            {**BUILTIN, "resources": {"limits": {"memory": "lots"}}},
            [mismatch("spec.resources.limits.memory", "lots", QUANTITY_PATTERN)],
        ),
        (  # a CEL rule on a string shows the value, at the string's own path
            {"model": {"uri": "pvc://claim/../etc"}},
            [
                'spec.model.uri: Invalid value: "pvc://claim/../etc": model.uri: a pvc:// '
                "path must not contain '..' segments"
            ],
        ),
        (  # a bound still lets the CEL rules run; an unsupported value does not
            {**BUILTIN, "replicas": -1, "modelCache": {"pvcName": "a", "sizeLimit": "1Gi"}},
            [
                too_small("spec.replicas", -1, 0),
                "spec.modelCache.sizeLimit: Forbidden: set either modelCache.pvcName or "
                "modelCache.sizeLimit, not both",
            ],
        ),
        (
            {
                **BUILTIN,
                "engine": {"dtype": "fp64"},
                "modelCache": {"pvcName": "a", "sizeLimit": "1Gi"},
            },
            [
                'spec.engine.dtype: Unsupported value: "fp64": supported values: "auto", '
                '"float32", "float16", "bfloat16"',
                BLOCKED,
            ],
        ),
    ],
)
def test_bad_input_is_refused_in_the_api_servers_words(spec, expected):
    """The messages kube-apiserver gives (kube-openapi's wording as apiextensions-apiserver
    reports it, CEL rules at their fieldPath), not jsonschema's."""
    _, errors = admit(resource(spec))
    assert errors == expected


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "a" * 64,
            [
                "metadata.name: Invalid value: metadata.name must be at most 63 characters: "
                "it becomes the Service name and a label value"
            ],
        ),
        (
            "llama-3.1-8b",
            [
                "metadata.name: Invalid value: metadata.name must be a DNS-1035 label "
                "(lowercase letters, digits and '-', starting with a letter, no dots, e.g. "
                "llama-3-1-8b): it becomes the Service name"
            ],
        ),
    ],
)
def test_a_bad_name_is_refused_naming_metadata_name(name, expected):
    """Issue 43: without a fieldPath the API server printed `<nil>: Invalid value: ...`."""
    obj = resource(BUILTIN)
    obj["metadata"]["name"] = name
    assert admit(obj)[1] == expected


def rules(schema: dict, path: str = ""):
    """(path, schema, rule) for every x-kubernetes-validations rule in a schema."""
    for rule in schema.get("x-kubernetes-validations", []):
        yield path or ".", schema, rule
    for key, sub in schema.get("properties", {}).items():
        yield from rules(sub, f"{path}.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            yield from rules(schema[key], f"{path}[*]")


def test_every_rule_on_an_object_names_its_field_with_a_valid_path():
    """kube-apiserver refuses a CRD whose fieldPath leads to no declared property ("must
    be a valid path"), and reports a rule without one at the rule's scope: an object's
    rule without a fieldPath names no field (at the root: `<nil>`)."""
    checked = []
    for path, schema, rule in rules(SCHEMA):
        if schema.get("type") != "object":
            continue
        assert rule.get("fieldPath"), f"{path}: {rule['rule']} has no fieldPath"
        checked.append(apiserver_validation.resolve_field_path(schema, rule["fieldPath"]))
        assert rule.get("reason", "FieldValueInvalid") in {
            "FieldValueInvalid",
            "FieldValueForbidden",
            "FieldValueRequired",
            "FieldValueDuplicate",
        }
    assert checked == [
        "metadata.name",
        "metadata.name",
        "valueFrom",
        "nodes",
        "operator",
        "value",
        "effect",
        "sizeLimit",
        "sizeLimit",  # kvCache.offload
        "hostMemoryGiB",
        "minReplicas",
    ]
    with pytest.raises(ValueError, match="does not refer to a valid field"):
        apiserver_validation.resolve_field_path({"properties": {"metadata": {}}}, ".metadata.name")


BODIES = [
    ("llama", {**load_yaml(EXAMPLE_DIR / "llama.yaml")["spec"]}),
    ("smollm2", load_yaml(EXAMPLE_DIR / "smollm2-cpu.yaml")["spec"]),
    ("tp4", load_yaml(EXAMPLE_DIR / "llama-70b-tp4.yaml")["spec"]),
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


LABEL_VALUE_PATTERN = SPEC["nodeSelector"]["additionalProperties"]["pattern"]
TOLERATION_RULES = {
    "operator": "tolerations operator must be Exists when key is empty (it tolerates every taint)",
    "value": "tolerations value must be empty when operator is Exists",
    "effect": "tolerations effect must be NoExecute when tolerationSeconds is set",
}


def toleration_refusal(field: str) -> str:
    return f"spec.tolerations[0].{field}: Invalid value: {TOLERATION_RULES[field]}"


@pytest.mark.parametrize(
    ("toleration", "expected"),
    [
        ({"key": "gpu", "operator": "Equal", "value": "h100"}, []),
        ({"key": "gpu", "value": "h100"}, []),  # no operator: Equal
        ({"key": "gpu", "operator": "Exists"}, []),
        ({"key": "gpu", "operator": "Exists", "value": ""}, []),
        ({"operator": "Exists"}, []),  # every taint
        ({"key": "", "operator": "Exists", "effect": "NoSchedule"}, []),
        ({"key": "example.com/gpu", "operator": "Exists", "effect": "NoExecute"}, []),
        (
            {"key": "gpu", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30},
            [],
        ),
        # Issue 73: the API server refused the Deployment on every resync.
        ({"key": "a", "operator": "Exists", "value": "x"}, [toleration_refusal("value")]),
        ({"effect": "NoSchedule"}, [toleration_refusal("operator")]),
        ({"key": "", "value": "x"}, [toleration_refusal("operator")]),
        ({"key": "", "operator": "Equal"}, [toleration_refusal("operator")]),
        (
            {"key": "gpu", "operator": "Exists", "tolerationSeconds": 30},
            [toleration_refusal("effect")],
        ),
        (
            {"key": "gpu", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 30},
            [toleration_refusal("effect")],
        ),
        (
            {"key": "gpu", "operator": "Sideways"},
            [
                'spec.tolerations[0].operator: Unsupported value: "Sideways": supported '
                'values: "Exists", "Equal"',
                BLOCKED,
            ],
        ),
        (
            {"key": "gpu", "operator": "Exists", "effect": "NoRun"},
            [
                'spec.tolerations[0].effect: Unsupported value: "NoRun": supported values: '
                '"NoSchedule", "PreferNoSchedule", "NoExecute"',
                BLOCKED,
            ],
        ),
        (
            {"key": "a b", "operator": "Exists"},
            [
                mismatch(
                    "spec.tolerations[0].key",
                    "a b",
                    SPEC["tolerations"]["items"]["properties"]["key"]["pattern"],
                )
            ],
        ),
        (
            {"key": "gpu", "value": "-h100"},
            [mismatch("spec.tolerations[0].value", "-h100", LABEL_VALUE_PATTERN)],
        ),
    ],
)
def test_tolerations_the_api_server_would_refuse_in_a_pod_are_refused(toleration, expected):
    """kube-apiserver's rules for a pod's tolerations, in the CRD: a toleration it would
    refuse in the Deployment is refused when the InferenceService is applied."""
    assert admit(resource({**BUILTIN, "tolerations": [toleration]}))[1] == expected


SECRET_KEY_RULE = "a Secret key must not be '.' or start with '..'"


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"engine": {"env": [{"name": "A", "value": "1"}]}}, []),
        ({"engine": {"env": [{"name": "A", "valueFrom": {"secretKeyRef": {}}}]}}, []),
        ({"engine": {"env": [{"name": "A", "value": "", "valueFrom": {"fieldRef": {}}}]}}, []),
        (
            {"engine": {"env": [{"name": "A", "value": "1", "valueFrom": {"fieldRef": {}}}]}},
            [
                "spec.engine.env[0].valueFrom: Invalid value: engine.env valueFrom may not be "
                "set together with a value"
            ],
        ),
        (
            {"engine": {"env": [{"name": "1A", "value": "1"}]}},
            [
                mismatch(
                    "spec.engine.env[0].name",
                    "1A",
                    ENGINE["env"]["items"]["properties"]["name"]["pattern"],
                )
            ],
        ),
        ({"engine": {"apiKeySecretRef": {"name": "keys", "key": ".api"}}}, []),
        ({"model": {"uri": "hf://org/m", "tokenSecretRef": {"name": "hf", "key": "tok"}}}, []),
        (
            {"engine": {"apiKeySecretRef": {"name": "keys", "key": "..api"}}},
            [f'spec.engine.apiKeySecretRef.key: Invalid value: "..api": {SECRET_KEY_RULE}'],
        ),
        (
            {"model": {"uri": "hf://org/m", "tokenSecretRef": {"name": "hf", "key": "."}}},
            [f'spec.model.tokenSecretRef.key: Invalid value: ".": {SECRET_KEY_RULE}'],
        ),
        (
            {"engine": {"apiKeySecretRef": {"name": "Keys", "key": "api"}}},
            [
                mismatch(
                    "spec.engine.apiKeySecretRef.name",
                    "Keys",
                    ENGINE["apiKeySecretRef"]["properties"]["name"]["pattern"],
                )
            ],
        ),
        (
            {"nodeSelector": {"pool": "gpu pool"}},
            [mismatch("spec.nodeSelector.pool", "gpu pool", LABEL_VALUE_PATTERN)],
        ),
        (
            {"resources": {"requests": {"cpu": "-1"}}},
            [mismatch("spec.resources.requests.cpu", "-1", QUANTITY_PATTERN)],
        ),
        (
            {"resources": {"limits": {"nvidia.com/gpu": -1}}},
            [too_small("spec.resources.limits.nvidia.com/gpu", -1, 0)],
        ),
        (
            {"router": {"resources": {"limits": {"cpu": "-500m"}}}},
            [mismatch("spec.router.resources.limits.cpu", "-500m", QUANTITY_PATTERN)],
        ),
        (
            {"router": {"resources": {"claims": []}}},
            ['strict decoding error: unknown field "spec.router.resources.claims"'],
        ),
        (
            {"engine": {"image": "ghcr.io/x/y:1 "}},
            [mismatch("spec.engine.image", "ghcr.io/x/y:1 ", ENGINE["image"]["pattern"])],
        ),
        (
            {"ingress": {"host": "10.0.0.1:80"}},
            [
                mismatch(
                    "spec.ingress.host",
                    "10.0.0.1:80",
                    SPEC["ingress"]["properties"]["host"]["pattern"],
                )
            ],
        ),
        ({"ingress": {"host": "*.llm.example.com", "className": "nginx"}}, []),
        (
            {"monitoring": {"podMonitorLabels": {"release": "kube prometheus"}}},
            [
                mismatch(
                    "spec.monitoring.podMonitorLabels.release",
                    "kube prometheus",
                    LABEL_VALUE_PATTERN,
                )
            ],
        ),
    ],
)
def test_pass_through_values_the_api_server_would_refuse_are_refused(spec, expected):
    """Values the spec hands on to a container, a pod, an Ingress or a PodMonitor as they
    are: refused by the CRD where the API server would refuse the object built from them."""
    assert admit(resource({**BUILTIN, **spec}))[1] == expected
