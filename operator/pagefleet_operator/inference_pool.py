"""A Gateway API Inference Extension InferencePool per service (spec.gateway.inferencePool):
the serving pods as a gateway's backend, with the router as the pool's Endpoint Picker.

A platform's gateway (Envoy Gateway, Istio, kgateway, GKE) routes an HTTPRoute to the pool
and asks the picker, over ext_proc gRPC, which pod takes each request; the router answers
with the policy it uses as an HTTP proxy. The picker is reached through a Service of its
own, `<name>-epp`, selecting the router pods on their ext_proc port. The pool is an
optional kind: planned only when the cluster serves its CRD, with a condition saying so
when it does not, and its Gateway parents' conditions surfaced in the service's status.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .lws import get_serving_selector_labels
from .names import EXT_PROC_PORT, EXT_PROC_PORT_NAME, HTTP_PORT, get_object_meta
from .router import get_router_selector_labels
from .spec import InferenceServiceSpec
from .status import _condition

API_VERSION = "inference.networking.k8s.io/v1"
EPP_SUFFIX = "-epp"
CONDITION = "InferencePool"


def get_endpoint_picker_service(
    body: dict[str, Any], spec: InferenceServiceSpec
) -> dict[str, Any] | None:
    """The router pods' ext_proc port, which the pool's endpointPickerRef names."""
    if not spec.inference_pool.enabled:
        return None
    name = body["metadata"]["name"]
    meta = get_object_meta(body)
    meta["name"] += EPP_SUFFIX
    # Not "router": the chart's ServiceMonitor for the routers' /metrics selects that.
    meta["labels"]["app.kubernetes.io/component"] = "endpoint-picker"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "selector": get_router_selector_labels(name),
            "ports": [
                {
                    "name": EXT_PROC_PORT_NAME,
                    "port": EXT_PROC_PORT,
                    "targetPort": EXT_PROC_PORT_NAME,
                    "protocol": "TCP",
                    # gRPC: a gateway must speak HTTP/2 to it.
                    "appProtocol": "kubernetes.io/h2c",
                }
            ],
        },
    }


def get_inference_pool(body: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any] | None:
    if not spec.inference_pool.enabled:
        return None
    name = body["metadata"]["name"]
    return {
        "apiVersion": API_VERSION,
        "kind": "InferencePool",
        "metadata": get_object_meta(body),
        "spec": {
            # The pods that serve the API (a LeaderWorkerSet's leaders only).
            "selector": {"matchLabels": get_serving_selector_labels(name, spec)},
            "targetPorts": [{"number": HTTP_PORT}],
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": name + EPP_SUFFIX,
                "port": {"number": EXT_PROC_PORT},
                "failureMode": spec.inference_pool.failure_mode,
            },
        },
    }


def get_inference_pool_condition(
    spec: InferenceServiceSpec | None, served: bool, pool: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """Whether a gateway took the pool asked for, from the conditions its Gateway parents
    wrote (Accepted, ResolvedRefs); None (no condition) when no pool is asked for."""
    if spec is None or not spec.inference_pool.enabled:
        return None
    if not served:
        return _condition(
            CONDITION,
            False,
            "InferencePoolCRDMissing",
            f"spec.gateway.inferencePool is on but the cluster does not serve {API_VERSION} "
            "InferencePool: install the Gateway API Inference Extension's CRDs; the router "
            "still serves HTTP",
        )
    parents = ((pool or {}).get("status") or {}).get("parents") or []
    if not parents:
        return _condition(
            CONDITION,
            False,
            "NotAttached",
            "no Gateway has taken the InferencePool yet: route to it from an HTTPRoute "
            "(backendRefs: group inference.networking.k8s.io, kind InferencePool)",
        )
    namespace = (pool or {}).get("metadata", {}).get("namespace", "")
    accepted, refused = [], []
    for parent in parents:
        ref = parent.get("parentRef") or {}
        gateway = (
            f"{ref.get('kind', 'Gateway')} {ref.get('namespace', namespace)}/{ref.get('name', '?')}"
        )
        failed = [
            c
            for c in parent.get("conditions") or []
            if c.get("type") in ("Accepted", "ResolvedRefs") and c.get("status") != "True"
        ]
        if failed:
            refused.append((gateway, failed[0]))
        else:
            accepted.append(gateway)
    if refused:
        gateway, condition = refused[0]
        return _condition(
            CONDITION,
            False,
            condition.get("reason") or "NotAccepted",
            f"{gateway}: {condition.get('type')} is {condition.get('status')}: "
            f"{condition.get('message', '')}",
        )
    return _condition(CONDITION, True, "Accepted", f"accepted by {', '.join(accepted)}")
