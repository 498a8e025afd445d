"""A Prometheus Operator PodMonitor, so the cluster's Prometheus scrapes every serving pod.

A PodMonitor rather than a ServiceMonitor: the autoscaler already reads each pod on its
own, and per-pod series are what the dashboard shows. Only built when asked for; the
reconciler drops it when the cluster does not serve the PodMonitor CRD.
"""

from __future__ import annotations

from typing import Any

from .names import HTTP_PORT_NAME, get_object_meta, get_selector_labels
from .spec import InferenceServiceSpec

API_VERSION = "monitoring.coreos.com/v1"


def get_pod_monitor(body: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any] | None:
    if not spec.monitoring.pod_monitor:
        return None
    meta = get_object_meta(body)
    # Ours last: a user label must not take over the labels that mark the object ours.
    meta["labels"] = {**spec.monitoring.pod_monitor_labels, **meta["labels"]}
    return {
        "apiVersion": API_VERSION,
        "kind": "PodMonitor",
        "metadata": meta,
        "spec": {
            "selector": {"matchLabels": get_selector_labels(body["metadata"]["name"])},
            "podMetricsEndpoints": [{"port": HTTP_PORT_NAME, "path": "/metrics"}],
        },
    }
