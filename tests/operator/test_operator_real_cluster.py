"""What a real kube-apiserver, kubelet and Helm enforce that the emulator does not
(issue 20): checked here the way the API server would check them."""

from __future__ import annotations

import copy
import logging

import celpy
import jsonschema
import pytest
from pagefleet_operator.deployment import get_deployment
from pagefleet_operator.pod import STARTUP_BUDGET_SECONDS
from pagefleet_operator.rbac import RULES
from pagefleet_operator.reconcile import reconcile
from pagefleet_operator.spec import parse_spec

from tests.operator.operator_samples import DEFAULT_IMAGE, REPO, load_yaml, make_body
from tests.operator.test_operator_crd import SCHEMA, admit, resource
from tests.operator.test_operator_reconcile import BUILTIN, FakeKube, run


def schema_nodes(schema: dict, path: str = ""):
    """(path, node) for every node of a structural schema."""
    yield path or ".", schema
    for key, sub in schema.get("properties", {}).items():
        yield from schema_nodes(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        yield from schema_nodes(schema["items"], f"{path}[*]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from schema_nodes(schema["additionalProperties"], f"{path}[*]")


def rules_on(schema: dict, value, path: str = ""):
    """(path, rule, value) for every CEL rule that applies to `value`, nested ones on the
    parts the value has: nothing is defaulted first, as at CRD creation."""
    for rule in schema.get("x-kubernetes-validations", []):
        yield path, rule, value
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                yield from rules_on(sub, value[key], f"{path}.{key}")


def holds(rule: str, value) -> bool:
    env = celpy.Environment()
    program = env.program(env.compile(rule))
    try:
        result = program.evaluate({"self": celpy.json_to_cel(value)})
    except celpy.CELEvalError:
        return False  # e.g. "no such key": the API server refuses the CRD
    return isinstance(result, celpy.celtypes.BoolType) and bool(result)


def test_every_cel_rule_holds_on_every_raw_default():
    """kube-apiserver validates each `default` against its schema, CEL rules included,
    when the CRD is created, on the default as written: a rule that reads a field the
    raw default lacks makes `helm install` fail."""
    checked = []
    for path, node in schema_nodes(SCHEMA):
        if "default" not in node:
            continue
        # The structural part too (types, bounds, patterns), on the raw default.
        assert [
            e.message for e in jsonschema.Draft4Validator(node).iter_errors(node["default"])
        ] == []
        for rule_path, rule, value in rules_on(node, copy.deepcopy(node["default"])):
            assert holds(rule["rule"], value), f"{path}{rule_path}: {rule['rule']} on {value!r}"
            checked.append(path)
    assert ".spec.autoscaling" in checked


@pytest.mark.parametrize(
    ("name", "complaint"),
    [
        ("llama-3.1-8b", "DNS-1035"),
        ("Llama", "DNS-1035"),
        ("8b-llama", "DNS-1035"),
        ("a" * 64, "at most 63"),
        ("x" * 200, "at most 63"),
    ],
)
def test_names_that_break_children_are_refused(name, complaint):
    obj = resource({"model": {"uri": "builtin://smollm2-135m"}})
    obj["metadata"]["name"] = name
    _, errors = admit(obj)
    assert any(complaint in e for e in errors), errors
    # An object that slipped past the CRD: Degraded, and no child is created.
    kube = FakeKube(make_body(BUILTIN, name=name))
    reconcile_body = kube.body(name)
    kube.writes.clear()
    outcome = reconcile(kube, reconcile_body, default_image=DEFAULT_IMAGE, now=lambda: "T")
    assert outcome.problem.reason == "InvalidName"
    assert complaint in outcome.problem.message
    assert [w for w in kube.writes if w[0] != "status"] == []


def test_longest_valid_name_is_admitted():
    obj = resource({"model": {"uri": "builtin://smollm2-135m"}})
    obj["metadata"]["name"] = "a" + "-b" * 31  # 63 characters
    assert admit(obj)[1] == []


INGRESS = {
    "host": "llm.example.com",
    "className": "nginx",
    "tlsSecretName": "llm-tls",
    "annotations": {"example.com/team": "ml"},
}


def test_fields_removed_from_the_spec_disappear_from_the_live_ingress():
    kube = FakeKube(make_body({**BUILTIN, "ingress": INGRESS}))
    run(kube)
    live = kube.get("Ingress", "ml", "demo")
    assert live["spec"]["ingressClassName"] == "nginx" and live["spec"]["tls"]
    kube.objects[("InferenceService", "ml", "demo")]["spec"]["ingress"] = {"host": INGRESS["host"]}
    outcome = run(kube)
    assert [(c.verb, c.kind) for c in outcome.changes] == [("updated", "Ingress")]
    live = kube.get("Ingress", "ml", "demo")
    assert "ingressClassName" not in live["spec"]
    assert "tls" not in live["spec"]
    assert "example.com/team" not in live["metadata"]["annotations"]
    # The SSE annotations the operator still sets stay.
    assert live["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"


def test_fields_others_add_cause_no_endless_updates():
    kube = FakeKube(make_body(BUILTIN))
    run(kube)
    # A mutating webhook injects a sidecar; someone annotates the Deployment.
    live = kube.objects[("Deployment", "ml", "demo")]
    live["spec"]["template"]["spec"]["containers"].append({"name": "istio-proxy", "image": "p"})
    live["metadata"]["annotations"] = {"example.com/owner": "ops"}
    for _ in range(2):
        outcome = run(kube)
        assert outcome.changes == ()
        assert [w for w in kube.writes if w[0] != "status"] == []
    containers = kube.get("Deployment", "ml", "demo")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["server", "istio-proxy"]


def test_a_spec_change_is_applied_and_reported_once():
    kube = FakeKube(make_body(BUILTIN))
    run(kube)
    kube.objects[("InferenceService", "ml", "demo")]["spec"]["engine"] = {"maxNumSeqs": 8}
    assert [(c.verb, c.kind) for c in run(kube).changes] == [("updated", "Deployment")]
    assert run(kube).changes == ()


def test_rbac_allows_setting_block_owner_deletion():
    """OwnerReferencesPermissionEnforcement (on in OpenShift) refuses a child whose
    ownerReference has blockOwnerDeletion unless the creator may update the owner's
    finalizers."""
    assert {
        "apiGroups": ["pagefleet.dev"],
        "resources": ["inferenceservices/finalizers"],
        "verbs": ["update"],
    } in RULES


def test_progress_deadline_covers_the_startup_probe_budget():
    body = make_body(BUILTIN)
    deployment = get_deployment(body, parse_spec(body["spec"], default_image=DEFAULT_IMAGE))
    startup = deployment["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    assert budget == STARTUP_BUDGET_SECONDS
    assert deployment["spec"]["progressDeadlineSeconds"] > budget


def test_pod_security_context_suits_large_cache_volumes():
    body = make_body(BUILTIN)
    deployment = get_deployment(body, parse_spec(body["spec"], default_image=DEFAULT_IMAGE))
    pod_spec = deployment["spec"]["template"]["spec"]
    assert pod_spec["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"


def test_recent_recommendations_stay_bounded():
    from pagefleet_operator.autoscale import PodSample
    from pagefleet_operator.scaler import autoscale_once

    spec = {
        **BUILTIN,
        "replicas": 2,
        "autoscaling": {
            "enabled": True,
            "maxReplicas": 4,
            "intervalSeconds": 5,
            "scaleDownStabilizationSeconds": 3600,
        },
    }
    kube = FakeKube(make_body(spec))
    loads = [0.1, 0.9, 0.5, 0.3]
    for i in range(720):  # an hour of rounds every 5 s
        samples = [PodSample(p, True, loads[i % 4], 0) for p in ("a", "b")]
        autoscale_once(
            kube,
            kube.body(),
            default_image=DEFAULT_IMAGE,
            scrape=lambda _, s=samples: s,
            clock=lambda i=i: 1e9 + 5 * i,
        )
    history = kube.body()["status"]["autoscaler"]["recentRecommendations"]
    assert len(history) <= 4  # one per replica count in [minReplicas, maxReplicas]


def test_openshift_restricted_v2_gets_no_fixed_user_ids():
    """restricted-v2 assigns each namespace a uid range and refuses pods that pick their
    own uid/fsGroup outside it; with the switch the platform chooses."""
    body = make_body(BUILTIN)
    spec = parse_spec(body["spec"], default_image=DEFAULT_IMAGE, fixed_user_ids=False)
    context = get_deployment(body, spec)["spec"]["template"]["spec"]["securityContext"]
    assert not {"runAsUser", "runAsGroup", "fsGroup"} & context.keys()
    assert context["runAsNonRoot"] is True
    fixed = get_deployment(body, parse_spec(body["spec"], default_image=DEFAULT_IMAGE))
    assert fixed["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 1000


def test_operator_flags_reach_the_config():
    from pagefleet_operator import __main__ as cli

    args = cli.get_parser().parse_args(
        ["--platform-assigns-user-ids", "--allowed-image-prefix", "registry.example.com/"]
    )
    assert args.platform_assigns_user_ids is True
    assert args.allowed_image_prefix == ["registry.example.com/"]


def test_the_llama_example_says_its_shared_cache_must_be_read_write_many():
    text = (REPO / "examples" / "llama.yaml").read_text()
    spec = load_yaml(REPO / "examples" / "llama.yaml")["spec"]
    assert spec["modelCache"]["pvcName"] and spec["autoscaling"]["maxReplicas"] > 1
    assert "accessModes: [ReadWriteMany]" in text


def test_api_trouble_warns_once_per_run_of_retries(monkeypatch):
    """kopf retries a failed reconcile every 10 s; an Event per retry floods the
    resource's Events. One Warning when the trouble starts; the retries only log."""
    import kopf
    from pagefleet_operator import handlers
    from pagefleet_operator.config import OperatorConfig
    from pagefleet_operator.kube import KubeError
    from pagefleet_operator.telemetry import OperatorMetrics

    class Unavailable(FakeKube):
        def get(self, kind, namespace, name):
            raise KubeError(503, "etcd is unavailable")

    warnings = []
    monkeypatch.setattr(kopf, "warn", lambda body, reason, message: warnings.append(reason))
    body = make_body(BUILTIN)
    memo = {
        "kube": Unavailable(body),
        "config": OperatorConfig(default_image=DEFAULT_IMAGE),
        "metrics": OperatorMetrics(),
    }
    for retry in range(4):
        with pytest.raises(kopf.TemporaryError):
            handlers._reconcile(body, memo, logging.getLogger("test"), retry)
    assert warnings == ["ReconcileFailed"]
    # Every retry is counted, though only the first one warns.
    registry = memo["metrics"].registry
    assert (
        registry.get_sample_value("pagefleet_operator_reconciles_total", {"result": "error"}) == 4
    )
