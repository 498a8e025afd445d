"""A pod that answers with server errors while its /metrics still looks healthy (an
engine that fails every request, a broken model) must stop receiving its prefixes'
traffic: the policy routes around a failing pod, and takes it back when every pod is
failing or once the mark has expired. The router runs in process on loopback in front of
two loopback HTTP servers in pods' places, one of which starts answering 500."""

from __future__ import annotations

import json

import aiohttp
import pytest
from aiohttp import web
from pagefleet_router import discovery
from pagefleet_router.discovery import PodRegistry
from pagefleet_router.policy import PodState, PolicyConfig, choose_pod

from tests.router.router_harness import LoopbackPod, running_router

PROMPT = "You are a careful assistant. " * 20  # several blocks of the router's prefix hash


class Pod(LoopbackPod):
    """Healthy load gauges always, and answers that turn into 500s when `failing` is set.
    Counts the completions it is sent."""

    def __init__(self) -> None:
        super().__init__()
        self.failing = False
        self.requests = 0

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/completions", self.complete)

    async def complete(self, request: web.Request) -> web.Response:
        await request.read()
        self.requests += 1
        if self.failing:
            error = {"message": "the engine failed", "type": "server_error", "code": None}
            return web.json_response({"error": error}, status=500)
        return web.json_response({"object": "text_completion", "choices": []})


async def complete(url: str) -> int:
    body = json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": 1})
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/completions", data=body) as response:
            await response.read()
            return response.status


@pytest.mark.asyncio
async def test_a_prefix_moves_off_a_pod_that_answers_with_errors():
    pods = [Pod(), Pod()]
    async with running_router(pods) as (url, _router):
        assert await complete(url) == 200
        [home] = [pod for pod in pods if pod.requests == 1]
        [other] = [pod for pod in pods if pod is not home]
        assert [await complete(url) for _ in range(3)] == [200] * 3
        assert (home.requests, other.requests) == (4, 0)  # the prefix stays on its pod
        home.failing = True
        assert await complete(url) == 500  # the first error reaches the client...
        assert [await complete(url) for _ in range(5)] == [200] * 5  # ...then the other pod
        assert (home.requests, other.requests) == (5, 5)


def test_the_policy_prefers_a_pod_that_is_not_failing_and_falls_back_when_all_are():
    config = PolicyConfig()
    hashes = [b"h1", b"h2"]
    healthy = PodState("http://b", metrics_age_s=0.1)
    failing = PodState("http://a", metrics_age_s=0.1, failing=True)
    decision = choose_pod(hashes, [failing, healthy], lambda h: "http://a", config)
    assert decision.url == "http://b" and decision.reason != "prefix"
    only_failing = choose_pod(hashes, [failing], lambda h: "http://a", config)
    assert only_failing.url == "http://a"


def test_a_failing_mark_expires_and_a_good_answer_clears_it():
    now = [100.0]
    registry = PodRegistry(clock=lambda: now[0])
    registry.set_endpoints(["http://a"])
    registry.record_answer("http://a", 500)
    assert registry.states()[0].failing
    now[0] += discovery.FAILING_FOR_S
    assert not registry.states()[0].failing  # one request may try it again
    registry.record_answer("http://a", 503)
    assert registry.states()[0].failing
    registry.record_answer("http://a", 200)
    assert not registry.states()[0].failing
