"""Which pods exist (a `Discovery`) and how loaded they are (a scrape of each pod's
/metrics), kept in a `PodRegistry` the policy reads as `PodState`s."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import aiohttp
from pagefleet_serve import metric_names as names
from prometheus_client.parser import text_string_to_metric_families

from .policy import PodState

logger = logging.getLogger("pagefleet_router.discovery")

# The pod's gauge names (vLLM's), read as PodMetrics fields.
POD_GAUGES = {
    names.NUM_REQUESTS_WAITING: "num_requests_waiting",
    names.NUM_REQUESTS_RUNNING: "num_requests_running",
    names.KV_CACHE_USAGE_PERC: "kv_cache_usage",
}


class Discovery(Protocol):
    """The base URLs of the ready pods now (read once per scrape round), and a watch
    that says at once when they may have changed, so that a new pod is scraped and a
    gone one dropped without waiting for the round."""

    async def endpoints(self) -> list[str]: ...

    async def watch(self, changed: Callable[[], None]) -> None:
        """Runs until cancelled (or returns: nothing to watch), calling `changed`."""
        ...


@dataclass(frozen=True)
class StaticEndpoints:
    urls: tuple[str, ...]

    async def endpoints(self) -> list[str]:
        return list(self.urls)

    async def watch(self, changed: Callable[[], None]) -> None:
        """A fixed list never changes."""


@dataclass(frozen=True)
class PodMetrics:
    num_requests_waiting: float
    num_requests_running: float
    kv_cache_usage: float
    adapters: frozenset[str] = frozenset()
    cpu_adapters: frozenset[str] = frozenset()


def parse_pod_metrics(text: str) -> PodMetrics:
    """The load gauges from a pod's Prometheus text, summed over label sets (one per
    served model name); the LoRA adapters its running and waiting requests use (the
    comma-separated labels of vllm:lora_requests_info) with those resident in its device
    slots though idle (pagefleet:lora_adapter_resident, tier "device"), and those in its
    host memory only (tier "cpu"), all absent when LoRA is off; a missing gauge is an
    error naming it."""
    values: dict[str, float] = {}
    resident: dict[str, set[str]] = {"device": set(), "cpu": set()}
    # vllm:lora_requests_info per model: vLLM keeps every label set it ever exported, the
    # newest (its value is the time) is the current one.
    adapter_info: dict[str, tuple[float, set[str]]] = {}
    for family in text_string_to_metric_families(text):
        if family.name in POD_GAUGES:
            field = POD_GAUGES[family.name]
            values[field] = values.get(field, 0.0) + sum(s.value for s in family.samples)
        elif family.name == names.LORA_REQUESTS_INFO:
            for sample in family.samples:
                model = sample.labels.get("model_name", "")
                if model in adapter_info and adapter_info[model][0] >= sample.value:
                    continue
                names_in_use = {
                    n
                    for label in ("running_lora_adapters", "waiting_lora_adapters")
                    for n in sample.labels.get(label, "").split(",")
                    if n
                }
                adapter_info[model] = (sample.value, names_in_use)
        elif family.name == names.LORA_ADAPTER_RESIDENT:
            for sample in family.samples:
                tier = resident.get(sample.labels.get("tier", ""))
                if tier is not None and sample.value > 0:
                    tier.add(sample.labels.get("lora_name", ""))
    missing = [name for name, field in POD_GAUGES.items() if field not in values]
    if missing:
        raise ValueError(f"/metrics lacks {', '.join(missing)}")
    in_use = frozenset().union(*(names for _, names in adapter_info.values()))
    on_device = in_use | resident["device"]
    return PodMetrics(
        **values, adapters=on_device, cpu_adapters=frozenset(resident["cpu"] - on_device)
    )


# How long a pod that answered with a server error is routed around.
FAILING_FOR_S = 10.0


class PodRegistry:
    """The pods discovery lists, each with its last scraped metrics, when they were
    scraped, and this router's in-flight requests to it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._metrics: dict[str, tuple[PodMetrics, float] | None] = {}
        self._in_flight: dict[str, int] = {}
        self._errors: dict[str, float] = {}  # when each pod last answered with a 5xx

    def set_endpoints(self, urls: list[str]) -> list[str]:
        """Replace the pod list; returns the pods that vanished."""
        vanished = [url for url in self._metrics if url not in urls]
        for url in vanished:
            del self._metrics[url]
        for url in urls:
            self._metrics.setdefault(url, None)
        return vanished

    def update(self, url: str, metrics: PodMetrics | None) -> None:
        """Record a scrape; None (it failed) leaves the pod with no fresh metrics."""
        if url in self._metrics:
            self._metrics[url] = None if metrics is None else (metrics, self._clock())

    def mark_failed(self, url: str) -> None:
        """A request to the pod failed to connect: treat its metrics as stale until the
        next successful scrape, so the policy prefers other pods."""
        self.update(url, None)

    def record_answer(self, url: str, status: int) -> None:
        """A pod answered a request: a server error marks it failing for FAILING_FOR_S
        (then one request tries it again); any other answer clears the mark."""
        if status >= 500:
            self._errors[url] = self._clock()
        else:
            self._errors.pop(url, None)

    def acquire(self, url: str) -> None:
        self._in_flight[url] = self._in_flight.get(url, 0) + 1

    def release(self, url: str) -> None:
        self._in_flight[url] -= 1

    def states(self) -> list[PodState]:
        now = self._clock()
        states = []
        for url, scraped in self._metrics.items():
            in_flight = self._in_flight.get(url, 0)
            failing = now - self._errors.get(url, -math.inf) < FAILING_FOR_S
            if scraped is None:
                states.append(PodState(url=url, in_flight=in_flight, failing=failing))
                continue
            metrics, at = scraped
            states.append(
                PodState(
                    url=url,
                    num_requests_waiting=metrics.num_requests_waiting,
                    num_requests_running=metrics.num_requests_running,
                    kv_cache_usage=metrics.kv_cache_usage,
                    metrics_age_s=now - at,
                    in_flight=in_flight,
                    failing=failing,
                    adapters=metrics.adapters,
                    cpu_adapters=metrics.cpu_adapters,
                )
            )
        return states


