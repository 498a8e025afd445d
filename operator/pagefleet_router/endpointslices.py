"""Pod discovery from a Service's EndpointSlices: the ready endpoints on the pods' named
HTTP port, kept current by a watch.

List once, then watch from the list's resourceVersion: a pod that turns ready or goes
away reaches the router as one event, at once, instead of at the next poll. A watch the
API server ends (its timeoutSeconds) or a broken connection is resumed from the last
resourceVersion seen; a 410 Gone (that version is no longer in the server's history) is
answered with a new list. Trouble keeps the last known pods: the scrapes tell which
still answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from pagefleet_operator.kube import Kube, KubeError, get_path

logger = logging.getLogger("pagefleet_router.endpointslices")

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
# The API server ends each watch after this; a fresh one resumes from the last version.
WATCH_TIMEOUT_SECONDS = 240
# A watch connection silent this much longer than its timeout is dead (no FIN, no RST).
WATCH_READ_GRACE_SECONDS = 30
RETRY_DELAY_SECONDS = 1.0


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


class _Expired(Exception):
    """410 Gone: the resourceVersion to resume from is too old; list again."""


class EndpointSliceDiscovery:
    """discovery.Discovery for a Service in the cluster (imported only there: the
    kubernetes client is slow to import). `watch` keeps the slices; `endpoints` reads
    them and calls the API never."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        service: str,
        port_name: str,
        *,
        watch_timeout_s: int = WATCH_TIMEOUT_SECONDS,
        retry_delay_s: float = RETRY_DELAY_SECONDS,
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.service = service
        self.port_name = port_name
        self.watch_timeout_s = watch_timeout_s
        self.retry_delay_s = retry_delay_s
        self._slices: dict[str, dict[str, Any]] = {}

    async def endpoints(self) -> list[str]:
        return ready_endpoints(list(self._slices.values()), self.port_name)

    async def watch(self, changed: Callable[[], None]) -> None:
        """List, then follow the watch until cancelled, calling `changed` whenever the
        ready endpoints differ from before."""
        resource_version = None
        while True:
            try:
                if resource_version is None:
                    resource_version = await self._list(changed)
                resource_version = await self._follow(resource_version, changed)
            except _Expired:
                logger.info("EndpointSlice watch expired (410 Gone); listing again")
                resource_version = None
            except Exception as exc:  # noqa: BLE001 - any trouble: keep the pods known, retry shortly
                logger.warning("watching EndpointSlices of %s failed: %s", self.service, exc)
                await asyncio.sleep(self.retry_delay_s)

    def _query(self) -> dict[str, str]:
        return {"labelSelector": f"{SERVICE_NAME_LABEL}={self.service}"}

    def _selects(self, endpoint_slice: dict[str, Any]) -> bool:
        # Checked here too: the selector is the server's filter, the label the contract.
        labels = (endpoint_slice.get("metadata") or {}).get("labels") or {}
        return labels.get(SERVICE_NAME_LABEL) == self.service

    async def _list(self, changed: Callable[[], None]) -> str:
        path = get_path("EndpointSlice", self.namespace)
        # The kubernetes client blocks: keep it off the event loop relaying streams.
        body = await asyncio.to_thread(self.kube.request, "GET", path, query=self._query())
        slices = {
            item["metadata"]["name"]: item
            for item in body.get("items") or []
            if self._selects(item)
        }
        self._replace(slices, changed)
        return (body.get("metadata") or {}).get("resourceVersion") or ""

    async def _follow(self, resource_version: str, changed: Callable[[], None]) -> str:
        """Apply the watch's events from `resource_version` until the server ends the
        stream; returns the version to resume from."""
        query = {
            **self._query(),
            "watch": "true",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self.watch_timeout_s),
        }
        try:
            response = await asyncio.to_thread(
                self.kube.open_stream,
                get_path("EndpointSlice", self.namespace),
                query=query,
                read_timeout_s=self.watch_timeout_s + WATCH_READ_GRACE_SECONDS,
            )
        except KubeError as exc:
            if exc.status == 410:
                raise _Expired from exc
            raise
        lines: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        # A thread of its own (a daemon): a watch may outlive every other call, and a
        # blocked read must not hold the default executor at shutdown.
        threading.Thread(
            target=_pump, args=(response, loop, lines), name="endpointslice-watch", daemon=True
        ).start()
        try:
            while (line := await lines.get()) is not None:
                if isinstance(line, BaseException):
                    raise line
                resource_version = self._apply(json.loads(line), changed) or resource_version
        finally:
            # Unblocks the pump's read when we leave first (it closes the response);
            # a response it already closed or released has nothing left to interrupt.
            with contextlib.suppress(ValueError, RuntimeError, OSError):
                response.shutdown()
        return resource_version

    def _apply(self, event: dict[str, Any], changed: Callable[[], None]) -> str | None:
        """One watch event applied to the slices; returns its resourceVersion."""
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _Expired
            raise KubeError(obj.get("code") or 0, obj.get("message") or "watch error event")
        meta = obj.get("metadata") or {}
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            slices = dict(self._slices)
            if kind == "DELETED" or not self._selects(obj):
                slices.pop(meta["name"], None)
            else:
                slices[meta["name"]] = obj
            self._replace(slices, changed)
        return meta.get("resourceVersion")  # BOOKMARK: the version alone

    def _replace(self, slices: dict[str, dict[str, Any]], changed: Callable[[], None]) -> None:
        before = ready_endpoints(list(self._slices.values()), self.port_name)
        self._slices = slices
        if ready_endpoints(list(slices.values()), self.port_name) != before:
            changed()


def _pump(response: Any, loop: asyncio.AbstractEventLoop, lines: asyncio.Queue) -> None:
    """Blocking reads of a watch's lines, handed to the loop; then None (the server ended
    the stream) or the exception that ended it."""

    def put(item: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening
            loop.call_soon_threadsafe(lines.put_nowait, item)

    try:
        for line in _nonempty(response):
            put(line)
    except Exception as exc:  # noqa: BLE001 - handed over: raised where the watch is followed
        put(exc)
    else:
        put(None)
    finally:
        response.close()


def _nonempty(response: Any) -> Iterator[bytes]:
    for line in response:
        if line.strip():
            yield line
