"""One operator per scope (issue 43, item 8), as the chart renders it with real Helm: the
operator's Lease RBAC and scope annotation, and single-operator.yaml refusing an install
whose scope overlaps another release's operator.

Offline, `lookup` answers nothing; the refusal is rendered from a copy of the chart whose
one `lookup` call is replaced by a value holding what the cluster would answer, so the
template's own logic is what runs."""

from __future__ import annotations

import shutil

import pytest

from tests.chart.chart_render import CHART_DIR, NAMESPACE, RELEASE, find, render, the

helm = pytest.importorskip("helm_python")

LOOKUP = '(lookup "apps/v1" "Deployment" "" "")'


def operator_deployment(release: str, namespace: str, watched: list[str]) -> dict:
    """Another release's operator Deployment as the API server would list it."""
    deployment = the(render({"operator": {"watchNamespaces": watched}}), "Deployment")
    deployment["metadata"]["namespace"] = namespace
    deployment["metadata"]["labels"]["app.kubernetes.io/instance"] = release
    return deployment


def render_with_cluster(tmp_path, existing: list[dict], values: dict | None = None):
    chart = tmp_path / "pagefleet"
    shutil.copytree(CHART_DIR, chart)
    guard = chart / "templates" / "single-operator.yaml"
    text = guard.read_text()
    assert text.count(LOOKUP) == 1
    guard.write_text(text.replace(LOOKUP, ".Values.clusterAnswer"))
    (chart / "values.schema.json").unlink()  # the copy's extra value is not in the schema
    with helm.Chart.load(chart) as loaded:
        return loaded.render(
            values={**(values or {}), "clusterAnswer": {"items": existing}},
            name=RELEASE,
            namespace=NAMESPACE,
            is_install=True,
        )


def test_the_operator_states_its_scope_and_may_hold_its_lease():
    for watched, annotation in (([], ""), (["ml", "ai"], "ml,ai")):
        objects = render({"operator": {"watchNamespaces": watched}})
        deployment = the(objects, "Deployment")
        assert deployment["metadata"]["annotations"]["pagefleet.dev/watch-namespaces"] == (
            annotation
        )
        roles = find(objects, "ClusterRole" if not watched else "Role", "pagefleet-operator")
        assert roles
        for role in roles:
            lease_rules = [r for r in role["rules"] if "leases" in r["resources"]]
            assert {v for r in lease_rules for v in r["verbs"]} == {"create", "get", "patch"}


@pytest.mark.parametrize(
    ("theirs", "mine", "scope"),
    [
        ([], [], "all namespaces"),
        (["ml"], [], "ml"),
        ([], ["ml"], "all namespaces"),
        (["ml", "ai"], ["ai"], "ml, ai"),
    ],
    ids=["both-cluster-wide", "theirs-namespaced", "mine-namespaced", "shared-namespace"],
)
def test_a_second_operator_on_an_overlapping_scope_is_refused(tmp_path, theirs, mine, scope):
    other = operator_deployment("first", "ops", theirs)
    with pytest.raises(helm.HelmRenderError) as refused:
        render_with_cluster(tmp_path, [other], {"operator": {"watchNamespaces": mine}})
    message = str(refused.value)
    assert "one PageFleet operator per scope" in message
    assert f'release "first" in namespace "ops" already runs one for {scope}' in message


def test_disjoint_scopes_and_the_release_itself_are_fine(tmp_path):
    other = operator_deployment("first", "ops", ["ml"])
    itself = operator_deployment(RELEASE, NAMESPACE, [])  # an upgrade sees its own operator
    rendered = render_with_cluster(
        tmp_path, [other, itself], {"operator": {"watchNamespaces": ["ai"]}}
    )
    assert any(path.endswith("deployment.yaml") for path in rendered)
