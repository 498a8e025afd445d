"""The serving pod template: probes, graceful drain, and a locked-down security context."""

from __future__ import annotations

from typing import Any

from .adapters import get_adapters_args, get_adapters_volume, uses_adapters_file
from .env import CACHE_DIR, KV_OFFLOAD_DIR, MODEL_MOUNT_DIR, get_env
from .names import (
    CONTAINER_NAME,
    HTTP_PORT,
    HTTP_PORT_NAME,
    KV_EVENTS_PORT,
    KV_EVENTS_PORT_NAME,
    KV_REPLAY_PORT,
    KV_REPLAY_PORT_NAME,
    TEMPLATE_HASH_LABEL,
    get_labels,
    get_template_hash,
)
from .spec import GPU_RESOURCE, InferenceServiceSpec

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
# torch.distributed's rendezvous (rank 0's TCPStore) across the pods of a group.
MASTER_PORT = 29500
MASTER_PORT_NAME = "dist"
# What a pod of a LeaderWorkerSet group runs as: "server" is a pod on its own (a
# Deployment's), "leader" the API server with rank 0, "worker" engine ranks only.
ROLES = ("server", "leader", "worker")


def get_volumes(name: str, spec: InferenceServiceSpec) -> tuple[list[dict], list[dict]]:
    """Volumes and their mounts: model cache, scratch /tmp, a pvc:// model's claim, and
    the adapters' ConfigMap."""
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
    if uses_adapters_file(spec):
        volume, mount = get_adapters_volume(name)
        volumes.append(volume)
        mounts.append(mount)
    offload = spec.kv_offload
    if offload is not None and offload.files:
        tier: dict[str, Any] = (
            {"persistentVolumeClaim": {"claimName": offload.pvc_name}}
            if offload.pvc_name
            else {"emptyDir": {"sizeLimit": offload.size_limit}}
        )
        volumes.append({"name": "kv-offload", **tier})
        mounts.append({"name": "kv-offload", "mountPath": KV_OFFLOAD_DIR})
    if spec.parallelism.world_size > 1:
        shm = {"medium": "Memory", "sizeLimit": spec.parallelism.shm_size_limit}
        volumes.append({"name": "dshm", "emptyDir": shm})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    return volumes, mounts


def get_task_args(spec: InferenceServiceSpec) -> list[str]:
    """spec.task embed -> `--task embed`. generate (the default) adds no flag, so that the
    pods of every existing resource keep their template (no rollout on an upgrade); the
    pod's task auto then serves a generation model as before."""
    return ["--task", "embed"] if spec.task == "embed" else []


def get_parallel_args(spec: InferenceServiceSpec, role: str = "server") -> list[str]:
    """`pagefleet serve`'s parallelism flags (vLLM's names). Arguments, not PAGEFLEET_*
    variables: the kubelet expands $(LWS_...) in arguments from the whole container
    environment, which LeaderWorkerSet's webhook fills."""
    parallelism = spec.parallelism
    if parallelism.world_size == 1:
        return []
    args = [
        f"--tensor-parallel-size={parallelism.tensor}",
        f"--pipeline-parallel-size={parallelism.pipeline}",
    ]
    if role == "server":
        return args
    args += [
        f"--nnodes={parallelism.nodes}",
        "--master-addr=$(LWS_LEADER_ADDRESS)",
        f"--master-port={MASTER_PORT}",
    ]
    if role == "leader":
        return [*args, "--node-rank=0"]
    return [*args, "--node-rank=$(LWS_WORKER_INDEX)", "--headless"]


def get_resources(spec: InferenceServiceSpec) -> dict[str, Any]:
    """spec.resources, with each pod's share of the ranks' GPUs (limits: an extended
    resource's request defaults to its limit)."""
    resources = {key: dict(value) for key, value in spec.resources.items()}
    gpus = spec.parallelism.gpus_per_node
    if spec.parallelism.world_size > 1 and gpus:
        resources.setdefault("limits", {})[GPU_RESOURCE] = gpus
        if GPU_RESOURCE in resources.get("requests", {}):
            resources["requests"][GPU_RESOURCE] = gpus
    return resources


def _http_probe(path: str, period: int, failures: int, timeout: int = 5) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": HTTP_PORT_NAME},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": timeout,
    }


def get_container(name: str, spec: InferenceServiceSpec, role: str = "server") -> dict[str, Any]:
    _, mounts = get_volumes(name, spec)
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": spec.engine.image,
        "command": ["pagefleet", "serve"],
        "env": get_env(spec),
    }
    if role != "worker":
        # A worker serves no API: it has no port to probe, and its ranks' failure fails
        # the leader's /health (and LeaderWorkerSet recreates the whole group).
        ports = [{"name": HTTP_PORT_NAME, "containerPort": HTTP_PORT, "protocol": "TCP"}]
        if role == "leader":
            ports.append(
                {"name": MASTER_PORT_NAME, "containerPort": MASTER_PORT, "protocol": "TCP"}
            )
        if "kv-events-config" in spec.engine.settings:
            ports += [
                {"name": KV_EVENTS_PORT_NAME, "containerPort": KV_EVENTS_PORT, "protocol": "TCP"},
                {"name": KV_REPLAY_PORT_NAME, "containerPort": KV_REPLAY_PORT, "protocol": "TCP"},
            ]
        container |= {
            "ports": ports,
            "startupProbe": _http_probe(
                "/ready", STARTUP_PERIOD_SECONDS, STARTUP_FAILURE_THRESHOLD
            ),
            "readinessProbe": _http_probe("/ready", 5, 3),
            "livenessProbe": _http_probe("/health", 10, 3),
            "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_SECONDS}}},
        }
    container |= {
        "resources": get_resources(spec),
        "volumeMounts": mounts,
        "securityContext": {
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    args = (
        get_parallel_args(spec, role)
        + get_task_args(spec)
        + get_adapters_args(spec)
        + list(spec.engine.extra_args)
    )
    if args:
        container["args"] = args
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


def get_pod_template(name: str, spec: InferenceServiceSpec, role: str = "server") -> dict[str, Any]:
    """The pod template, labelled with a hash of itself so any spec change rolls the pods."""
    volumes, _ = get_volumes(name, spec)
    pod_spec: dict[str, Any] = {
        "containers": [get_container(name, spec, role)],
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
