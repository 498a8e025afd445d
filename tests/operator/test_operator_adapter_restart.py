"""spec.engine.runtimeLoraUpdating: true (the default) keeps today's path, a ConfigMap
the pods re-read, so an adapter change leaves the pod template byte-identical; false puts
the adapters into the pod template as `--lora-modules` arguments, with no ConfigMap and
no volume, so a change changes the template (and its hash label) and the Deployment rolls
the pods. The builders, the CRD field in both copies, and the operator process against
the API emulator."""

from __future__ import annotations

import json

import pytest
import pytest_asyncio
from pagefleet_operator.adapters import get_adapters_config_map
from pagefleet_operator.deployment import get_deployment
from pagefleet_operator.names import TEMPLATE_HASH_LABEL
from pagefleet_operator.spec import SpecError, parse_spec
from pagefleet_serve.cli import build_parser
from pagefleet_serve.config import LoRAModule

from tests.operator import apiserver_validation
from tests.operator.operator_samples import CRD_PATH, DEFAULT_IMAGE, REPO, load_yaml, make_body
from tests.operator.test_operator_emulator import (
    ISVC,
    ApiServerEmulator,
    declare_resources,
    eventually,
    isvc_path,
    make_isvc,
    run_operator,
    stored,
)

MODEL = {"uri": "pvc://weights/llama"}
SQL = {"name": "sql", "uri": "hf://org/sql-lora@v2"}
SUPPORT = {"name": "support", "uri": "pvc://weights/adapters/support"}
CHART_CRD_PATH = REPO / "charts" / "pagefleet" / "crds" / CRD_PATH.name


def template(adapters: list, runtime: bool | None) -> dict:
    engine = {} if runtime is None else {"runtimeLoraUpdating": runtime}
    body = make_body({"model": MODEL, "adapters": adapters, "engine": engine})
    spec = parse_spec(body["spec"], default_image=DEFAULT_IMAGE)
    return get_deployment(body, spec)["spec"]["template"]


def serve_args(template: dict) -> list[str]:
    return template["spec"]["containers"][0].get("args", [])


def test_off_the_adapters_are_arguments_the_pod_parses():
    pod = template([SQL, SUPPORT], runtime=False)
    args = serve_args(pod)
    assert args == ["--lora-modules", "sql=hf://org/sql-lora@v2",
                    "support=file:///mnt/models/adapters/support"]  # fmt: skip
    # what `pagefleet serve` makes of them: the adapters, through the engine's checks
    parsed = build_parser("serve").parse_args(["serve", *args])
    assert [LoRAModule.parse(item) for item in parsed.lora_modules] == [
        LoRAModule("sql", "hf://org/sql-lora@v2"),
        LoRAModule("support", "file:///mnt/models/adapters/support"),
    ]
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["PAGEFLEET_ENABLE_LORA"] == "true" and "PAGEFLEET_LORA_MODULES_FILE" not in env
    assert all(v["name"] != "adapters" for v in pod["spec"]["volumes"])
    body = make_body({"model": MODEL, "adapters": [SQL], "engine": {"runtimeLoraUpdating": False}})
    spec = parse_spec(body["spec"], default_image=DEFAULT_IMAGE)
    assert get_adapters_config_map(body, spec) is None


def test_off_an_adapter_change_changes_the_template_on_it_stays_byte_identical():
    def hash_of(pod: dict) -> str:
        return pod["metadata"]["labels"][TEMPLATE_HASH_LABEL]

    changes = ([SQL], [SQL, SUPPORT], [SUPPORT])
    off = [template(adapters, runtime=False) for adapters in changes]
    assert len({json.dumps(pod, sort_keys=True) for pod in off}) == 3
    assert len({hash_of(pod) for pod in off}) == 3  # the hash drives the rollout
    for runtime in (True, None):  # on, explicitly or by default
        on = {json.dumps(template(adapters, runtime), sort_keys=True) for adapters in changes}
        assert len(on) == 1
    # the switch itself rolls the pods: the file and its volume replace the arguments
    assert hash_of(template([SQL], runtime=True)) != hash_of(off[0])
    # no adapters: the switch changes nothing
    assert template([], runtime=False) == template([], runtime=True)


