"""spec.router.preciseRouting: the router's Deployment given what precise prefix routing
needs, checked against the objects the operator builds for the serving pods and the
router's own command line: the pods' KV event sockets (their ports, their topic), the
model's tokenizer from the Hub with the model's token, a writable cache under the
read-only root; the CRD admits the field; a spec the router could not serve is refused
naming what is missing."""

from __future__ import annotations

import kubernetes_validate
import pytest
from pagefleet_operator.desired import get_desired_objects
from pagefleet_operator.spec import SpecError, parse_spec
from pagefleet_router.cli import get_parser
from pagefleet_router.kv_feed import FeedSettings
from pagefleet_serve.config import KVEventsConfig

from tests.operator import apiserver_validation
from tests.operator.operator_samples import CRD_PATH, DEFAULT_IMAGE, load_yaml, make_body

ISVC_SCHEMA = load_yaml(CRD_PATH)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
PRECISE = {
    "model": {"uri": "hf://org/chat@v2", "tokenSecretRef": {"name": "hf", "key": "token"}},
    "engine": {"kvEvents": {"enabled": True}, "blockSize": 32},
    "router": {"enabled": True, "preciseRouting": True},
}


def desired_of(spec: dict) -> dict:
    body = make_body(spec)
    return get_desired_objects(body, parse_spec(body["spec"], default_image=DEFAULT_IMAGE))


def containers(deployment: dict) -> list[dict]:
    return deployment["spec"]["template"]["spec"]["containers"]


def test_the_router_follows_the_pods_kv_sockets_and_reads_the_models_tokenizer():
    desired = desired_of(PRECISE)
    (router,) = containers(desired["RouterDeployment"])
    (serving,) = containers(desired["Deployment"])
    args = get_parser().parse_args(router["args"])
    assert (args.tokenizer, args.kv_block_size) == ("hf://org/chat@v2", 32)
    # The sockets the router subscribes to are the serving container's named ports, on
    # the pod's address as discovery gives it; the topic is the pods' own.
    pod_env = {e["name"]: e.get("value") for e in serving["env"]}
    config = KVEventsConfig.from_json(pod_env["PAGEFLEET_KV_EVENTS_CONFIG"])
    ports = {p["name"]: p["containerPort"] for p in serving["ports"]}
    feed = FeedSettings(args.kv_events_endpoint, args.kv_replay_endpoint, args.kv_events_topic)
    assert feed.endpoints("http://10.1.2.3:8000") == (
        f"tcp://10.1.2.3:{ports['kv-events']}",
        f"tcp://10.1.2.3:{ports['kv-replay']}",
    )
    assert config.endpoint.endswith(f":{ports['kv-events']}")
    assert args.kv_events_topic == config.topic
    # A gated model's token, as the pods get it; the Hub client's cache in a writable /tmp.
    (token,) = [e for e in router["env"] if e["name"] == "HF_TOKEN"]
    assert token["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert router["securityContext"]["readOnlyRootFilesystem"] is True
    assert router["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    pod = desired["RouterDeployment"]["spec"]["template"]["spec"]
    assert [v["name"] for v in pod["volumes"]] == ["tmp"] and "emptyDir" in pod["volumes"][0]
    kubernetes_validate.validate(desired["RouterDeployment"], "1.33", strict=True)


def test_without_it_the_router_has_none_of_it_and_the_block_size_is_the_default():
    plain = {**PRECISE, "router": {"enabled": True}}
    (router,) = containers(desired_of(plain)["RouterDeployment"])
    assert not any(a.startswith(("--kv-", "--tokenizer")) for a in router["args"])
    assert "env" not in router and "volumeMounts" not in router
    default_blocks = {**PRECISE, "engine": {"kvEvents": {"enabled": True}}}
    (router,) = containers(desired_of(default_blocks)["RouterDeployment"])
    assert not any(a.startswith("--kv-block-size") for a in router["args"])
    assert get_parser().parse_args(router["args"]).kv_block_size == 16  # the engine's too


def test_the_crd_admits_it_and_defaults_it_off():
    obj = make_body(PRECISE)
    stored, errors = apiserver_validation.admit(ISVC_SCHEMA, obj)
    assert errors == [] and stored["spec"]["router"]["preciseRouting"] is True
    del obj["spec"]["router"]["preciseRouting"]
    stored, errors = apiserver_validation.admit(ISVC_SCHEMA, obj)
    assert errors == [] and stored["spec"]["router"]["preciseRouting"] is False


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"router": {"preciseRouting": True}}, "needs the router: set spec.router.enabled"),
        ({"engine": {}}, "needs the pods' KV cache events: set spec.engine.kvEvents.enabled"),
        ({"model": {"uri": "pvc://models/chat"}}, "needs an hf://org/name"),
        ({"model": {"uri": "builtin://smollm2-135m"}}, "got builtin://smollm2-135m"),
        ({"model": {"uri": "hf://org/chat-GGUF/chat-q4.gguf"}}, "or a .gguf file"),
    ],
)
def test_a_spec_the_router_could_not_serve_is_refused_naming_what_is_missing(change, message):
    body = make_body(PRECISE | change)
    with pytest.raises(SpecError, match=r"spec\.router\.preciseRouting: ") as refused:
        parse_spec(body["spec"], default_image=DEFAULT_IMAGE)
    assert message in str(refused.value)
