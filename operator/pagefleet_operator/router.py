"""`pagefleet router` in front of the serving pods (spec.router.enabled): its Deployment,
the identity it reads EndpointSlices and wakes the service with, and the headless Service
it discovers the pods through. The resource's own Service then selects the router pods
(service.py), so the Service, the Ingress and the URL stay what clients already use.

The router's Role is the least it needs: list and watch EndpointSlices in its namespace,
and patch the scale subresource of its own InferenceService only (resourceNames). Waking
from zero through the scale subresource needs no access to the InferenceService itself,
nor an operator round trip: an annotation the operator reacts to would need patch on the
whole object (spec included) and would add a reconcile's delay to every cold start.
"""

from __future__ import annotations

from typing import Any

from . import GROUP, PLURAL
from .lws import get_serving_selector_labels
from .names import (
    EXT_PROC_PORT,
    EXT_PROC_PORT_NAME,
    HTTP_PORT,
    HTTP_PORT_NAME,
    INSTANCE_LABEL,
    get_labels,
    get_object_meta,
)
from .pod import get_pod_security_context
from .spec import InferenceServiceSpec

ROUTER_LABEL = "pagefleet.dev/router"
ROUTER_SUFFIX = "-router"
POD_SERVICE_SUFFIX = "-pods"
ROUTER_CONTAINER_NAME = "router"


def get_router_selector_labels(name: str) -> dict[str, str]:
    # Not INSTANCE_LABEL: the serving Deployment selects its pods by that label alone.
    return {ROUTER_LABEL: name}


def get_router_labels(name: str) -> dict[str, str]:
    labels = {**get_labels(name), "app.kubernetes.io/component": "router"}
    del labels[INSTANCE_LABEL]
    return {**labels, **get_router_selector_labels(name)}


def _router_meta(body: dict[str, Any], suffix: str) -> dict[str, Any]:
    meta = get_object_meta(body)
    meta["name"] += suffix
    return meta


def get_pod_service(body: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any] | None:
    """The headless Service whose EndpointSlices list the ready serving pods to the router."""
    if not spec.router.enabled:
        return None
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _router_meta(body, POD_SERVICE_SUFFIX),
        "spec": {
            "clusterIP": "None",
            # A LeaderWorkerSet's leaders only: its workers serve no API.
            "selector": get_serving_selector_labels(body["metadata"]["name"], spec),
            "ports": [
                {
                    "name": HTTP_PORT_NAME,
                    "port": HTTP_PORT,
                    "targetPort": HTTP_PORT_NAME,
                    "protocol": "TCP",
                }
            ],
        },
    }


def get_router_service_account(
    body: dict[str, Any], spec: InferenceServiceSpec
) -> dict[str, Any] | None:
    if not spec.router.enabled:
        return None
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _router_meta(body, ROUTER_SUFFIX),
    }


def get_router_rules(name: str) -> list[dict[str, Any]]:
    return [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["list", "watch"],
        },
        {
            "apiGroups": [GROUP],
            "resources": [f"{PLURAL}/scale"],
            "resourceNames": [name],
            "verbs": ["get", "patch"],  # the wake reads the scale before it patches
        },
    ]


def get_router_role(body: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any] | None:
    if not spec.router.enabled:
        return None
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _router_meta(body, ROUTER_SUFFIX),
        "rules": get_router_rules(body["metadata"]["name"]),
    }


def get_router_role_binding(
    body: dict[str, Any], spec: InferenceServiceSpec
) -> dict[str, Any] | None:
    if not spec.router.enabled:
        return None
    meta = _router_meta(body, ROUTER_SUFFIX)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": meta,
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": meta["name"]},
        "subjects": [
            {"kind": "ServiceAccount", "name": meta["name"], "namespace": meta["namespace"]}
        ],
    }


def get_router_args(name: str, spec: InferenceServiceSpec) -> list[str]:
    args = [
        f"--service={name}{POD_SERVICE_SUFFIX}",
        f"--port-name={HTTP_PORT_NAME}",
        "--host=0.0.0.0",
        f"--port={HTTP_PORT}",
        f"--max-held-requests={spec.router.max_held_requests}",
        f"--hold-timeout={spec.router.hold_timeout_seconds}",
    ]
    if spec.autoscaling.enabled and spec.autoscaling.min_replicas == 0:
        args.append(f"--scale-from-zero={name}")
    if spec.inference_pool.enabled:
        args.append(f"--ext-proc-port={EXT_PROC_PORT}")
    return args


def _probe(path: str) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": HTTP_PORT_NAME},
        "periodSeconds": 5,
        "failureThreshold": 3,
        "timeoutSeconds": 5,
    }


def get_router_deployment(
    body: dict[str, Any], spec: InferenceServiceSpec
) -> dict[str, Any] | None:
    if not spec.router.enabled:
        return None
    name = body["metadata"]["name"]
    ports = [{"name": HTTP_PORT_NAME, "containerPort": HTTP_PORT, "protocol": "TCP"}]
    if spec.inference_pool.enabled:
        ports.append(
            {"name": EXT_PROC_PORT_NAME, "containerPort": EXT_PROC_PORT, "protocol": "TCP"}
        )
    container = {
        "name": ROUTER_CONTAINER_NAME,
        "image": spec.router.image,
        # The operator image's entry point is the operator; the router is its sibling.
        "command": ["python", "-m", "pagefleet_router"],
        "args": get_router_args(name, spec),
        "ports": ports,
        "readinessProbe": _probe("/ready"),
        "livenessProbe": _probe("/health"),
        "resources": dict(spec.router.resources),
        "securityContext": {
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    if spec.engine.image_pull_policy:
        container["imagePullPolicy"] = spec.engine.image_pull_policy
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _router_meta(body, ROUTER_SUFFIX),
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": get_router_selector_labels(name)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": {"labels": get_router_labels(name)},
                "spec": {
                    "serviceAccountName": name + ROUTER_SUFFIX,
                    # The router reads EndpointSlices and patches the scale subresource.
                    "automountServiceAccountToken": True,
                    "enableServiceLinks": False,
                    "containers": [container],
                    "securityContext": get_pod_security_context(spec),
                },
            },
        },
    }
