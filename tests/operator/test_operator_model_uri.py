"""spec.model: the CRD's pattern, the operator's validation and the pod's URI parser agree
on every form; a token Secret reaches the pod as HF_TOKEN, never as a literal; hf://
models land on the model cache volume."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from pagefleet_operator.deployment import get_deployment
from pagefleet_operator.env import get_pod_model_uri
from pagefleet_operator.spec import SpecError, parse_spec
from pagefleet_serve import model_uri as uri_module
from pagefleet_serve.model_uri import PVC_MOUNT_DIR, ModelURIError, parse_model_uri

from tests.operator.operator_samples import (
    CRD_PATH,
    DEFAULT_IMAGE,
    example_body,
    load_yaml,
    make_body,
)

MODEL_SCHEMA = load_yaml(CRD_PATH)["spec"]["versions"][0]["schema"]["openAPIV3Schema"][
    "properties"
]["spec"]["properties"]["model"]

# (uri, scheme as the pod parses it, its parts)
ADMITTED = [
    ("hf://org/name", "hf", {"repo_id": "org/name", "revision": None, "filename": None}),
    (
        "hf://meta-llama/Llama-3.1-8B-Instruct",
        "hf",
        {"repo_id": "meta-llama/Llama-3.1-8B-Instruct"},
    ),
    ("hf://Qwen/Qwen2.5-0.5B-Instruct@main", "hf", {"revision": "main"}),
    ("hf://org/name@v1.0", "hf", {"revision": "v1.0"}),
    (
        "hf://org/name@0123456789abcdef0123456789abcdef01234567",
        "hf",
        {"revision": "0123456789abcdef0123456789abcdef01234567"},
    ),
    ("hf://org/name/model.Q4_K_M.gguf", "hf", {"filename": "model.Q4_K_M.gguf"}),
    (
        "hf://org/name@main/sub/dir/model.gguf",
        "hf",
        {"revision": "main", "filename": "sub/dir/model.gguf"},
    ),
    ("pvc://models", "pvc", {"claim": "models", "path": ""}),
    ("pvc://models/llama-3", "pvc", {"claim": "models", "path": "llama-3"}),
    ("pvc://my-claim/a/b/model.gguf", "pvc", {"claim": "my-claim", "path": "a/b/model.gguf"}),
    ("file:///models/llama", "file", {"path": "/models/llama"}),
    ("file:///models/model.gguf", "file", {"path": "/models/model.gguf"}),
    ("builtin://smollm2-135m", "builtin", {"builtin": "smollm2-135m"}),
]
# Refused by the CRD and by the operator (objects can slip past a CRD without its schema).
REFUSED = [
    "hf://org",
    "hf://org/",
    "hf://org/name/weights.bin",
    "hf://org/name/",
    "hf://-org/name",
    "hf://org/na me",
    "hf://org/name@",
    "hf://org/name@a@b",
    "pvc://Bad_Claim/x",
    "pvc://",
    "file://relative/path",
    "builtin://gpt-5",
    "builtin://tiny-random",  # a test model of the CLI, not shipped for clusters
    "s3://bucket/model",
    "/models/llama",
    "models/llama",
]


def crd_admits(uri: str) -> bool:
    return jsonschema.Draft4Validator(MODEL_SCHEMA).is_valid({"uri": uri})


def operator_accepts(uri: str) -> bool:
    try:
        parse_spec({"model": {"uri": uri}}, default_image=DEFAULT_IMAGE)
    except SpecError as exc:
        if exc.field_path != "model.uri":
            raise AssertionError(f"refused at {exc.field_path}, not model.uri") from exc
        return False
    return True


@pytest.mark.parametrize(("uri", "scheme", "parts"), ADMITTED, ids=[u for u, *_ in ADMITTED])
def test_admitted_forms_parse_the_same_everywhere(uri, scheme, parts):
    assert crd_admits(uri)
    assert operator_accepts(uri)
    parsed = parse_model_uri(uri)
    assert parsed.scheme == scheme
    assert {key: getattr(parsed, key) for key in parts} == parts
    spec = parse_spec({"model": {"uri": uri}}, default_image=DEFAULT_IMAGE)
    assert spec.model.parsed == parsed


@pytest.mark.parametrize("uri", REFUSED)
def test_refused_forms_are_refused_by_crd_and_operator(uri):
    assert not crd_admits(uri)
    assert not operator_accepts(uri)


def test_parser_errors_name_the_allowed_forms():
    with pytest.raises(ModelURIError, match=r"not hf://org/name\[@revision\]\[/file\.gguf\]"):
        parse_model_uri("hf://org/name/weights.bin")
    with pytest.raises(ModelURIError, match=r"unsupported scheme; use hf://"):
        parse_model_uri("s3://bucket/model")
    with pytest.raises(SpecError, match=r"spec\.model\.uri: .*pvc://claim-name/path"):
        parse_spec({"model": {"uri": "pvc://Bad_Claim/x"}}, default_image=DEFAULT_IMAGE)


def test_pvc_model_is_mounted_where_the_pod_resolver_looks():
    body = make_body({"model": {"uri": "pvc://models/llama-3"}})
    spec = parse_spec(body["spec"], default_image=DEFAULT_IMAGE)
    assert get_pod_model_uri(spec) == f"file://{PVC_MOUNT_DIR}/llama-3"
    pod = get_deployment(body, spec)["spec"]["template"]["spec"]
    assert {"name": "model", "mountPath": PVC_MOUNT_DIR, "readOnly": True} in pod["containers"][0][
        "volumeMounts"
    ]


def pod_env(body) -> list[dict]:
    spec = parse_spec(body["spec"], default_image=DEFAULT_IMAGE)
    return get_deployment(body, spec)["spec"]["template"]["spec"]["containers"][0]["env"]


def test_token_secret_ref_becomes_hf_token_from_the_secret():
    body = make_body(
        {"model": {"uri": "hf://org/gated", "tokenSecretRef": {"name": "hf", "key": "token"}}}
    )
    env = pod_env(body)
    token = [e for e in env if e["name"] == "HF_TOKEN"]
    assert token == [
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    ]
    names = {e["name"]: e.get("value") for e in env}
    assert names["PAGEFLEET_MODEL"] == "hf://org/gated"
    # Downloads land on the model cache volume.
    container = get_deployment(body, parse_spec(body["spec"], default_image=DEFAULT_IMAGE))["spec"][
        "template"
    ]["spec"]["containers"][0]
    cache_mount = next(m for m in container["volumeMounts"] if m["name"] == "model-cache")
    assert names["HF_HOME"].startswith(cache_mount["mountPath"] + "/")


def test_no_token_no_hf_token_env():
    env = pod_env(make_body({"model": {"uri": "hf://org/public"}}))
    assert "HF_TOKEN" not in {e["name"] for e in env}


@pytest.mark.parametrize("ref", [{"name": "hf"}, {"key": "token"}, {}])
def test_incomplete_token_secret_ref_is_refused(ref):
    with pytest.raises(SpecError, match=r"spec\.model\.tokenSecretRef: needs both name and key"):
        parse_spec(
            {"model": {"uri": "hf://org/x", "tokenSecretRef": ref}}, default_image=DEFAULT_IMAGE
        )
    assert not jsonschema.Draft4Validator(MODEL_SCHEMA).is_valid(
        {"uri": "hf://org/x", "tokenSecretRef": ref}
    )


def test_llama_example_reads_its_token_from_a_secret():
    body = example_body("llama.yaml")
    assert crd_admits(body["spec"]["model"]["uri"])
    assert jsonschema.Draft4Validator(MODEL_SCHEMA).is_valid(body["spec"]["model"])
    env = pod_env(body)
    token = next(e for e in env if e["name"] == "HF_TOKEN")
    assert token == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}},
    }
    assert not any(e.get("value", "").startswith("hf_") for e in env)


@pytest.mark.parametrize(
    ("uri", "served"),
    [
        ("hf://meta-llama/Llama-3.1-8B-Instruct", "Llama-3.1-8B-Instruct"),
        ("hf://org/name@v2", "name"),
        ("hf://org/name@main/model.Q4_K_M.gguf", "model.Q4_K_M"),
        ("pvc://models/llama-3/", "llama-3"),
        ("pvc://models", "models"),
        ("file:///models/tiny.gguf", "tiny"),
        ("builtin://smollm2-135m", "smollm2-135m"),
    ],
)
def test_default_served_name_is_the_models_own(uri, served):
    assert (
        parse_spec({"model": {"uri": uri}}, default_image=DEFAULT_IMAGE).model.served_name == served
    )


def test_the_uri_parser_and_the_vocabulary_import_nothing_else():
    """What the operator shares with the pod loads alone (a fresh interpreter): the URI
    parser imports nothing of the package (no circle with the Hub downloader, which
    imports it), and the config and metric names add only it, never torch."""
    code = (
        "import sys\n"
        "import pagefleet_serve.model_uri\n"
        "alone = sorted(m for m in sys.modules if m.startswith('pagefleet_serve'))\n"
        "import pagefleet_serve.config, pagefleet_serve.metric_names\n"
        "shared = sorted(m for m in sys.modules if m.startswith('pagefleet_serve'))\n"
        "print(alone, shared, 'torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    package = ["pagefleet_serve", "pagefleet_serve.model_uri"]
    shared = sorted([*package, "pagefleet_serve.config", "pagefleet_serve.metric_names"])
    assert out.strip() == f"{package} {shared} False"
    # Not even inside a function (where the Hub downloader's import used to be).
    tree = ast.parse(Path(uri_module.__file__).read_text())
    imported = [
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    ]
    assert not [name for name in imported if name and name.startswith("pagefleet")], imported
