"""Everything one InferenceService should own, by kind; None means "must not exist"."""

from __future__ import annotations

from typing import Any

from .deployment import get_deployment
from .ingress import get_ingress
from .pdb import get_pdb
from .podmonitor import get_pod_monitor
from .service import get_service
from .spec import InferenceServiceSpec

# The kinds the operator manages, in the order they are created.
MANAGED_KINDS = ("Deployment", "Service", "Ingress", "PodDisruptionBudget", "PodMonitor")
# Kinds of optional CRDs: planned only when the cluster serves them.
OPTIONAL_KINDS = ("PodMonitor",)


def get_desired_objects(
    body: dict[str, Any], spec: InferenceServiceSpec
) -> dict[str, dict[str, Any] | None]:
    return {
        "Deployment": get_deployment(body, spec),
        "Service": get_service(body, spec),
        "Ingress": get_ingress(body, spec),
        "PodDisruptionBudget": get_pdb(body, spec),
        "PodMonitor": get_pod_monitor(body, spec),
    }
