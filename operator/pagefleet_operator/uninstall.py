"""`python -m pagefleet_operator uninstall`: what the chart's pre-delete hook runs.

kopf puts its finalizer on every InferenceService (kopf timers and daemons require one),
and only a running operator takes it off. `helm uninstall` deletes the operator and its
RBAC and never deletes custom resources, so an InferenceService deleted afterwards would
stay Terminating forever, its pods still running. The hook runs first, while the
operator still runs: it deletes the InferenceServices in the operator's namespaces and
waits for the operator to release them (their children go with them through owner
references). What is still there at the deadline (e.g. the operator was scaled to zero)
has our finalizer removed here, so nothing is left stranded either way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from . import API_VERSION, FINALIZER, PLURAL
from .kube import Kube, KubeError

POLL_SECONDS = 2

logger = logging.getLogger(__name__)


def _collection_paths(namespaces: Sequence[str]) -> list[str]:
    if not namespaces:
        return [f"/apis/{API_VERSION}/{PLURAL}"]
    return [f"/apis/{API_VERSION}/namespaces/{ns}/{PLURAL}" for ns in namespaces]


def list_inference_services(kube: Kube, namespaces: Sequence[str]) -> list[dict[str, Any]]:
    found = []
    for path in _collection_paths(namespaces):
        found += kube.request("GET", path).get("items", [])
    return found


def release_finalizer(kube: Kube, obj: dict[str, Any]) -> None:
    meta = obj["metadata"]
    finalizers = [f for f in meta.get("finalizers") or [] if f != FINALIZER]
    try:
        kube.request(
            "PATCH",
            f"/apis/{API_VERSION}/namespaces/{meta['namespace']}/{PLURAL}/{meta['name']}",
            # The resourceVersion makes it a no-op if the object changed meanwhile.
            {"metadata": {"finalizers": finalizers, "resourceVersion": meta["resourceVersion"]}},
            content_type="application/merge-patch+json",
        )
    except KubeError as exc:
        if exc.status not in (404, 409):
            raise


def uninstall(kube: Kube, namespaces: Sequence[str], timeout: float) -> list[str]:
    """Delete every InferenceService in scope and wait until none is left. Returns the
    names whose finalizer had to be released here."""
    if not kube.serves(API_VERSION, PLURAL):
        # The CRD is gone (and every InferenceService with it): nothing can be stranded,
        # and failing here would fail `helm uninstall`.
        logger.info("the API server does not serve %s %s: nothing to delete", API_VERSION, PLURAL)
        return []
    for obj in list_inference_services(kube, namespaces):
        meta = obj["metadata"]
        kube.delete("InferenceService", meta["namespace"], meta["name"])
        logger.info("deleting InferenceService %s/%s", meta["namespace"], meta["name"])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not list_inference_services(kube, namespaces):
            return []
        time.sleep(POLL_SECONDS)
    released = []
    for obj in list_inference_services(kube, namespaces):
        meta = obj["metadata"]
        logger.warning(
            "the operator did not release %s/%s in %ss; removing its finalizer",
            meta["namespace"],
            meta["name"],
            timeout,
        )
        release_finalizer(kube, obj)
        released.append(f"{meta['namespace']}/{meta['name']}")
    return released
