"""Everything one InferenceService should own, by slot; None means "must not exist"."""

from __future__ import annotations

from typing import Any

from .adapters import SUFFIX as ADAPTERS_SUFFIX
from .adapters import get_adapters_config_map
from .deployment import get_deployment
from .inference_pool import EPP_SUFFIX, get_endpoint_picker_service, get_inference_pool
from .ingress import get_ingress
from .lws import get_leader_worker_set
from .pdb import get_pdb
from .podmonitor import get_pod_monitor
from .router import (
    POD_SERVICE_SUFFIX,
    ROUTER_SUFFIX,
    get_pod_service,
    get_router_deployment,
    get_router_role,
    get_router_role_binding,
    get_router_service_account,
)
from .service import get_service
from .spec import InferenceServiceSpec

# Slot -> (kind, suffix of the resource's name), in the order they are created. Slots,
# not kinds: with the router one resource owns two Deployments and two Services. The
# router's identity comes before the Deployment that runs as it, the adapters' ConfigMap
# before the pods that mount it.
MANAGED_OBJECTS: dict[str, tuple[str, str]] = {
    "AdaptersConfigMap": ("ConfigMap", ADAPTERS_SUFFIX),
    "Deployment": ("Deployment", ""),
    # Instead of the Deployment when a replica spans several nodes (spec.parallelism).
    "LeaderWorkerSet": ("LeaderWorkerSet", ""),
    "Service": ("Service", ""),
    "Ingress": ("Ingress", ""),
    "PodDisruptionBudget": ("PodDisruptionBudget", ""),
    "PodMonitor": ("PodMonitor", ""),
    "PodService": ("Service", POD_SERVICE_SUFFIX),
    "RouterServiceAccount": ("ServiceAccount", ROUTER_SUFFIX),
    "RouterRole": ("Role", ROUTER_SUFFIX),
    "RouterRoleBinding": ("RoleBinding", ROUTER_SUFFIX),
    "RouterDeployment": ("Deployment", ROUTER_SUFFIX),
    # spec.gateway.inferencePool: the router's ext_proc port, and the pool naming it.
    "EndpointPickerService": ("Service", EPP_SUFFIX),
    "InferencePool": ("InferencePool", ""),
}
# Kinds of optional CRDs: planned only when the cluster serves them.
OPTIONAL_KINDS = ("PodMonitor", "InferencePool")


def get_desired_objects(
    body: dict[str, Any], spec: InferenceServiceSpec
) -> dict[str, dict[str, Any] | None]:
    return {
        "AdaptersConfigMap": get_adapters_config_map(body, spec),
        "Deployment": get_deployment(body, spec),
        "LeaderWorkerSet": get_leader_worker_set(body, spec),
        "Service": get_service(body, spec),
        "Ingress": get_ingress(body, spec),
        "PodDisruptionBudget": get_pdb(body, spec),
        "PodMonitor": get_pod_monitor(body, spec),
        "PodService": get_pod_service(body, spec),
        "RouterServiceAccount": get_router_service_account(body, spec),
        "RouterRole": get_router_role(body, spec),
        "RouterRoleBinding": get_router_role_binding(body, spec),
        "RouterDeployment": get_router_deployment(body, spec),
        "EndpointPickerService": get_endpoint_picker_service(body, spec),
        "InferencePool": get_inference_pool(body, spec),
    }
