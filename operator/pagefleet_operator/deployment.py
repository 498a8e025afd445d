"""The Deployment that runs the serving pods."""

from __future__ import annotations

from typing import Any

from .names import get_object_meta, get_selector_labels
from .pod import STARTUP_BUDGET_SECONDS, get_pod_template
from .spec import InferenceServiceSpec

# Image pull and scheduling come before the startup probe's first try.
PROGRESS_MARGIN_SECONDS = 600


def get_deployment(body: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any] | None:
    if spec.parallelism.multi_node:
        return None  # a LeaderWorkerSet's groups run the pods (lws.py)
    name = body["metadata"]["name"]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": get_object_meta(body),
        "spec": {
            # spec.replicas of the resource is the single source of truth, whoever wrote it
            # (a user, `kubectl scale`, an HPA, or our autoscaler through the scale subresource).
            "replicas": spec.replicas,
            "selector": {"matchLabels": get_selector_labels(name)},
            # Bring a new pod up before taking an old one down: capacity never drops in a rollout.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "revisionHistoryLimit": 3,
            # A large model may load for the whole startup-probe budget: the rollout is
            # only "stuck" once that has passed (the default 600 s would call a healthy
            # 30-minute load ProgressDeadlineExceeded, i.e. Degraded).
            "progressDeadlineSeconds": STARTUP_BUDGET_SECONDS + PROGRESS_MARGIN_SECONDS,
            "template": get_pod_template(name, spec),
        },
    }
