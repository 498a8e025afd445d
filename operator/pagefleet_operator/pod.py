"""The serving pod template: probes, graceful drain, and a locked-down security context."""

from __future__ import annotations

from typing import Any

from .env import CACHE_DIR, MODEL_MOUNT_DIR, get_env
from .names import (
    CONTAINER_NAME,
    HTTP_PORT,
    HTTP_PORT_NAME,
    TEMPLATE_HASH_LABEL,
    get_labels,
    get_template_hash,
)
from .spec import InferenceServiceSpec

# Endpoints controllers and load balancers need a few seconds to stop routing to a
# terminating pod; sleeping before SIGTERM keeps new requests from hitting a draining pod.
PRESTOP_SLEEP_SECONDS = 10
# Room after the engine's own shutdown timeout before the kubelet sends SIGKILL.
TERMINATION_MARGIN_SECONDS = 15
# Large models take a long time to download and load; the startup probe allows 30 min.
STARTUP_PERIOD_SECONDS = 10
STARTUP_FAILURE_THRESHOLD = 180
STARTUP_BUDGET_SECONDS = STARTUP_PERIOD_SECONDS * STARTUP_FAILURE_THRESHOLD
RUN_AS_USER = 1000
# Scratch space only (Python, tokenizers); the cap keeps a runaway writer from filling
# the node's disk and evicting its neighbours.
TMP_SIZE_LIMIT = "1Gi"


def get_volumes(spec: InferenceServiceSpec) -> tuple[list[dict], list[dict]]:
    """Volumes and their mounts: model cache, scratch /tmp, and a pvc:// model's claim."""
    if spec.model_cache_pvc:
        cache = {"persistentVolumeClaim": {"claimName": spec.model_cache_pvc}}
    elif spec.model_cache_size_limit:
        cache = {"emptyDir": {"sizeLimit": spec.model_cache_size_limit}}
    else:
        cache = {"emptyDir": {}}
    volumes = [
        {"name": "model-cache", **cache},
        {"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE_LIMIT}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "model-cache", "mountPath": CACHE_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if spec.pvc_claim:
        volumes.append(
            {
                "name": "model",
                "persistentVolumeClaim": {"claimName": spec.pvc_claim, "readOnly": True},
            }
        )
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT_DIR, "readOnly": True})
    return volumes, mounts


def _http_probe(path: str, period: int, failures: int, timeout: int = 5) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": HTTP_PORT_NAME},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": timeout,
    }


def get_container(spec: InferenceServiceSpec) -> dict[str, Any]:
    _, mounts = get_volumes(spec)
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": spec.engine.image,
        "command": ["pagefleet", "serve"],
        "env": get_env(spec),
        "ports": [{"name": HTTP_PORT_NAME, "containerPort": HTTP_PORT, "protocol": "TCP"}],
        "startupProbe": _http_probe("/ready", STARTUP_PERIOD_SECONDS, STARTUP_FAILURE_THRESHOLD),
        "readinessProbe": _http_probe("/ready", 5, 3),
        "livenessProbe": _http_probe("/health", 10, 3),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_SECONDS}}},
        "resources": dict(spec.resources),
        "volumeMounts": mounts,
        "securityContext": {
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    if spec.engine.extra_args:
        container["args"] = list(spec.engine.extra_args)
    if spec.engine.image_pull_policy:
        container["imagePullPolicy"] = spec.engine.image_pull_policy
    return container


def get_pod_security_context(spec: InferenceServiceSpec) -> dict[str, Any]:
    context: dict[str, Any] = {
        "runAsNonRoot": True,
        # A model cache PVC of many files is re-chowned on every mount otherwise.
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if spec.fixed_user_ids:
        context |= {"runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER, "fsGroup": RUN_AS_USER}
    return context


def get_pod_template(name: str, spec: InferenceServiceSpec) -> dict[str, Any]:
    """The pod template, labelled with a hash of itself so any spec change rolls the pods."""
    volumes, _ = get_volumes(spec)
    pod_spec: dict[str, Any] = {
        "containers": [get_container(spec)],
        "volumes": volumes,
        # Serving pods never talk to the API server.
        "automountServiceAccountToken": False,
        # Service links would inject e.g. PAGEFLEET_PORT=tcp://... for a Service named
        # `pagefleet`, clobbering the engine's own PAGEFLEET_PORT setting.
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": (
            PRESTOP_SLEEP_SECONDS
            + spec.engine.shutdown_timeout_seconds
            + TERMINATION_MARGIN_SECONDS
        ),
        "securityContext": get_pod_security_context(spec),
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [dict(item) for item in spec.tolerations]
    template = {"metadata": {"labels": get_labels(name)}, "spec": pod_spec}
    template["metadata"]["labels"][TEMPLATE_HASH_LABEL] = get_template_hash(template)
    return template
