"""Scrape the serving pods' /metrics directly (pod IP + port) for the autoscaler, and the
router pods' for the requests they hold while no serving pod is ready."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pagefleet_serve.metric_names import (
    KV_CACHE_USAGE_PERC,
    NUM_REQUESTS_WAITING,
    ROUTER_HELD_REQUESTS,
)
from prometheus_client.parser import text_string_to_metric_families

from .autoscale import PodSample
from .pod_http import PodAnswerTooLarge, call_pod, get_pod_url

SCRAPE_TIMEOUT_SECONDS = 2.0
# A serving pod's whole /metrics is a few tens of KiB; anything far larger is not one.
MAX_METRICS_BYTES = 2 * 1024 * 1024

logger = logging.getLogger(__name__)


class MetricsError(ValueError):
    pass


def parse_metrics(text: str) -> tuple[float, float]:
    """(KV-cache usage 0-1, requests waiting) from Prometheus text.

    A pod serves one model, but a label set per model is allowed: the busiest KV
    cache counts (it is shared), and waiting requests add up.
    """
    kv_values: list[float] = []
    waiting = 0.0
    seen_waiting = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == KV_CACHE_USAGE_PERC:
                kv_values.append(sample.value)
            elif sample.name == NUM_REQUESTS_WAITING:
                waiting += sample.value
                seen_waiting = True
    if not kv_values or not seen_waiting:
        raise MetricsError(f"missing {KV_CACHE_USAGE_PERC} or {NUM_REQUESTS_WAITING}")
    return max(kv_values), waiting


def is_pod_ready(pod: Mapping[str, Any]) -> bool:
    if pod.get("metadata", {}).get("deletionTimestamp") or not pod.get("status", {}).get("podIP"):
        return False
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def get_metrics_url(pod: Mapping[str, Any]) -> str:
    return f"{get_pod_url(pod)}/metrics"


def fetch_metrics(
    url: str, timeout: float = SCRAPE_TIMEOUT_SECONDS, max_bytes: int = MAX_METRICS_BYTES
) -> str:
    try:
        return call_pod(url, timeout=timeout, max_bytes=max_bytes).decode("utf-8")
    except PodAnswerTooLarge as exc:
        raise MetricsError(f"/metrics {exc}") from None


def scrape_pod(pod: Mapping[str, Any]) -> PodSample:
    name = pod["metadata"]["name"]
    if not is_pod_ready(pod):
        return PodSample(name, ready=False)
    url = get_metrics_url(pod)
    try:
        kv, waiting = parse_metrics(fetch_metrics(url))
    except (OSError, ValueError) as exc:
        logger.warning("cannot scrape %s (%s): %s", name, url, exc)
        return PodSample(name, ready=True)
    return PodSample(name, ready=True, kv_cache_usage=kv, num_requests_waiting=waiting)


def scrape_pods(pods: Iterable[Mapping[str, Any]]) -> list[PodSample]:
    return _scrape_each(scrape_pod, pods)


def parse_held_requests(text: str) -> int:
    """The router's held-requests gauge from its Prometheus text."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == ROUTER_HELD_REQUESTS:
                return round(sample.value)
    raise MetricsError(f"missing {ROUTER_HELD_REQUESTS}")


def scrape_router_pod(pod: Mapping[str, Any]) -> int:
    """The requests one router pod holds; 0 when it is not ready or cannot be read (its
    held requests then wait for the next round, which is seconds away)."""
    name = pod["metadata"]["name"]
    if not is_pod_ready(pod):
        return 0
    url = get_metrics_url(pod)
    try:
        return parse_held_requests(fetch_metrics(url))
    except (OSError, ValueError) as exc:
        logger.warning("cannot scrape router %s (%s): %s", name, url, exc)
        return 0


def scrape_held_requests(pods: Iterable[Mapping[str, Any]]) -> int:
    """The requests every router pod holds together (each holds its own)."""
    return sum(_scrape_each(scrape_router_pod, pods))


def _scrape_each(scrape: Callable[[Mapping[str, Any]], Any], pods: Iterable[Mapping[str, Any]]):
    pods = list(pods)
    if not pods:
        return []
    # One slow pod must not delay the others: scrape concurrently, each with a timeout.
    with ThreadPoolExecutor(max_workers=min(16, len(pods))) as pool:
        return list(pool.map(scrape, pods))
