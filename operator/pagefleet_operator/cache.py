"""What the operator's watches already hold, so that a reconcile need not ask again.

kopf watches every kind of child the operator makes (those labelled as ours) and every
PersistentVolumeClaim, and keeps them in its indexes (handlers.py); before any handler
runs, each index has its whole list. A reconcile reads them here instead of a GET per
possible child (about 12 per reconcile, a 404 for each child a spec does not have).
Which optional APIs the cluster serves (PodMonitor, LeaderWorkerSet) comes from a
discovery poll here too, instead of a discovery request per reconcile.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

# An index maps its keys to stores of values (kopf.Index); list() of a store is one C
# call over a dict, so a worker thread reads it whole while the event loop updates it.
Index = Mapping[Any, Any]


class WatchCache:
    def __init__(self, children: Index, claims: Index):
        """`children`: (kind, namespace, name) -> the objects we own, as last watched;
        `claims`: (namespace, name) -> a value for each PersistentVolumeClaim."""
        self.children = children
        self.claims = claims
        # (apiVersion, plural) -> whether discovery lists it, as last polled.
        self.served: dict[tuple[str, str], bool] = {}

    def holds(self, kind: str) -> bool:
        return kind == "PersistentVolumeClaim" or kind in WATCHED_KINDS

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The watched object (for a claim, its name only), or None: not there when the
        watch last saw it (or, for a child, not labelled as ours)."""
        if kind == "PersistentVolumeClaim":
            found = list(self.claims.get((namespace, name), ()))
            return {"metadata": {"name": name, "namespace": namespace}} if found else None
        found = list(self.children.get((kind, namespace, name), ()))
        return dict(found[0]) if found else None

    def refresh_served(
        self, apis: Mapping[str, tuple[str, str]], discover: Callable[[str, str], bool]
    ) -> list[str]:
        """Poll discovery for each kind's (apiVersion, plural) in `apis`; the kinds whose
        answer changed since the last poll (not those seen for the first time)."""
        changed = []
        for kind, key in apis.items():
            served = discover(*key)
            if key in self.served and self.served[key] != served:
                changed.append(kind)
            self.served[key] = served
        return changed


# Kinds the operator makes, watched with its label selector (handlers.py); a cluster
# without a kind's CRD has no watch of it until the CRD appears.
WATCHED_KINDS = (
    "Deployment",
    "LeaderWorkerSet",
    "Service",
    "Ingress",
    "PodDisruptionBudget",
    "PodMonitor",
    "InferencePool",
    "ConfigMap",
    "ServiceAccount",
    "Role",
    "RoleBinding",
)
