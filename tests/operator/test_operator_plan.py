"""plan(desired, observed): what to apply and delete, and what belongs to someone else.

Whether an apply changed anything is the API server's answer (tested in
test_operator_reconcile.py and test_operator_real_cluster.py), not the plan's guess."""

from __future__ import annotations

import copy

import pytest
from pagefleet_operator.plan import Apply, Plan, contains, plan

OWNER = "uid-1"
REF = {"uid": OWNER, "controller": True, "kind": "InferenceService", "name": "demo"}


def obj(kind: str, spec: dict, owner: str | None = OWNER, **meta) -> dict:
    refs = [{**REF, "uid": owner}] if owner else []
    return {
        "kind": kind,
        "metadata": {"name": "demo", "namespace": "ml", "ownerReferences": refs, **meta},
        "spec": spec,
    }


def as_served(desired: dict) -> dict:
    """What an API server hands back: our fields plus defaults, canonical quantities, status."""
    served = copy.deepcopy(desired)
    served["metadata"].update({"uid": "x", "resourceVersion": "7", "creationTimestamp": "now"})
    served["spec"]["defaulted"] = "by-the-server"
    served["status"] = {"replicas": 1}
    return served


DEPLOYMENT = obj(
    "Deployment", {"replicas": 2, "template": {"containers": [{"name": "s", "args": []}]}}
)
SERVICE = obj("Service", {"ports": [{"port": 8000}]})
PDB = obj("PodDisruptionBudget", {"maxUnavailable": 1})


@pytest.mark.parametrize(
    ("desired", "observed", "expected"),
    [
        # Fresh resource: everything is applied, nothing was there before.
        (
            {"Deployment": DEPLOYMENT, "Service": SERVICE},
            {"Deployment": None, "Service": None},
            Plan(to_apply=(Apply(DEPLOYMENT, None), Apply(SERVICE, None))),
        ),
        # Existing and ours: applied whole again (the server writes only what changed).
        (
            {"Deployment": DEPLOYMENT, "Service": SERVICE},
            {"Deployment": as_served(DEPLOYMENT), "Service": as_served(SERVICE)},
            Plan(to_apply=(Apply(DEPLOYMENT, "7"), Apply(SERVICE, "7"))),
        ),
        # No longer wanted and ours: deleted.
        (
            {"PodDisruptionBudget": None},
            {"PodDisruptionBudget": as_served(PDB)},
            Plan(to_delete=(as_served(PDB),)),
        ),
        # Not wanted and absent: nothing.
        ({"Ingress": None}, {"Ingress": None}, Plan()),
        # Someone else's object with our name: never touched, reported.
        (
            {"Service": SERVICE},
            {"Service": obj("Service", {"ports": []}, owner="other")},
            Plan(conflicts=(obj("Service", {"ports": []}, owner="other"),)),
        ),
        # Someone else's object we do not want: left alone.
        ({"Ingress": None}, {"Ingress": obj("Ingress", {}, owner=None)}, Plan()),
    ],
)
def test_plan(desired, observed, expected):
    assert plan(desired, observed, OWNER) == expected


@pytest.mark.parametrize(
    ("have", "want", "same"),
    [
        ({"a": 1, "b": 2}, {"a": 1}, True),
        ({"a": 1}, {"a": 2}, False),
        ({"a": 1}, {"a": "1"}, False),
        ({}, {"args": [], "env": "", "x": {}}, True),
        ({"l": [1, 2]}, {"l": [1]}, False),
        ({"l": [{"n": 1, "d": 0}]}, {"l": [{"n": 1}]}, True),
        ({"a": False}, {"a": False}, True),
        ({"a": 0}, {"a": False}, False),
    ],
)
def test_contains(have, want, same):
    assert contains(have, want) is same
