"""Waking a service that scaled to zero: raise its InferenceService from 0 to 1 replica
through the scale subresource, the door `kubectl scale` uses.

Read its scale, and only when it stands at zero, a JSON patch of its scale that tests
the resourceVersion read and adds `spec.replicas: 1`. kube-apiserver's scale object omits
a zero `replicas` (`"spec": {}`), so a test of `/spec/replicas == 0` would always fail;
the resourceVersion test keeps both promises instead: a router never scales a running
service (say, to 1 from 3 while every scrape failed), and many routers waking at once
write once (a failed test is the API's 422: someone changed it since the read)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from pagefleet_operator.kube import Kube, KubeError, get_path

logger = logging.getLogger("pagefleet_router.wake")


def wake_patch(resource_version: str) -> list[dict]:
    """The JSON patch raising a scale object read at `resource_version` to 1 replica;
    `add` sets the field whether the server wrote the zero out or omitted it."""
    return [
        {"op": "test", "path": "/metadata/resourceVersion", "value": resource_version},
        {"op": "add", "path": "/spec/replicas", "value": 1},
    ]


@dataclass(frozen=True)
class ScaleSubresourceWaker:
    """proxy.Waker for an InferenceService in the cluster (imported only there: the
    kubernetes client is slow to import)."""

    kube: Kube
    namespace: str
    name: str

    async def wake(self) -> None:
        # The kubernetes client blocks: keep it off the event loop relaying streams.
        await asyncio.to_thread(self._wake)

    def _wake(self) -> None:
        where = f"{self.namespace}/{self.name}"
        try:
            path = get_path("InferenceService", self.namespace, self.name, "scale")
            live = self.kube.request("GET", path)
            replicas = (live.get("spec") or {}).get("replicas", 0)  # a zero is omitted
            if replicas != 0:
                logger.info("not raising %s: already at %d replicas", where, replicas)
                return
            patch = wake_patch(live["metadata"]["resourceVersion"])
            self.kube.request("PATCH", path, patch, content_type="application/json-patch+json")
        except KubeError as exc:
            if exc.status == 422:  # changed since the read: another router or the operator
                logger.info("not raising %s: it changed since it was read at zero", where)
                return
            logger.warning("raising %s from zero failed: %s", where, exc)
            return
        logger.info("raised %s from 0 to 1 replica", where)
