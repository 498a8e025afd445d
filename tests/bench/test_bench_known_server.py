"""The client against a tiny SSE server on loopback that streams at known times (first
text after 300 ms, then one chunk every 100 ms) and fails in known ways: latencies come
out as sent, concurrency and request rate are honoured, failures are counted with their
errors kept, and the duration limit cuts a run short.

The server records when it really received and wrote each chunk (the same clock as the
client's, in the same process), and the latency test holds the client's figures to those
moments rather than to the nominal 300/100 ms: on a loaded machine the server's sleeps
overrun, and the client must report what happened, not what was planned. The garbage
collector is held off while a scenario runs (a full collection in a test process that has
built many engines pauses the loop for a few hundred milliseconds)."""

import asyncio
import gc
import itertools
import math
import statistics
import time

import pytest
from aiohttp import web
from pagefleet_bench.backend import RequestSettings
from pagefleet_bench.datasets import SampleRequest
from pagefleet_bench.runner import RunSettings, run_requests, send_times

FIRST_S, GAP_S, TOKENS = 0.3, 0.1, 4


class KnownServer:
    """Streams TOKENS chunks of completions text; the prompt picks the behaviour."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.in_flight = self.peak_in_flight = 0
        self.arrivals: list[float] = []
        self.writes: dict[str, list[float]] = {}  # prompt -> its arrival, then each chunk's write

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.arrivals.append(time.perf_counter())
        writes = self.writes.setdefault(body["prompt"], [self.arrivals[-1]])
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
                writes.append(time.perf_counter())
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

        gc.collect()
        gc.disable()
        try:
            return asyncio.run(main())
        finally:
            gc.enable()

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
    # What the server did, request by request: arrival, then TOKENS text chunks.
    served = [known.writes[p] for p in ("a", "b")]
    ttfts = [w[1] - w[0] for w in served]
    gaps = [later - earlier for w in served for earlier, later in itertools.pairwise(w[1:])]
    assert min(ttfts) >= FIRST_S and min(gaps) >= GAP_S  # sleeps never end early
    # The client sends before the server receives and reads after the server writes, so
    # its TTFT is never below the server's and exceeds it only by the loopback hop.
    for client, server in zip(result["ttfts"], ttfts, strict=True):
        assert server <= client <= server + 0.06, (result["ttfts"], ttfts)
    assert result["mean_ttft_ms"] == pytest.approx(1000 * statistics.mean(result["ttfts"]))
    for client, server in zip(result["itls"], served, strict=True):
        assert len(client) == TOKENS - 1
        assert sum(client) == pytest.approx(server[-1] - server[1], abs=0.06)
    assert result["median_itl_ms"] == pytest.approx(1000 * statistics.median(gaps), abs=30)
    latencies = [w[-1] - w[0] for w in served]
    assert 1000 * statistics.mean(latencies) <= result["mean_e2el_ms"]
    assert result["mean_e2el_ms"] == pytest.approx(1000 * statistics.mean(latencies), abs=60)
    # TPOT = (latency - TTFT) / (tokens - 1); every request has TOKENS tokens.
    tpot = (result["mean_e2el_ms"] - result["mean_ttft_ms"]) / (TOKENS - 1)
    assert result["mean_tpot_ms"] == pytest.approx(tpot)
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
    # Three waves of two, each at least FIRST_S + 3 * GAP_S long (the server's sleeps), and
    # well short of four waves.
    wave = FIRST_S + 3 * GAP_S
    assert 3 * wave <= result["duration"] < 3.9 * wave


def test_request_rate_spaces_the_arrivals(serve_known):
    run = RunSettings(request_rate=10.0, burstiness=1000.0, progress=False)  # ~0.1 s apart

    async def scenario(base_url, known):
        return await run_requests(settings(base_url), samples(*"abcde"), run, len), known

    result, known = serve_known(scenario)
    schedule = send_times(5, run.request_rate, run.burstiness, run.seed)
    gaps = [later - earlier for earlier, later in itertools.pairwise(schedule)]
    assert all(g == pytest.approx(0.1, rel=0.1) for g in gaps), schedule
    # Each request leaves at its scheduled time, never before, and before the next one's.
    for sent, planned, following in zip(
        result["start_times"], schedule, [*schedule[1:], 9], strict=True
    ):
        assert planned <= sent < following, (result["start_times"], schedule)
    assert known.arrivals == sorted(known.arrivals)
    assert [body["prompt"] for body in known.bodies] == list("abcde")


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
    # Cut at the limit, long before the three requests' 1.8 s run one after another.
    assert 0.44 <= result["duration"] < 1.0
    assert (result["completed"], result["failed"], result["incomplete"]) == (0, 0, 3)
    # The first request had streamed about two chunks ("tok", counted by len) when cut off.
    assert result["total_output_tokens"] in (3, 6, 9)
    assert result["mean_ttft_ms"] == 0.0
    assert not math.isnan(result["output_throughput"])
