"""The chart's part in the Gateway API Inference Extension: `servingPod.inferencePoolByDefault`
reaches the operator as --inference-pool-by-default, and the operator's rendered role
lets it manage InferencePools the way it manages every object it owns."""

from __future__ import annotations

from pagefleet_operator.__main__ import get_parser

from tests.chart.chart_render import find, operator_container, render


def test_the_inference_pool_default_reaches_the_operator():
    assert (
        not get_parser().parse_args(operator_container(render())["args"]).inference_pool_by_default
    )
    objects = render({"servingPod": {"inferencePoolByDefault": True}})
    assert get_parser().parse_args(operator_container(objects)["args"]).inference_pool_by_default


def test_the_operators_role_manages_inference_pools():
    (role,) = [
        r
        for r in find(render(), "ClusterRole")
        if r["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"
    ]
    verbs = {
        verb
        for rule in role["rules"]
        if "inference.networking.k8s.io" in rule["apiGroups"]
        and "inferencepools" in rule["resources"]
        for verb in rule["verbs"]
    }
    # Server-side apply is a patch (create for a new object); turned off, it is deleted.
    assert {"get", "create", "patch", "delete"} <= verbs
