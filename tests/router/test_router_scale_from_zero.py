"""Scale from zero through the router, in process with real sockets: requests that arrive
while no pod is ready are held in a bounded queue, the service is woken once, and the held
requests go to the first pod that becomes ready (a real `pagefleet serve` started only
when woken). A held client that leaves is dropped; a full queue and a timeout are
OpenAI-style 503s."""

from __future__ import annotations

import asyncio
import contextlib

import openai
import pytest
import pytest_asyncio
from aiohttp import web
from pagefleet_router.discovery import ScrapeSettings
from pagefleet_router.proxy import Router, RouterSettings

from tests.server.server_harness import ServerProcess, read_metrics

MODEL = "smollm2-135m"
POD_FLAGS = ("--max-model-len", "512", "--kv-cache-memory", "64MiB")


class LatePod:
    """Discovery and waker of a service at zero replicas: no pod until woken, then one
    real `pagefleet serve`, listed once it has bound its port (not yet ready)."""

    def __init__(self, start_pod: bool = True) -> None:
        self.start_pod = start_pod
        self.wakes = 0
        self.server: ServerProcess | None = None

    async def wake(self) -> None:
        self.wakes += 1
        if self.start_pod and self.server is None:
            self.server = ServerProcess(*POD_FLAGS)

    async def endpoints(self) -> list[str]:
        if self.server is None:
            return []
        return [await asyncio.to_thread(lambda: self.server.base_url)]

    async def watch(self, changed) -> None:
        """Nothing to watch: the scrape rounds read the list."""

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


@contextlib.asynccontextmanager
async def running_router(pod: LatePod, **settings):
    scrape = ScrapeSettings(interval_s=0.2, timeout_s=2.0)
    router = Router(RouterSettings(scrape=scrape, **settings), pod, waker=pod)
    runner = web.AppRunner(router.create_app(), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield router, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
        pod.stop()


async def wait_held(router: Router, count: int) -> None:
    for _ in range(500):
        if router.metrics.held._value.get() == count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never {count} held requests")


@pytest_asyncio.fixture
async def late_pod():
    pod = LatePod()
    yield pod
    pod.stop()


async def stream_text(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, str | None]:
    stream = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True
    )
    text, finish = "", None
    async for chunk in stream:
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    return text, finish


@pytest.mark.asyncio
async def test_requests_held_at_zero_complete_on_the_pod_started_late(late_pod):
    async with running_router(late_pod, hold_timeout_s=240) as (router, url):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        prompts = ["The capital of France is", "One, two, three,"]
        requests = [asyncio.create_task(stream_text(client, p)) for p in prompts]
        await wait_held(router, 2)
        assert late_pod.wakes >= 1 and late_pod.server is not None
        results = await asyncio.wait_for(asyncio.gather(*requests), 240)
        assert router.metrics.held._value.get() == 0
        # Normal streams, each the pod's own answer for its prompt.
        direct = openai.AsyncOpenAI(
            base_url=f"{late_pod.server.base_url}/v1", api_key="none", max_retries=0
        )
        for prompt, (text, finish) in zip(prompts, results, strict=True):
            assert finish == "length" and text
            assert (text, finish) == await stream_text(direct, prompt)
        counters = read_metrics(late_pod.server.base_url)
        # Nothing lost, nothing sent twice: 2 through the router + 2 direct.
        assert counters['vllm:request_success_total{finished_reason="length"}'] == 4


@pytest.mark.asyncio
async def test_a_held_client_that_leaves_is_dropped_and_the_queue_is_bounded():
    pod = LatePod(start_pod=False)  # woken, but no pod ever comes
    async with running_router(pod, max_held_requests=1, hold_timeout_s=60) as (router, url):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        held = asyncio.create_task(stream_text(client, "hello"))
        await wait_held(router, 1)
        with pytest.raises(openai.APIStatusError) as refused:
            await stream_text(client, "a second one")
        assert refused.value.status_code == 503
        assert refused.value.body["code"] == "hold_queue_full"
        assert "--max-held-requests 1" in refused.value.body["message"]
        held.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await held
        await wait_held(router, 0)  # the leaving client's place is free again
        assert pod.wakes == 1


@pytest.mark.asyncio
async def test_a_held_request_times_out_with_a_clear_503():
    pod = LatePod(start_pod=False)
    async with running_router(pod, hold_timeout_s=0.5) as (router, url):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.APIStatusError) as refused:
            await stream_text(client, "hello")
        assert refused.value.status_code == 503
        assert refused.value.body["code"] == "model_starting_timeout"
        assert "no pod became ready within 0.5 s" in refused.value.body["message"]
        metrics = router.metrics.render().decode()
        assert 'pagefleet:router_hold_refusals_total{reason="timeout"} 1.0' in metrics