def test_the_switch_must_be_a_boolean():
    with pytest.raises(SpecError, match="must be bool") as info:
        parse_spec(
            {"model": MODEL, "engine": {"runtimeLoraUpdating": "no"}}, default_image=DEFAULT_IMAGE
        )
    assert info.value.field_path == "engine.runtimeLoraUpdating"


@pytest.mark.parametrize("path", [CRD_PATH, CHART_CRD_PATH], ids=["crds", "chart"])
def test_both_crds_declare_the_switch_defaulting_to_true(path):
    schema = load_yaml(path)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    field = schema["properties"]["spec"]["properties"]["engine"]["properties"]
    assert field["runtimeLoraUpdating"]["type"] == "boolean"

    def admit(engine: dict) -> tuple[dict, list[str]]:
        obj = {
            "apiVersion": "pagefleet.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "x"},
            "spec": {"model": MODEL, "adapters": [SQL], "engine": engine},
        }
        return apiserver_validation.admit(schema, obj)

    stored_obj, errors = admit({})
    assert errors == [] and stored_obj["spec"]["engine"]["runtimeLoraUpdating"] is True
    assert admit({"runtimeLoraUpdating": False})[1] == []
    error = admit({"runtimeLoraUpdating": "no"})[1][0]
    assert error == (
        'spec.engine.runtimeLoraUpdating: Invalid value: "string": '
        'spec.engine.runtimeLoraUpdating in body must be of type boolean: "string"'
    )


@pytest_asyncio.fixture
async def operator(kmock, tmp_path):
    declare_resources(kmock)
    async with run_operator(kmock, tmp_path, "--liveness", "") as client:
        yield client


@pytest.mark.kmock(cls=ApiServerEmulator)
@pytest.mark.asyncio
async def test_off_an_adapter_change_rolls_the_pods_against_the_api_emulator(kmock, operator):
    """No ConfigMap; each change of adapters rewrites the Deployment's template (the
    Deployment controller then replaces the pods); turning the switch on brings the
    ConfigMap and the file in place of the arguments."""
    sql, support = {"name": "sql", "uri": "hf://org/sql-lora"}, {"name": "b", "uri": "hf://o/b"}
    spec = {
        "model": {"uri": "builtin://smollm2-135m"},
        "replicas": 1,
        "adapters": [sql],
        "engine": {"runtimeLoraUpdating": False},
    }
    await operator.call("POST", isvc_path(), make_isvc("chat", spec))

    def args() -> list[str] | None:
        live = stored(kmock, "apps/v1/deployments", "chat")
        return live and live["spec"]["template"]["spec"]["containers"][0].get("args")

    def reconciled() -> bool:
        isvc = stored(kmock, ISVC, "chat")
        status = isvc.get("status") or {}
        return status.get("observedGeneration") == isvc["metadata"]["generation"]

    await eventually(lambda: args() == ["--lora-modules", "sql=hf://org/sql-lora"], what="args")
    await eventually(reconciled, what="status of the first generation")
    version = stored(kmock, "apps/v1/deployments", "chat")["metadata"]["resourceVersion"]
    await operator.call("PATCH", isvc_path("chat"), {"spec": {"adapters": [sql, support]}})
    want = ["--lora-modules", "sql=hf://org/sql-lora", "b=hf://o/b"]
    await eventually(lambda: args() == want, what="the new adapters' args")
    live = stored(kmock, "apps/v1/deployments", "chat")
    assert live["metadata"]["resourceVersion"] != version  # written: a rollout
    assert stored(kmock, "v1/configmaps", "chat-adapters") is None

    await operator.call(
        "PATCH", isvc_path("chat"), {"spec": {"engine": {"runtimeLoraUpdating": True}}}
    )
    await eventually(
        lambda: stored(kmock, "v1/configmaps", "chat-adapters"), what="the adapters' ConfigMap"
    )
    await eventually(lambda: not args(), what="the arguments gone")
    pod = stored(kmock, "apps/v1/deployments", "chat")["spec"]["template"]["spec"]
    assert {"name": "adapters", "configMap": {"name": "chat-adapters"}} in pod["volumes"]
