"""The client against a tiny SSE server on loopback that streams at known times (first
text after 300 ms, then one chunk every 100 ms) and fails in known ways: latencies come
out as sent, concurrency and request rate are honoured, failures are counted with their
errors kept, and the duration limit cuts a run short."""

import asyncio
import math
import time

import pytest
from aiohttp import web
from pagefleet_bench.backend import RequestSettings
from pagefleet_bench.datasets import SampleRequest
from pagefleet_bench.runner import RunSettings, run_requests

FIRST_S, GAP_S, TOKENS = 0.3, 0.1, 4


class KnownServer:
    """Streams TOKENS chunks of completions text; the prompt picks the behaviour."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.in_flight = self.peak_in_flight = 0
        self.arrivals: list[float] = []

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.arrivals.append(time.perf_counter())
        if body["prompt"] == "reject":
            return web.json_response({"error": {"message": "no such model"}}, status=404)
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await asyncio.sleep(FIRST_S)
            for i in range(TOKENS):
                if i:
                    await asyncio.sleep(GAP_S)
                if body["prompt"] == "break" and i == 2:
                    await response.write(b'data: {"error": {"message": "engine step failed"}}\n\n')
                    await response.write(b"data: [DONE]\n\n")
                    return response
                chunk = b'data: {"choices": [{"index": 0, "text": "tok"}]}\n\n'
                await response.write(chunk)
            usage = b'data: {"choices": [], "usage": {"completion_tokens": %d}}\n\n' % TOKENS
            await response.write(usage + b"data: [DONE]\n\n")
            return response
        finally:
            self.in_flight -= 1


@pytest.fixture
def serve_known():
    """Runs `scenario(base_url, server)` (a coroutine) with the server up on loopback."""

    def run(scenario):
        async def main():
            known = KnownServer()
            app = web.Application()
            app.router.add_post("/v1/completions", known.completions)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]
            try:
                return await scenario(f"http://127.0.0.1:{port}", known)
            finally:
                await runner.cleanup()

        return asyncio.run(main())

    return run


def settings(base_url: str, **kwargs) -> RequestSettings:
    return RequestSettings(base_url=base_url, endpoint="/v1/completions", model="m", **kwargs)


def samples(*prompts: str) -> list[SampleRequest]:
    return [SampleRequest(p, prompt_len=7, expected_output_len=TOKENS) for p in prompts]


def test_latencies_match_the_servers_timing(serve_known):
    async def scenario(base_url, known):
        run = RunSettings(max_concurrency=2, progress=False)
        extra = {"top_k": 1}
        result = await run_requests(
            settings(base_url, ignore_eos=True, extra_body=extra), samples("a", "b"), run, len
        )
        return result, known

    result, known = serve_known(scenario)
    assert result["completed"] == 2 and result["failed"] == 0
    assert result["total_output_tokens"] == 2 * TOKENS and result["total_input_tokens"] == 14
    assert result["mean_ttft_ms"] == pytest.approx(1000 * FIRST_S, abs=60)
    assert result["median_itl_ms"] == pytest.approx(1000 * GAP_S, abs=30)
    expected_latency = FIRST_S + (TOKENS - 1) * GAP_S
    assert result["mean_e2el_ms"] == pytest.approx(1000 * expected_latency, abs=90)
    # TPOT = (latency - TTFT) / (tokens - 1) = the gap
    assert result["mean_tpot_ms"] == pytest.approx(1000 * GAP_S, abs=30)
    assert result["max_concurrent_requests"] == 2
    body = known.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["top_k"] == 1 and body["max_tokens"] == TOKENS
    assert body["temperature"] == 0.0 and body["model"] == "m"


def test_max_concurrency_bounds_requests_in_flight(serve_known):
    async def scenario(base_url, known):
        run = RunSettings(max_concurrency=2, progress=False)
        result = await run_requests(settings(base_url), samples(*"abcdef"), run, len)
        return result, known

    result, known = serve_known(scenario)
    assert result["completed"] == 6
    assert known.peak_in_flight == 2
    # Three waves of two, each FIRST_S + 3 * GAP_S long.
    assert result["duration"] == pytest.approx(3 * (FIRST_S + 3 * GAP_S), abs=0.5)


def test_request_rate_spaces_the_arrivals(serve_known):
    async def scenario(base_url, known):
        run = RunSettings(request_rate=10.0, burstiness=1000.0, progress=False)  # ~0.1 s apart
        await run_requests(settings(base_url), samples(*"abcde"), run, len)
        return known

    known = serve_known(scenario)
    gaps = [b - a for a, b in zip(known.arrivals, known.arrivals[1:], strict=False)]
    assert all(g == pytest.approx(0.1, abs=0.04) for g in gaps), gaps


def test_failures_are_counted_and_their_errors_kept(serve_known):
    async def scenario(base_url, known):
        run = RunSettings(progress=False)
        prompts = samples("a", "reject", "break", "b")
        return await run_requests(settings(base_url), prompts, run, len)

    result = serve_known(scenario)
    assert (result["completed"], result["failed"]) == (2, 2)
    assert result["errors"][0] == "" and result["errors"][3] == ""
    assert result["errors"][1].startswith("HTTP 404") and "no such model" in result["errors"][1]
    assert "engine step failed" in result["errors"][2]
    assert sum(result["error_counts"].values()) == 2
    assert result["output_lens"] == [TOKENS, 0, 0, TOKENS]
    assert result["total_output_tokens"] == 2 * TOKENS  # the broken stream adds none


def test_unreachable_server_is_a_failure_not_a_crash():
    async def scenario():
        run = RunSettings(progress=False)
        return await run_requests(settings("http://127.0.0.1:9"), samples("a"), run, len)

    result = asyncio.run(scenario())
    assert result["failed"] == 1 and result["completed"] == 0
    assert "Connect" in result["errors"][0]


def test_duration_limit_reports_incomplete_requests(serve_known):
    async def scenario(base_url, known):
        run = RunSettings(max_concurrency=1, duration_limit=0.45, progress=False)
        return await run_requests(settings(base_url), samples("a", "b", "c"), run, len)

    result = serve_known(scenario)
    assert result["duration"] == pytest.approx(0.45, abs=0.15)
    assert (result["completed"], result["failed"], result["incomplete"]) == (0, 0, 3)
    # The first request had streamed about two chunks ("tok", counted by len) when cut off.
    assert result["total_output_tokens"] in (3, 6, 9)
    assert result["mean_ttft_ms"] == 0.0
    assert not math.isnan(result["output_throughput"])
