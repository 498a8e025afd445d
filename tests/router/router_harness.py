"""The router in process on loopback in front of loopback HTTP servers in pods' places:
what the router tests share."""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web
from pagefleet_router.discovery import ScrapeSettings, StaticEndpoints
from pagefleet_router.proxy import Router, RouterSettings
from pagefleet_serve import metric_names as names


class LoopbackPod:
    """A loopback HTTP server in a pod's place: the routes `add_routes` adds, and /metrics
    with idle load gauges (so the router counts it fresh and free)."""

    client_max_size = 1 << 20

    def __init__(self) -> None:
        self.url = ""

    def add_routes(self, router: web.UrlDispatcher) -> None:
        raise NotImplementedError

    async def start(self) -> web.AppRunner:
        app = web.Application(client_max_size=self.client_max_size)
        self.add_routes(app.router)
        app.router.add_get("/metrics", self.metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        return runner

    async def metrics(self, _request: web.Request) -> web.Response:
        gauges = (names.NUM_REQUESTS_WAITING, names.NUM_REQUESTS_RUNNING, names.KV_CACHE_USAGE_PERC)
        text = "".join(f"# TYPE {g} gauge\n{g} 0\n" for g in gauges)
        return web.Response(text=text, content_type="text/plain")


@contextlib.asynccontextmanager
async def running_router(pods: list[LoopbackPod], **settings):
    """(the router's base URL, the router), once it has scraped every pod."""
    runners = [await pod.start() for pod in pods]
    router = Router(
        RouterSettings(scrape=ScrapeSettings(interval_s=0.2, timeout_s=2.0), **settings),
        StaticEndpoints(tuple(pod.url for pod in pods)),
    )
    runner = web.AppRunner(router.create_app(), **router.server_options())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    runners.append(runner)
    try:
        for _ in range(100):
            states = router.registry.states()
            if len(states) == len(pods) and all(s.metrics_age_s is not None for s in states):
                break
            await asyncio.sleep(0.05)
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", router
    finally:
        for each in reversed(runners):
            await each.cleanup()
