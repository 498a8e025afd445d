"""plan(desired, observed): what to create, patch and delete, and when nothing."""

from __future__ import annotations

import copy

import pytest
from pagefleet_operator.plan import Plan, contains, is_drifted, plan

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
        # Fresh resource: everything is created.
        (
            {"Deployment": DEPLOYMENT, "Service": SERVICE},
            {"Deployment": None, "Service": None},
            Plan(to_create=(DEPLOYMENT, SERVICE)),
        ),
        # Unchanged (server-filled fields, dropped empty lists): no writes at all.
        (
            {"Deployment": DEPLOYMENT, "Service": SERVICE},
            {"Deployment": as_served(DEPLOYMENT), "Service": as_served(SERVICE)},
            Plan(),
        ),
        # A spec change touches only the object that differs.
        (
            {"Deployment": obj("Deployment", {"replicas": 3}), "Service": SERVICE},
            {"Deployment": as_served(DEPLOYMENT), "Service": as_served(SERVICE)},
            Plan(to_patch=(obj("Deployment", {"replicas": 3}),)),
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
        # The API server canonicalises quantities.
        (
            {"limits": {"cpu": "1", "memory": "1Gi"}},
            {"limits": {"cpu": "1000m", "memory": "1024Mi"}},
            True,
        ),
        ({"requests": {"nvidia.com/gpu": "1"}}, {"requests": {"nvidia.com/gpu": 1}}, True),
        ({"limits": {"cpu": "2"}}, {"limits": {"cpu": "1"}}, False),
        ({"emptyDir": {"sizeLimit": "20Gi"}}, {"emptyDir": {"sizeLimit": "20480Mi"}}, True),
        # ...but only where it does: an env value "010" is not "10".
        ({"value": "010"}, {"value": "10"}, False),
        ({"a": False}, {"a": False}, True),
        ({"a": 0}, {"a": False}, False),
    ],
)
def test_contains(have, want, same):
    assert contains(have, want) is same


def test_manual_drift_is_detected():
    observed = as_served(DEPLOYMENT)
    observed["spec"]["template"]["containers"][0]["image"] = "evil:latest"
    assert not is_drifted(DEPLOYMENT, observed)  # an extra field we never set: not ours
    observed["spec"]["replicas"] = 9
    assert is_drifted(DEPLOYMENT, observed)


def test_label_drift_is_detected():
    desired = obj("Deployment", {}, labels={"pagefleet.dev/template-hash": "abc"})
    observed = as_served(desired)
    assert not is_drifted(desired, observed)
    observed["metadata"]["labels"]["pagefleet.dev/template-hash"] = "old"
    assert is_drifted(desired, observed)
