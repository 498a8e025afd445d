"""spec.adapters: LoRA adapters the pods serve. The CRD admits them (unique DNS-1123
names, the engine's URI forms), the operator checks them again and writes them into the
`<name>-adapters` ConfigMap (a pvc:// one on the model's claim as its mounted path), which
the pods mount and read with --enable-lora --lora-modules-file; a change of adapters
changes the ConfigMap only, never the pod template (the pods apply it without a restart).
"""

from __future__ import annotations

import pytest
from pagefleet_operator.adapters import get_adapters_config_map
from pagefleet_operator.deployment import get_deployment
from pagefleet_operator.env import get_env
from pagefleet_operator.spec import AdapterSpec, SpecError, parse_spec
from pagefleet_serve.config import LoRAModule
from pagefleet_serve.server.lora_file_watcher import parse_lora_modules_file

from tests.operator import apiserver_validation
from tests.operator.operator_samples import CRD_PATH, DEFAULT_IMAGE, load_yaml, make_body

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


def template(adapters: list) -> dict:
    body = make_body({"model": MODEL, "adapters": adapters})
    return get_deployment(body, parsed(body["spec"]))["spec"]["template"]


def test_adapters_become_a_configmap_the_pods_read():
    engine = {"maxLoras": 2, "maxLoraRank": 32, "maxCpuLoras": 3}
    spec = {"model": MODEL, "adapters": ADAPTERS, "engine": engine}
    assert parsed(spec).adapters == (
        AdapterSpec("sql", "hf://org/sql-lora@v2"),
        AdapterSpec("support", "file:///mnt/models/adapters/support"),
    )
    env = env_of(spec)
    assert env["PAGEFLEET_ENABLE_LORA"] == "true"
    assert env["PAGEFLEET_MAX_LORAS"] == "2" and env["PAGEFLEET_MAX_LORA_RANK"] == "32"
    assert env["PAGEFLEET_MAX_CPU_LORAS"] == "3"
    assert env["PAGEFLEET_LORA_MODULES_FILE"] == "/etc/pagefleet/adapters/adapters.json"
    assert "PAGEFLEET_LORA_MODULES" not in env

    body = make_body(spec)
    config_map = get_adapters_config_map(body, parsed(spec))
    assert config_map["metadata"]["name"] == "demo-adapters"
    assert config_map["metadata"]["ownerReferences"][0]["uid"] == body["metadata"]["uid"]
    # What the pod makes of the file: the same adapters, through the same checks.
    content = config_map["data"]["adapters.json"].encode()
    assert parse_lora_modules_file(content, "adapters.json") == (
        LoRAModule("sql", "hf://org/sql-lora@v2"),
        LoRAModule("support", "file:///mnt/models/adapters/support"),
    )
    pod = template(ADAPTERS)["spec"]
    assert {"name": "adapters", "configMap": {"name": "demo-adapters"}} in pod["volumes"]
    mount = {"name": "adapters", "mountPath": "/etc/pagefleet/adapters", "readOnly": True}
    assert mount in pod["containers"][0]["volumeMounts"]  # the directory: no subPath


def test_no_adapters_no_lora_flags_and_no_configmap():
    env = env_of({"model": MODEL})
    assert "PAGEFLEET_ENABLE_LORA" not in env and "PAGEFLEET_LORA_MODULES_FILE" not in env
    assert get_adapters_config_map(make_body({"model": MODEL}), parsed({"model": MODEL})) is None
    assert all(v["name"] != "adapters" for v in template([])["spec"]["volumes"])


def test_changing_the_adapters_leaves_the_pod_template_alone():
    assert template(ADAPTERS) == template(ADAPTERS[:1]) == template(ADAPTERS[::-1])
    assert template(ADAPTERS)["metadata"] != template([])["metadata"]  # adapters on: a rollout


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


def test_host_memory_below_the_device_slots_is_refused():
    with pytest.raises(SpecError, match="below maxLoras 2") as info:
        parsed({"model": MODEL, "adapters": ADAPTERS, "engine": {"maxLoras": 2, "maxCpuLoras": 1}})
    assert info.value.field_path == "engine.maxCpuLoras"
    with pytest.raises(SpecError) as info:
        parsed({"model": MODEL, "engine": {"maxCpuLoras": 0}})
    assert info.value.field_path == "engine.maxCpuLoras"


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
    assert errors({"model": MODEL, "engine": {"maxCpuLoras": 0}})
