"""Pods from a Service's EndpointSlices: ready endpoints only, on the named port; a change
the discovery's watch reports starts a scrape round at once. The watch itself runs
against the API emulator (tests/operator/test_operator_emulator.py)."""

import asyncio

import aiohttp
import pytest
from aiohttp import web
from pagefleet_router.discovery import ScrapeSettings
from pagefleet_router.endpointslices import ready_endpoints
from pagefleet_router.proxy import Router, RouterSettings

from tests.operator.test_operator_metrics import BODY, MetricsServer


def endpoint_slice(ports, *endpoints):
    return {"ports": ports, "endpoints": list(endpoints)}


def endpoint(*addresses, ready=None):
    conditions = {} if ready is None else {"ready": ready}
    return {"addresses": list(addresses), "conditions": conditions}


def test_ready_endpoints_on_the_named_port_from_every_slice():
    http = [{"name": "metrics", "port": 9090}, {"name": "http", "port": 8000}]
    slices = [
        endpoint_slice(http, endpoint("10.0.0.7", ready=True), endpoint("10.0.0.8", ready=False)),
        endpoint_slice(http, endpoint("fd00::5"), endpoint("10.0.0.7", ready=True)),
        endpoint_slice([{"name": "grpc", "port": 9000}], endpoint("10.0.0.9", ready=True)),
        endpoint_slice(None, endpoint("10.0.0.10")),  # no ports yet
    ]
    # not ready (terminating, starting): out; no condition: ready; duplicates once
    assert ready_endpoints(slices, "http") == ["http://10.0.0.7:8000", "http://[fd00::5]:8000"]
    assert ready_endpoints([], "http") == []


class WatchedPods:
    """A Discovery whose list the test changes, saying so through the watch callback."""

    def __init__(self) -> None:
        self.urls: list[str] = []
        self.watching = asyncio.Event()

    async def endpoints(self) -> list[str]:
        return list(self.urls)

    async def watch(self, changed) -> None:
        self.changed = changed
        self.watching.set()
        await asyncio.Event().wait()  # until the router stops

    def set(self, *urls: str) -> None:
        self.urls = list(urls)
        self.changed()


@pytest.mark.asyncio
async def test_a_watched_change_is_scraped_at_once_not_at_the_next_round():
    pods = WatchedPods()
    pod = MetricsServer(BODY)
    # A round a minute: only the watch can make the router see the pod within a second.
    settings = RouterSettings(scrape=ScrapeSettings(interval_s=60))
    runner = web.AppRunner(Router(settings, pods).create_app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    ready = f"http://127.0.0.1:{runner.addresses[0][1]}/ready"
    try:
        await asyncio.wait_for(pods.watching.wait(), 1)
        async with aiohttp.ClientSession() as session:

            async def ready_status() -> int:
                async with session.get(ready) as response:
                    return response.status

            async def becomes(status: int) -> None:
                for _ in range(100):
                    if await ready_status() == status:
                        return
                    await asyncio.sleep(0.01)
                raise AssertionError(f"/ready never answered {status} within a second")

            assert await ready_status() == 503  # no pod yet
            pods.set(f"http://127.0.0.1:{pod.port}")
            await becomes(200)
            pods.set()
            await becomes(503)
    finally:
        await runner.cleanup()
        pod.close()
