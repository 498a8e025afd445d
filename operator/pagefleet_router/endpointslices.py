"""Pod discovery from a Service's EndpointSlices: the ready endpoints on the pods' named
HTTP port. Listed once per refresh (the scrape interval) rather than watched: one small
list per second per router, and no watch to re-establish."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from pagefleet_operator.kube import Kube

SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def ready_endpoints(slices: list[dict[str, Any]], port_name: str) -> list[str]:
    """Base URLs of the ready endpoints in these EndpointSlices on the port named
    `port_name`. A missing `ready` condition means ready (the API's rule)."""
    urls = set()
    for endpoint_slice in slices:
        ports = [p for p in endpoint_slice.get("ports") or [] if p.get("name") == port_name]
        if not ports or ports[0].get("port") is None:
            continue
        for endpoint in endpoint_slice.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready") is False:
                continue
            for address in endpoint.get("addresses") or []:
                host = f"[{address}]" if ":" in address else address  # IPv6
                urls.add(f"http://{host}:{ports[0]['port']}")
    return sorted(urls)


@dataclass(frozen=True)
class EndpointSliceDiscovery:
    kube: Kube
    namespace: str
    service: str
    port_name: str

    async def endpoints(self) -> list[str]:
        path = f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices"
        query = {"labelSelector": f"{SERVICE_NAME_LABEL}={self.service}"}
        # The kubernetes client blocks: keep it off the event loop relaying streams.
        body = await asyncio.to_thread(self.kube.request, "GET", path, query=query)
        return ready_endpoints(body.get("items") or [], self.port_name)