@dataclass(frozen=True)
class ScrapeSettings:
    interval_s: float = 1.0
    timeout_s: float = 2.0
    max_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        for name in ("interval_s", "timeout_s", "max_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"scrape {name} must be > 0, got {getattr(self, name)}")


async def scrape_pod(
    session: aiohttp.ClientSession, url: str, settings: ScrapeSettings
) -> PodMetrics | None:
    """One pod's load gauges, or None (logged) if /metrics is unreachable, slow, larger
    than the cap or malformed."""
    try:
        timeout = aiohttp.ClientTimeout(total=settings.timeout_s)
        async with session.get(f"{url}/metrics", timeout=timeout) as response:
            if response.status != 200:
                raise ValueError(f"/metrics answered {response.status}")
            body = bytearray()
            async for chunk in response.content.iter_any():
                body += chunk
                if len(body) > settings.max_bytes:
                    raise ValueError(f"/metrics is larger than {settings.max_bytes} bytes")
        return parse_pod_metrics(body.decode())
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        logger.warning("scraping %s/metrics failed: %s", url, exc or type(exc).__name__)
        return None


async def refresh(
    discovery: Discovery,
    registry: PodRegistry,
    session: aiohttp.ClientSession,
    settings: ScrapeSettings,
) -> list[str]:
    """One round: the current pod list, then every pod scraped concurrently. Returns the
    pods that vanished."""
    urls = await discovery.endpoints()
    vanished = registry.set_endpoints(urls)
    results = await asyncio.gather(*(scrape_pod(session, url, settings) for url in urls))
    for url, metrics in zip(urls, results, strict=True):
        registry.update(url, metrics)
    return vanished
