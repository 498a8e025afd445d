"""Scrape the serving pods' /metrics directly (pod IP + port) for the autoscaler."""

from __future__ import annotations

import logging
import urllib.request
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from .autoscale import PodSample
from .names import HTTP_PORT, HTTP_PORT_NAME

KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
SCRAPE_TIMEOUT_SECONDS = 2.0

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
            if sample.name == KV_CACHE_USAGE:
                kv_values.append(sample.value)
            elif sample.name == NUM_REQUESTS_WAITING:
                waiting += sample.value
                seen_waiting = True
    if not kv_values or not seen_waiting:
        raise MetricsError(f"missing {KV_CACHE_USAGE} or {NUM_REQUESTS_WAITING}")
    return max(kv_values), waiting


def is_pod_ready(pod: Mapping[str, Any]) -> bool:
    if pod.get("metadata", {}).get("deletionTimestamp") or not pod.get("status", {}).get("podIP"):
        return False
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def get_metrics_url(pod: Mapping[str, Any]) -> str:
    port = HTTP_PORT
    for container in pod.get("spec", {}).get("containers", []):
        for item in container.get("ports", []):
            if item.get("name") == HTTP_PORT_NAME:
                port = item["containerPort"]
    ip = pod["status"]["podIP"]
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}/metrics"


def fetch_metrics(url: str, timeout: float = SCRAPE_TIMEOUT_SECONDS) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (http only)
        return response.read().decode("utf-8")


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
    pods = list(pods)
    if not pods:
        return []
    # One slow pod must not delay the others: scrape concurrently, each with a timeout.
    with ThreadPoolExecutor(max_workers=min(16, len(pods))) as pool:
        return list(pool.map(scrape_pod, pods))
