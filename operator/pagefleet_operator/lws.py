"""A LeaderWorkerSet (leaderworkerset.x-k8s.io/v1, the Kubernetes SIG project) for a model
spread over several nodes: each replica is a group of spec.parallelism.nodes pods, the
leader running the API server and rank 0, the workers engine ranks only (`--headless`),
joining the leader through the environment LeaderWorkerSet injects (LWS_LEADER_ADDRESS,
LWS_WORKER_INDEX; LWS_GROUP_SIZE is the node count, passed as --nnodes too).

LeaderCreated, not LeaderReady: the leader is ready only once every rank has joined, so
workers held back until then would never start. RecreateGroupOnPodRestart: one lost
rank breaks the group's collectives, so the whole group restarts. spec.replicas counts
groups; a group is ready when all its pods are (LeaderWorkerSet's status.readyReplicas).
"""

from __future__ import annotations

from typing import Any

from .names import get_object_meta, get_selector_labels
from .pod import get_pod_template
from .spec import InferenceServiceSpec

API_VERSION = "leaderworkerset.x-k8s.io/v1"
KIND = "LeaderWorkerSet"
# Labels LeaderWorkerSet puts on every pod of a group (api/leaderworkerset/v1).
SET_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LEADER_WORKER_INDEX = "0"


def get_serving_selector_labels(name: str, spec: InferenceServiceSpec) -> dict[str, str]:
    """The pods that serve the API: every pod, or only the groups' leaders (workers
    serve no port)."""
    labels = get_selector_labels(name)
    if spec.parallelism.multi_node:
        labels[WORKER_INDEX_LABEL] = LEADER_WORKER_INDEX
    return labels


def get_leader_worker_set(
    body: dict[str, Any], spec: InferenceServiceSpec
) -> dict[str, Any] | None:
    if not spec.parallelism.multi_node:
        return None
    name = body["metadata"]["name"]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": get_object_meta(body),
        "spec": {
            # Groups; the InferenceService's spec.replicas stays the source of truth.
            "replicas": spec.replicas,
            "startupPolicy": "LeaderCreated",
            # As the Deployment's: a new group comes up before an old one goes.
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "leaderWorkerTemplate": {
                "size": spec.parallelism.nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": get_pod_template(name, spec, "leader"),
                "workerTemplate": get_pod_template(name, spec, "worker"),
            },
        },
    }
