"""spec.adapters: LoRA adapters the pods serve from start-up. The CRD admits them (unique
DNS-1123 names, the engine's URI forms), the operator checks them again and passes them to
the pods as --enable-lora / --lora-modules (a pvc:// one on the model's claim as its mounted
path), and a change of adapters rolls the pods."""

from __future__ import annotations

import apiserver_validation
import pytest
from operator_samples import CRD_PATH, DEFAULT_IMAGE, load_yaml, make_body
from pagefleet_operator.deployment import get_deployment
from pagefleet_operator.env import get_env
from pagefleet_operator.names import TEMPLATE_HASH_LABEL
from pagefleet_operator.spec import AdapterSpec, SpecError, parse_spec
from pagefleet_serve.config import EngineConfig, LoRAModule

SCHEMA = load_yaml(CRD_PATH)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
MODEL = {"uri": "pvc://weights/llama"}
ADAPTERS = [
    {"name": "sql", "uri": "hf://org/sql-lora@v2"},
    {"name": "support", "uri": "pvc://weights/adapters/support"},
]


def parsed(spec: dict):
    return parse_spec(spec, default_image=DEFAULT_IMAGE)


def env_of(spec: dict) -> dict:
    return {e["name"]: e.get("value") for e in get_env(parsed(spec))}


def test_adapters_become_the_engines_lora_flags():
    spec = {"model": MODEL, "adapters": ADAPTERS, "engine": {"maxLoras": 2, "maxLoraRank": 32}}
    assert parsed(spec).adapters == (
        AdapterSpec("sql", "hf://org/sql-lora@v2"),
        AdapterSpec("support", "file:///mnt/models/adapters/support"),
    )
    env = env_of(spec)
    assert env["PAGEFLEET_ENABLE_LORA"] == "true"
    assert env["PAGEFLEET_MAX_LORAS"] == "2" and env["PAGEFLEET_MAX_LORA_RANK"] == "32"
    modules = env["PAGEFLEET_LORA_MODULES"]
    assert modules == "sql=hf://org/sql-lora@v2 support=file:///mnt/models/adapters/support"
    # What the pod's flag parsing makes of the variable (EnvFlags splits on spaces/commas).
    config = EngineConfig(enable_lora=True, lora_modules=tuple(modules.split()))
    assert config.lora_modules[1] == LoRAModule("support", "file:///mnt/models/adapters/support")


def test_no_adapters_no_lora_flags():
    env = env_of({"model": MODEL})
    assert "PAGEFLEET_ENABLE_LORA" not in env and "PAGEFLEET_LORA_MODULES" not in env


def test_changing_the_adapters_rolls_the_pods():
    def template_hash(adapters):
        body = make_body({"model": MODEL, "adapters": adapters})
        labels = get_deployment(body, parsed(body["spec"]))["spec"]["template"]["metadata"]
        return labels["labels"][TEMPLATE_HASH_LABEL]

    assert template_hash(ADAPTERS) != template_hash(ADAPTERS[:1]) != template_hash([])
    assert template_hash(ADAPTERS) == template_hash([dict(a) for a in ADAPTERS])


@pytest.mark.parametrize(
    ("adapters", "field"),
    [
        ([{"name": "Bad_Name", "uri": "hf://org/a"}], "adapters[0].name"),
        (
            [{"name": "a", "uri": "hf://org/a"}, {"name": "a", "uri": "hf://org/b"}],
            "adapters[1].name",
        ),
        ([{"name": "llama", "uri": "hf://org/a"}], "adapters[0].name"),  # the model's name
        ([{"name": "a"}], "adapters[0].uri"),
        ([{"name": "a", "uri": "ftp://x"}], "adapters[0].uri"),
        ([{"name": "a", "uri": "builtin://smollm2-135m"}], "adapters[0].uri"),
        ([{"name": "a", "uri": "pvc://other-claim/a"}], "adapters[0].uri"),
        (["a=hf://org/a"], "adapters[0]"),
    ],
)
def test_bad_adapters_name_the_field(adapters, field):
    with pytest.raises(SpecError) as info:
        parsed({"model": MODEL, "adapters": adapters})
    assert info.value.field_path == field


def test_the_crd_admits_adapters_and_refuses_bad_ones():
    def errors(spec: dict) -> list[str]:
        obj = {
            "apiVersion": "pagefleet.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "x"},
            "spec": spec,
        }
        return apiserver_validation.admit(SCHEMA, obj)[1]

    assert errors({"model": MODEL, "adapters": ADAPTERS, "engine": {"maxLoras": 4}}) == []
    [bad_name] = errors({"model": MODEL, "adapters": [{"name": "Bad_Name", "uri": "hf://o/a"}]})
    assert bad_name.startswith('spec.adapters[0].name: Invalid value: "Bad_Name"')
    missing = errors({"model": MODEL, "adapters": [{"name": "a"}]})
    assert missing[0] == "spec.adapters[0].uri: Required value"
    assert errors({"model": MODEL, "engine": {"maxLoras": 0}})
