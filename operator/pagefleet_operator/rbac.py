"""Exactly the API access the operator needs, in one place.

`python -m pagefleet_operator rbac` prints it as a ClusterRole; the Helm chart keeps a
copy and its test compares the two. kopf itself needs the InferenceService watch and
patch (for its annotations) and Event creation. Every kind it makes is listed and watched
(the watch cache reconciles read, see cache.py), and CustomResourceDefinitions too: kopf
starts the watch of a kind whose CRD appears after the operator (LeaderWorkerSet,
PodMonitor). In a Role (operator.watchNamespaces) that rule grants nothing, and the
operator does not scan: such a kind is watched from the next start.
"""

from __future__ import annotations

from typing import Any

from . import GROUP, PLURAL
from .leader import LEASE_NAME

RULES: list[dict[str, Any]] = [
    {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"], "verbs": ["patch"]},
    # Children carry blockOwnerDeletion: true; with the OwnerReferencesPermissionEnforcement
    # admission plugin (on in OpenShift) setting it needs update on the owner's finalizers.
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/finalizers"], "verbs": ["update"]},
    # The autoscaler writes spec.replicas through the same door as `kubectl scale`; get
    # because the routers' Roles it creates read the scale too (RBAC grants only what the
    # granter holds).
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/scale"], "verbs": ["get", "patch"]},
    # Server-side apply creates through PATCH, which needs both verbs.
    {
        "apiGroups": ["apps"],
        "resources": ["deployments"],
        # delete: the router's Deployment, when spec.router goes away.
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    # Services are deleted only when spec.router goes away (its headless pod Service).
    {
        "apiGroups": [""],
        "resources": ["services"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    {
        "apiGroups": ["networking.k8s.io"],
        "resources": ["ingresses"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    {
        "apiGroups": ["policy"],
        "resources": ["poddisruptionbudgets"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    # The serving pods' PodMonitor, with spec.monitoring.podMonitor (whether the cluster
    # serves the CRD is asked through discovery, which every account may read).
    {
        "apiGroups": ["monitoring.coreos.com"],
        "resources": ["podmonitors"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    # spec.gateway.inferencePool: the Gateway API Inference Extension's InferencePool (an
    # optional CRD, asked through discovery like PodMonitor's), watched like every child.
    {
        "apiGroups": ["inference.networking.k8s.io"],
        "resources": ["inferencepools"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    # spec.parallelism over several nodes: a LeaderWorkerSet per resource (its CRD is an
    # optional install; discovery says whether it is served), scaled through its scale
    # subresource, and its leader StatefulSets listed to find the leader pods to scrape.
    {
        "apiGroups": ["leaderworkerset.x-k8s.io"],
        "resources": ["leaderworkersets"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    {
        "apiGroups": ["leaderworkerset.x-k8s.io"],
        "resources": ["leaderworkersets/scale"],
        "verbs": ["get", "patch"],
    },
    {"apiGroups": ["apps"], "resources": ["statefulsets"], "verbs": ["list"]},
    # spec.router: the router's ServiceAccount, Role and RoleBinding. Granting a Role
    # needs holding what it grants (RBAC's escalation check): the router lists and
    # watches EndpointSlices and patches the scale subresource (above), so the operator may too.
    {
        "apiGroups": [""],
        "resources": ["serviceaccounts"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    {
        "apiGroups": ["rbac.authorization.k8s.io"],
        "resources": ["roles", "rolebindings"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    {
        "apiGroups": ["discovery.k8s.io"],
        "resources": ["endpointslices"],
        "verbs": ["list", "watch"],
    },
    # Ready pods' IPs for scraping /metrics, found through their owners (the
    # Deployment's ReplicaSets); claims are checked before pods need them.
    {"apiGroups": ["apps"], "resources": ["replicasets"], "verbs": ["list"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
    # spec.adapters: the ConfigMap the serving pods read them from (deleted when they go).
    {
        "apiGroups": [""],
        "resources": ["configmaps"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    # A claim created after its service is noticed at once (handlers.claim_changed).
    {"apiGroups": [""], "resources": ["persistentvolumeclaims"], "verbs": ["get", "list", "watch"]},
    # kopf's scanning (cluster-wide): a CRD installed later is watched from then on.
    {
        "apiGroups": ["apiextensions.k8s.io"],
        "resources": ["customresourcedefinitions"],
        "verbs": ["list", "watch"],
    },
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    # Leader election (leader.py): the Lease of each watched namespace, or the cluster's.
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
    {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "resourceNames": [LEASE_NAME],
        "verbs": ["get", "patch"],
    },
]


def get_cluster_role(name: str = "pagefleet-operator") -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": RULES,
    }
