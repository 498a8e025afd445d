"""The chart and LeaderWorkerSet, an optional dependency: the operator's rendered RBAC
grants what a multi-node InferenceService needs, and the README says how to install it."""

from __future__ import annotations

from tests.chart.chart_render import CHART_DIR, find, render


def operator_rules(values: dict | None = None) -> list[list[dict]]:
    return [
        role["rules"]
        for role in find(render(values), "ClusterRole") + find(render(values), "Role")
        if role["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"
    ]


def grants(rules: list[dict], group: str, resource: str, *verbs: str) -> bool:
    return any(
        group in rule["apiGroups"]
        and resource in rule["resources"]
        and set(verbs) <= set(rule["verbs"])
        and "resourceNames" not in rule
        for rule in rules
    )


def test_the_rendered_rbac_grants_leader_worker_sets_and_their_scale():
    for values in (None, {"operator": {"watchNamespaces": ["ml", "prod"]}}):
        every_role = operator_rules(values)
        assert every_role
        for rules in every_role:
            lws = "leaderworkerset.x-k8s.io"
            verbs = ("get", "list", "watch", "create", "patch", "delete")
            assert grants(rules, lws, "leaderworkersets", *verbs)
            assert grants(rules, lws, "leaderworkersets/scale", "get", "patch")
            assert grants(rules, "apps", "statefulsets", "list")
            assert not grants(rules, lws, "leaderworkersets/status", "patch")


def test_the_readme_documents_leader_worker_set_as_optional():
    readme = (CHART_DIR / "README.md").read_text()
    assert "## Optional dependency: LeaderWorkerSet" in readme
    assert "helm install lws oci://registry.k8s.io/lws/charts/lws" in readme
    assert "LeaderWorkerSetNotInstalled" in readme
