"""Waking a service that scaled to zero: raise its InferenceService from 0 to 1 replica
through the scale subresource, the door `kubectl scale` uses.

A JSON patch that first tests `spec.replicas == 0`: a router never scales a running
service (say, to 1 from 3 while every scrape failed), and many routers waking at once
write once; a failed test is the API's 422 and means someone already raised it."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from pagefleet_operator.kube import Kube, KubeError, get_path

logger = logging.getLogger("pagefleet_router.wake")

WAKE_PATCH = [
    {"op": "test", "path": "/spec/replicas", "value": 0},
    {"op": "replace", "path": "/spec/replicas", "value": 1},
]


@dataclass(frozen=True)
class ScaleSubresourceWaker:
    """proxy.Waker for an InferenceService in the cluster (imported only there: the
    kubernetes client is slow to import)."""

    kube: Kube
    namespace: str
    name: str

    async def wake(self) -> None:
        path = get_path("InferenceService", self.namespace, self.name, "scale")
        try:
            # The kubernetes client blocks: keep it off the event loop relaying streams.
            await asyncio.to_thread(
                self.kube.request,
                "PATCH",
                path,
                WAKE_PATCH,
                content_type="application/json-patch+json",
            )
        except KubeError as exc:
            if exc.status == 422:  # replicas is not 0: already waking or awake
                return
            logger.warning("raising %s/%s from zero failed: %s", self.namespace, self.name, exc)
            return
        logger.info("raised %s/%s from 0 to 1 replica", self.namespace, self.name)
