"""The ClusterIP Service in front of the serving pods, and the URL it gives them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .lws import get_serving_selector_labels
from .names import HTTP_PORT, HTTP_PORT_NAME, get_object_meta
from .router import get_router_selector_labels
from .spec import InferenceServiceSpec


def get_service(body: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    """The Service clients use: the serving pods, or the router pods in front of them."""
    name = body["metadata"]["name"]
    meta = get_object_meta(body)
    selector = None
    if spec.router.enabled:
        selector = get_router_selector_labels(name)
        # What it fronts: the chart's router ServiceMonitor finds routers by this label.
        meta["labels"]["app.kubernetes.io/component"] = "router"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "type": "ClusterIP",
            "selector": selector or get_serving_selector_labels(name, spec),
            "ports": [
                {
                    "name": HTTP_PORT_NAME,
                    "port": HTTP_PORT,
                    "targetPort": HTTP_PORT_NAME,
                    "protocol": "TCP",
                    "appProtocol": "http",
                }
            ],
        },
    }


def get_url(body: Mapping[str, Any], spec: InferenceServiceSpec) -> str:
    """Where clients reach the service: the Ingress host if any, else the cluster DNS name."""
    if spec.ingress is not None:
        scheme = "https" if spec.ingress.tls_secret_name else "http"
        return f"{scheme}://{spec.ingress.host}"
    meta = body["metadata"]
    return f"http://{meta['name']}.{meta['namespace']}.svc.cluster.local:{HTTP_PORT}"
