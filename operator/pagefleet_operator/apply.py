"""Execute a plan. Server-side apply makes create and patch idempotent; a delete of
something already gone is a success."""

from __future__ import annotations

from dataclasses import dataclass

from .kube import Kube
from .plan import Plan


@dataclass(frozen=True)
class Change:
    verb: str  # created, updated or deleted
    kind: str
    name: str


def apply_plan(kube: Kube, plan: Plan) -> list[Change]:
    """What the API server actually wrote: an apply that changed nothing is not a change."""
    changes = []
    for item in plan.to_apply:
        live = kube.apply(item.desired)
        version = live.get("metadata", {}).get("resourceVersion")
        if item.observed_version is None:
            verb = "created"
        elif version != item.observed_version:
            verb = "updated"
        else:
            continue
        changes.append(Change(verb, item.desired["kind"], item.desired["metadata"]["name"]))
    for obj in plan.to_delete:
        meta = obj["metadata"]
        kube.delete(obj["kind"], meta["namespace"], meta["name"])
        changes.append(Change("deleted", obj["kind"], meta["name"]))
    return changes
