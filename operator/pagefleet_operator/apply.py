"""Execute a plan. Server-side apply makes create and patch idempotent; a delete of
something already gone is a success."""

from __future__ import annotations

from .kube import Kube
from .plan import Plan


def apply_plan(kube: Kube, plan: Plan) -> None:
    for obj in plan.to_create + plan.to_patch:
        kube.apply(obj)
    for obj in plan.to_delete:
        meta = obj["metadata"]
        kube.delete(obj["kind"], meta["namespace"], meta["name"])
