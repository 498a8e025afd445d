"""What Helm and a real cluster do with the chart that a render alone does not show
(issue 20): the order of `helm uninstall`, the roles namespace users get, OpenShift's
uid policy, and the optional serving-pod NetworkPolicy (issue 11)."""

from __future__ import annotations

import pytest
from pagefleet_operator.router import get_router_deployment
from pagefleet_operator.spec import parse_spec

from tests.chart.chart_render import find, helm, operator_container, render, the

HOOK = "helm.sh/hook"


def annotations(obj: dict) -> dict:
    return obj["metadata"].get("annotations") or {}


def hooks(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in find(objects, kind) if annotations(o).get(HOOK) == "pre-delete"]


def test_uninstall_runs_the_cleanup_before_helm_deletes_the_operator():
    """`helm uninstall` runs pre-delete hooks to completion, then deletes the release's
    objects: the cleanup Job finds the operator (and its RBAC) still running, so kopf
    can release its finalizer from every InferenceService the Job deletes."""
    objects = render()
    (job,) = hooks(objects, "Job")
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][0] == "uninstall"
    assert container["image"] == operator_container(objects)["image"]
    # The operator and its permissions are ordinary release objects, not hooks: Helm
    # removes them only after the hook succeeded.
    for kind in ("Deployment", "ClusterRole", "ClusterRoleBinding"):
        operator_objects = [o for o in find(objects, kind) if HOOK not in annotations(o)]
        assert operator_objects, kind
    # The Job's identity is an ordinary release object, not a hook: Helm deletes it only
    # after the hook succeeded, so a Job whose pod did not start before Helm's timeout
    # (which deletes hook-succeeded hooks of a failed phase) can still start later.
    (account,) = [
        o for o in find(objects, "ServiceAccount") if o["metadata"]["name"].endswith("-cleanup")
    ]
    (role,) = [
        o for o in find(objects, "ClusterRole") if o["metadata"]["name"].endswith("-cleanup")
    ]
    (binding,) = [
        o for o in find(objects, "ClusterRoleBinding") if o["metadata"]["name"].endswith("-cleanup")
    ]
    for obj in (account, role, binding):
        assert HOOK not in annotations(obj), obj["kind"]
    assert job["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]
    assert binding["subjects"][0]["name"] == account["metadata"]["name"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    (rule,) = role["rules"]
    assert rule["resources"] == ["inferenceservices"]
    assert {"list", "delete", "patch"} <= set(rule["verbs"])
    # Left for inspection only when it failed.
    assert annotations(job)["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
    # It outlives its own wait, and ends within Helm's default --timeout (300 s).
    timeout = int(container["args"][1].split("=")[1])
    assert timeout < job["spec"]["activeDeadlineSeconds"] < 300


def test_uninstall_cleanup_follows_the_watched_namespaces():
    objects = render({"operator": {"watchNamespaces": ["team-a", "team-b"]}})
    (job,) = hooks(objects, "Job")
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[2:] == ["--namespace=team-a", "--namespace=team-b"]
    assert [
        o for o in find(objects, "ClusterRole") if o["metadata"]["name"].endswith("-cleanup")
    ] == []
    cleanup_roles = [o for o in find(objects, "Role") if o["metadata"]["name"].endswith("-cleanup")]
    assert sorted(r["metadata"]["namespace"] for r in cleanup_roles) == [
        "team-a",
        "team-b",
    ]


def test_uninstall_cleanup_can_be_turned_off():
    objects = render({"uninstall": {"deleteInferenceServices": False}})
    assert [o for o in objects if annotations(o).get(HOOK) == "pre-delete"] == []


def test_namespace_users_get_inference_services_through_the_default_roles():
    objects = render()
    edit, view = (
        the(
            [r for r in find(objects, "ClusterRole") if r["metadata"]["name"].endswith(s)],
            "ClusterRole",
        )
        for s in ("-edit", "-view")
    )
    labels = edit["metadata"]["labels"]
    assert labels["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert labels["rbac.authorization.k8s.io/aggregate-to-admin"] == "true"
    assert {"create", "delete", "patch"} <= set(edit["rules"][0]["verbs"])
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert set(view["rules"][0]["verbs"]) == {"get", "list", "watch"}
    without = find(render({"rbac": {"aggregateToDefaultRoles": False}}), "ClusterRole")
    assert not [r for r in without if r["metadata"]["name"].endswith(("-edit", "-view"))]


def test_openshift_and_image_policy_switches_reach_the_operator():
    objects = render(
        {
            "servingPod": {
                "platformAssignsUserIds": True,
                "allowedImagePrefixes": ["registry.example.com/ml/", "ghcr.io/pagefleet/"],
            }
        }
    )
    args = operator_container(objects)["args"]
    assert "--platform-assigns-user-ids" in args
    assert "--allowed-image-prefix=registry.example.com/ml/" in args
    assert "--allowed-image-prefix=ghcr.io/pagefleet/" in args
    assert "--platform-assigns-user-ids" not in operator_container(render())["args"]


def test_network_policy_admits_only_the_operator_and_the_named_peers():
    router = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress"}}}
    values = {
        "servingPod": {"networkPolicy": {"enabled": True, "namespaces": ["ml"], "from": [router]}}
    }
    (policy,) = find(render(values), "NetworkPolicy")
    assert policy["metadata"]["namespace"] == "ml"
    assert policy["spec"]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/component": "serving",
        "app.kubernetes.io/managed-by": "pagefleet-operator",
    }
    rule, _kv_events = policy["spec"]["ingress"]  # the second: test_chart_contracts.py
    operator_peer, own_router_peer, router_peer = rule["from"]
    assert operator_peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"
    # The operator's router pods (spec.router) in the same namespace, and only those.
    body = {"metadata": {"name": "chat", "namespace": "ml", "uid": "u"}}
    body |= {"apiVersion": "pagefleet.dev/v1alpha1", "kind": "InferenceService"}
    spec = parse_spec(
        {"model": {"uri": "builtin://smollm2-135m"}, "router": {"enabled": True}}, default_image="x"
    )
    router_pod_labels = get_router_deployment(body, spec)["spec"]["template"]["metadata"]["labels"]
    assert own_router_peer.keys() == {"podSelector"}
    assert own_router_peer["podSelector"]["matchLabels"].items() <= router_pod_labels.items()
    assert router_peer == router
    assert find(render(), "NetworkPolicy") == []
    with pytest.raises(helm.HelmError, match="networkPolicy"):
        render({"servingPod": {"networkPolicy": {"enabled": True}}})
