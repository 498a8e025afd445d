"""Sends a run's requests: arrivals at a request rate (gamma-distributed gaps: Poisson at
burstiness 1, burstier below 1, steadier above), at most `max_concurrency` in flight, a
progress bar, an optional duration limit; returns the result of metrics.compute_metrics
plus the run's settings."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
from dataclasses import dataclass

import aiohttp
from tqdm import tqdm

from pagefleet_bench.backend import Clock, RequestOutput, RequestSettings, send_request
from pagefleet_bench.datasets import SampleRequest
from pagefleet_bench.metrics import METRICS, compute_metrics

# A request may legitimately run for a long time under a heavy load; vLLM waits 6 hours.
_REQUEST_TIMEOUT_S = 6 * 3600
_READ_BUFFER_BYTES = 8 * 2**20  # one SSE line may carry a long text or error


@dataclass(frozen=True)
class RunSettings:
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    # Seconds after which requests still running are cancelled and counted as incomplete.
    duration_limit: float | None = None
    percentiles: tuple[float, ...] = (99.0,)
    selected_metrics: tuple[str, ...] = METRICS
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(
                f"request-rate must be > 0 (inf: all at once), got {self.request_rate}"
            )
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.duration_limit is not None and not self.duration_limit > 0:
            raise ValueError(f"duration-limit must be > 0, got {self.duration_limit}")
        unknown = set(self.selected_metrics) - set(METRICS)
        if unknown:
            raise ValueError(
                f"percentile-metrics: unknown {sorted(unknown)}; choose from {METRICS}"
            )


def send_times(num_requests: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: the first at 0, then gaps
    drawn from a gamma distribution with mean 1/rate and shape `burstiness`."""
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(num_requests):
        times.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return times


def client_session(max_concurrency: int | None) -> aiohttp.ClientSession:
    # One connection per request: servers close idle keep-alive connections on their own
    # schedules (llama.cpp's after a few seconds), and a request sent on a connection the
    # server has just closed would fail through no fault of the server.
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(
            limit=max_concurrency or 0, ttl_dns_cache=300, force_close=True
        ),
        timeout=aiohttp.ClientTimeout(total=_REQUEST_TIMEOUT_S),
        read_bufsize=_READ_BUFFER_BYTES,
        trust_env=False,
    )


async def check_server(settings: RequestSettings, sample: SampleRequest) -> RequestOutput:
    """One short request before the run, so a wrong URL, model or body fails at once."""
    async with client_session(1) as session:
        probe = dataclasses.replace(sample, expected_output_len=min(sample.expected_output_len, 4))
        return await send_request(session, settings, probe)


async def run_requests(
    settings: RequestSettings,
    samples: list[SampleRequest],
    run: RunSettings,
    count_tokens,
    clock: Clock = time.perf_counter,
) -> dict:
    """Send every sample as `run` says; the result dict of compute_metrics plus settings."""
    outputs = [RequestOutput(s.prompt_len, s.expected_output_len) for s in samples]
    offsets = send_times(len(samples), run.request_rate, run.burstiness, run.seed)
    limit = asyncio.Semaphore(run.max_concurrency or len(samples) or 1)
    progress = tqdm(total=len(samples), disable=not run.progress, dynamic_ncols=True)

    async with client_session(run.max_concurrency) as session:
        start = clock()

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, offsets[i] - (clock() - start)))
            async with limit:
                await send_request(session, settings, samples[i], clock, outputs[i])
            progress.update(1)

        tasks = [asyncio.create_task(one(i)) for i in range(len(samples))]
        _, pending = await asyncio.wait(tasks, timeout=run.duration_limit) if tasks else ((), ())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = clock() - start
    progress.close()
    index = {task: i for i, task in enumerate(tasks)}
    for task in pending:
        outputs[index[task]].incomplete, outputs[index[task]].success = True, False
    result = compute_metrics(outputs, duration, count_tokens, run.percentiles, run.selected_metrics)
    result["request_rate"] = run.request_rate
    result["burstiness"] = run.burstiness
    result["max_concurrency"] = run.max_concurrency
    result["duration_limit"] = run.duration_limit
    result["num_prompts"] = len(samples)
    result["start_times"] = [o.start_time - start for o in outputs]
    return result
