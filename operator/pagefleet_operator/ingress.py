"""An optional Ingress, set up so server-sent events stream through ingress-nginx."""

from __future__ import annotations

from typing import Any

from .names import HTTP_PORT_NAME, get_object_meta
from .spec import InferenceServiceSpec

# Buffering would hold back every token until the response ends, and the default 60 s
# read timeout would cut long generations; user annotations may override either.
SSE_ANNOTATIONS = {
    "nginx.ingress.kubernetes.io/proxy-buffering": "off",
    "nginx.ingress.kubernetes.io/proxy-request-buffering": "off",
    "nginx.ingress.kubernetes.io/proxy-read-timeout": "3600",
    "nginx.ingress.kubernetes.io/proxy-send-timeout": "3600",
}


def get_ingress(body: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any] | None:
    if spec.ingress is None:
        return None
    meta = get_object_meta(body)
    meta["annotations"] = {**SSE_ANNOTATIONS, **spec.ingress.annotations}
    backend = {"service": {"name": meta["name"], "port": {"name": HTTP_PORT_NAME}}}
    ingress_spec: dict[str, Any] = {
        "rules": [
            {
                "host": spec.ingress.host,
                "http": {"paths": [{"path": "/", "pathType": "Prefix", "backend": backend}]},
            }
        ]
    }
    if spec.ingress.class_name:
        ingress_spec["ingressClassName"] = spec.ingress.class_name
    if spec.ingress.tls_secret_name:
        ingress_spec["tls"] = [
            {"hosts": [spec.ingress.host], "secretName": spec.ingress.tls_secret_name}
        ]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "Ingress",
        "metadata": meta,
        "spec": ingress_spec,
    }
