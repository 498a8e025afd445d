"""A PodDisruptionBudget, so a node drain never takes every replica down at once."""

from __future__ import annotations

from typing import Any

from .names import get_object_meta, get_selector_labels
from .spec import InferenceServiceSpec


def get_pdb(body: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any] | None:
    # With a single replica a budget would block drains forever; with none it is moot.
    if spec.replicas <= 1:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": get_object_meta(body),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": get_selector_labels(body["metadata"]["name"])},
        },
    }
