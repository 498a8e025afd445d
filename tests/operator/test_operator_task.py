"""spec.task: what the pods serve. The CRD admits generate or embed (default generate,
the engine's TASKS but auto), the operator checks it again, passes embed to the pods as
`--task embed` (which the pod's own flag parser reads), leaves a generate pod's flags as
they were, and a change of task rolls the pods."""

from __future__ import annotations

import pytest
from pagefleet_operator.deployment import get_deployment
from pagefleet_operator.names import TEMPLATE_HASH_LABEL
from pagefleet_operator.pod import get_container
from pagefleet_operator.spec import SPEC_TASKS, SpecError, parse_spec
from pagefleet_serve.config import TASKS

from tests.operator import apiserver_validation
from tests.operator.operator_samples import CRD_PATH, DEFAULT_IMAGE, load_yaml, make_body

SCHEMA = load_yaml(CRD_PATH)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
MODEL = {"uri": "hf://Qwen/Qwen3-Embedding-0.6B"}


def admit(spec: dict) -> tuple[dict, list[str]]:
    obj = {
        "apiVersion": "pagefleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "x"},
        "spec": spec,
    }
    return apiserver_validation.admit(SCHEMA, obj)


def test_the_crd_enum_is_the_engines_tasks_but_auto():
    task = SCHEMA["properties"]["spec"]["properties"]["task"]
    assert task["enum"] == list(SPEC_TASKS) == [t for t in TASKS if t != "auto"]
    assert task["default"] == "generate"
    stored, errors = admit({"model": MODEL})
    assert errors == [] and stored["spec"]["task"] == "generate"
    assert admit({"model": MODEL, "task": "embed"})[1] == []
    refused = admit({"model": MODEL, "task": "classify"})[1]
    assert refused[0] == (
        'spec.task: Unsupported value: "classify": supported values: "generate", "embed"'
    )


def test_embed_becomes_the_pods_task_flag():
    spec = parse_spec({"model": MODEL, "task": "embed"}, default_image=DEFAULT_IMAGE)
    assert spec.task == "embed"
    args = get_container("demo", spec)["args"]
    assert args[args.index("--task") + 1] == "embed"
    # What the pod's own parser makes of them.
    from pagefleet_serve.cli import build_parser

    parsed = build_parser("serve").parse_args(["serve", *args])
    assert parsed.task == "embed"


def test_generate_leaves_the_pods_flags_as_they_were():
    default = parse_spec({"model": MODEL}, default_image=DEFAULT_IMAGE)
    explicit = parse_spec({"model": MODEL, "task": "generate"}, default_image=DEFAULT_IMAGE)
    assert default.task == explicit.task == "generate"
    for spec in (default, explicit):
        assert "--task" not in get_container("demo", spec).get("args", [])


def test_a_bad_task_is_a_spec_error_naming_the_field():
    with pytest.raises(SpecError) as refused:
        parse_spec({"model": MODEL, "task": "auto"}, default_image=DEFAULT_IMAGE)
    assert "task" in str(refused.value) and "'auto'" in str(refused.value)


def test_changing_the_task_rolls_the_pods():
    def template_hash(task: str) -> str:
        body = make_body({"model": MODEL, "task": task})
        spec = parse_spec(body["spec"], default_image=DEFAULT_IMAGE)
        labels = get_deployment(body, spec)["spec"]["template"]["metadata"]["labels"]
        return labels[TEMPLATE_HASH_LABEL]

    assert template_hash("embed") != template_hash("generate")
