"""spec.adapters brought to running pods through their runtime API (adapter_sync.py): the
plan from what a pod serves to what the spec lists, then the operator's own calls against
a real `pagefleet serve` with an API key and runtime LoRA updating (as the operator starts
its pods): loads, unloads, a changed uri, what a pod refuses (an unreadable adapter, a
wrong key) reported per adapter and per pod, and the API key read from its Secret."""

from __future__ import annotations

import base64

import httpx
import pytest
from pagefleet_operator.adapter_sync import plan_adapters, read_api_key, sync_pod
from pagefleet_operator.env import get_env
from pagefleet_operator.spec import parse_spec
from pagefleet_serve.model_uri import PVC_MOUNT_DIR

from tests.operator.operator_samples import DEFAULT_IMAGE, make_body
from tests.server.server_harness import ServerProcess
from tests.server.test_server_lora import write_adapter

KEY = "adapter-sync-key"


def test_the_plan_unloads_what_the_spec_lacks_and_loads_what_the_pod_lacks():
    served = {"a": "/a", "b": "/b", "old": "/old"}
    wanted = {"a": "/a", "b": "/b2", "new": "/new"}
    assert plan_adapters(served, wanted) == (["b", "old"], [("b", "/b2"), ("new", "/new")])
    assert plan_adapters(wanted, wanted) == ([], [])
    assert plan_adapters({}, {"a": "/a"}) == ([], [("a", "/a")])


def test_the_pods_open_their_runtime_api_only_with_adapters_changed_at_runtime():
    def env(**spec) -> dict[str, str]:
        body = make_body({"model": {"uri": "hf://org/m"}, **spec})
        parsed = parse_spec(body["spec"], default_image=DEFAULT_IMAGE)
        return {e["name"]: e.get("value") for e in get_env(parsed)}

    adapters = [{"name": "sql", "uri": "hf://org/sql"}]
    assert env(adapters=adapters)["PAGEFLEET_ALLOW_RUNTIME_LORA_UPDATING"] == "true"
    assert "PAGEFLEET_ALLOW_RUNTIME_LORA_UPDATING" not in env()
    rollout = env(adapters=adapters, engine={"runtimeLoraUpdating": False})
    assert "PAGEFLEET_ALLOW_RUNTIME_LORA_UPDATING" not in rollout


def test_the_pods_read_adapters_on_the_claim_when_the_operator_loads_them():
    """A pod's runtime API reads a local adapter only under --allowed-lora-root: the
    operator sets it to the claim's mount when the model is on a claim (where pvc://
    adapters lie), and not otherwise."""

    def env(model: str, uri: str) -> dict[str, str]:
        body = make_body({"model": {"uri": model}, "adapters": [{"name": "sql", "uri": uri}]})
        parsed = parse_spec(body["spec"], default_image=DEFAULT_IMAGE)
        return {e["name"]: e.get("value") for e in get_env(parsed)}

    on_claim = env("pvc://models/llama", "pvc://models/sql")
    assert on_claim["PAGEFLEET_ALLOWED_LORA_ROOT"] == PVC_MOUNT_DIR
    assert env("pvc://models/llama", "hf://org/sql") == on_claim  # the template stays
    assert "PAGEFLEET_ALLOWED_LORA_ROOT" not in env("hf://org/m", "hf://org/sql")


class SecretsOnly:
    """The one Kube call read_api_key makes."""

    def __init__(self, secrets: dict[str, dict]) -> None:
        self.secrets = secrets

    def get(self, kind: str, namespace: str, name: str) -> dict | None:
        assert (kind, namespace) == ("Secret", "ns")
        return self.secrets.get(name)


def test_the_api_key_is_read_from_its_secret_and_a_missing_one_is_named():
    def spec(ref):
        engine = {"apiKeySecretRef": ref} if ref else {}
        body = make_body({"model": {"uri": "hf://org/m"}, "engine": engine})
        return parse_spec(body["spec"], default_image=DEFAULT_IMAGE)

    data = {"data": {"key": base64.b64encode(f"{KEY}\n".encode()).decode()}}
    kube = SecretsOnly({"api": data})
    assert read_api_key(kube, "ns", spec({"name": "api", "key": "key"})) == KEY
    assert read_api_key(kube, "ns", spec(None)) is None
    with pytest.raises(ValueError, match="Secret gone does not exist"):
        read_api_key(kube, "ns", spec({"name": "gone", "key": "key"}))
    with pytest.raises(ValueError, match="Secret api has no key other"):
        read_api_key(kube, "ns", spec({"name": "api", "key": "other"}))


@pytest.fixture(scope="module")
def adapters_root(tmp_path_factory):
    return tmp_path_factory.mktemp("adapters")


@pytest.fixture(scope="module")
def adapters(adapters_root):
    return {name: write_adapter(adapters_root / name, 4, seed) for seed, name in enumerate("abc")}


@pytest.fixture(scope="module")
def pod(adapters, adapters_root):
    process = ServerProcess(
        "--host",
        "127.0.0.1",
        "--lora-modules",
        f"a={adapters['a']}",
        "--api-key",
        KEY,
        env={
            "PAGEFLEET_SERVED_MODEL_NAME": "smol",
            "PAGEFLEET_MAX_MODEL_LEN": "256",
            "PAGEFLEET_KV_CACHE_MEMORY": "32MiB",
            "PAGEFLEET_ENABLE_LORA": "true",
            "PAGEFLEET_ALLOW_RUNTIME_LORA_UPDATING": "true",
            # As the operator starts a pod whose adapters lie on its claim.
            "PAGEFLEET_ALLOWED_LORA_ROOT": str(adapters_root),
        },
    ).wait_ready()
    try:
        yield process
    finally:
        process.stop()


def served(pod: ServerProcess) -> dict[str, str]:
    answer = httpx.get(f"{pod.base_url}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    return {c["id"]: c["root"] for c in answer.json()["data"] if c.get("parent")}


def test_a_pod_is_brought_to_the_spec_through_its_own_api(pod, adapters):
    a, b, c = adapters["a"], adapters["b"], adapters["c"]
    result = sync_pod("pod-0", pod.base_url, {"a": a, "b": b}, KEY)
    assert (result.loaded, result.unloaded, dict(result.pending)) == (("b",), (), {})
    assert served(pod) == {"a": a, "b": b}
    assert not sync_pod("pod-0", pod.base_url, {"a": a, "b": b}, KEY).changed

    # "a" removed, "b" from another uri: unloaded, then loaded from there
    result = sync_pod("pod-0", pod.base_url, {"b": c}, KEY)
    assert (result.loaded, result.unloaded) == (("b",), ("a", "b"))
    assert served(pod) == {"b": c}

    # an adapter the pod cannot read is reported with the pod's reason; the rest goes on
    result = sync_pod("pod-0", pod.base_url, {"b": c, "bad": "/nowhere", "a": a}, KEY)
    assert result.loaded == ("a",) and set(result.pending) == {"bad"}
    assert result.pending["bad"].startswith("load from /nowhere: HTTP 400: ")
    assert served(pod) == {"a": a, "b": c}

    # without the right key, nothing is asked of the pod but its list
    result = sync_pod("pod-0", pod.base_url, {}, "wrong")
    assert not result.changed and result.pending[""].startswith("its /v1/models: HTTP 401")
    assert served(pod) == {"a": a, "b": c}
