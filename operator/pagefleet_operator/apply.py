"""Execute a plan. Server-side apply makes create and patch idempotent; a delete of
something already gone is a success."""

from __future__ import annotations

from dataclasses import dataclass

from .kube import Kube, KubeError
from .plan import Plan


class ApplyError(KubeError):
    """The API server refused to write an object of this kind (counted per kind)."""

    def __init__(self, kind: str, cause: KubeError):
        super().__init__(cause.status, f"{kind}: {cause.message}")
        self.kind = kind


@dataclass(frozen=True)
class Change:
    verb: str  # created, updated or deleted
    kind: str
    name: str


def apply_plan(kube: Kube, plan: Plan) -> list[Change]:
    """What the API server actually wrote: an apply that changed nothing is not a change."""
    changes = []
    for item in plan.to_apply:
        try:
            live = kube.apply(item.desired)
        except KubeError as exc:
            raise ApplyError(item.desired["kind"], exc) from exc
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
        try:
            kube.delete(obj["kind"], meta["namespace"], meta["name"])
        except KubeError as exc:
            raise ApplyError(obj["kind"], exc) from exc
        changes.append(Change("deleted", obj["kind"], meta["name"]))
    return changes
