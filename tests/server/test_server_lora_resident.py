"""Which LoRA adapters a real `pagefleet serve` reports resident after their requests
finish (pagefleet:lora_adapter_resident): the one in its single device slot, and with
--max-cpu-loras the ones in host memory only; what the router reads of it.

vllm:lora_requests_info names only the adapters of running and waiting requests, so an
idle pod reports none there: without this series the router could not keep an idle
adapter's next request on the pod that holds it.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from pagefleet_router.discovery import parse_pod_metrics
from prometheus_client.parser import text_string_to_metric_families

from tests.server.server_harness import ServerProcess, read_metrics
from tests.server.test_server_lora import PROMPT, write_adapter

RESIDENT = "pagefleet:lora_adapter_resident"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    modules = [f"{name}={write_adapter(root / name, 4, seed)}" for seed, name in enumerate("abc")]
    # One device slot, two adapters in host memory: loading a, b, c at start-up leaves
    # b and c there (a, the least recently used, is read again when a request needs it).
    process = ServerProcess(
        "--host",
        "127.0.0.1",
        "--lora-modules",
        *modules,
        "--max-loras",
        "1",
        "--max-cpu-loras",
        "2",
        env={
            "PAGEFLEET_SERVED_MODEL_NAME": "smol",
            "PAGEFLEET_MAX_MODEL_LEN": "256",
            "PAGEFLEET_KV_CACHE_MEMORY": "32MiB",
            "PAGEFLEET_MAX_NUM_SEQS": "2",
            "PAGEFLEET_ENABLE_LORA": "true",
        },
    ).wait_ready()
    try:
        yield process
    finally:
        process.stop()


def resident(base_url: str) -> dict[str, str]:
    """lora_name -> tier, as /metrics reports it."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    samples = [
        sample
        for family in text_string_to_metric_families(text)
        if family.name == RESIDENT
        for sample in family.samples
    ]
    assert {sample.value for sample in samples} <= {1.0}
    return {sample.labels["lora_name"]: sample.labels["tier"] for sample in samples}


def complete(server: ServerProcess, model: str) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)


def test_idle_adapters_are_reported_resident_by_tier(server):
    assert resident(server.base_url) == {"b": "cpu", "c": "cpu"}  # no request yet
    complete(server, "b")
    # b's request has finished: lora_requests_info names no adapter, b stays in its slot
    assert resident(server.base_url) == {"b": "device", "c": "cpu"}
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    info = [k for k in read_metrics(server.base_url) if k.startswith("vllm:lora_requests_info")]
    assert info == [
        'vllm:lora_requests_info{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""}'
    ]
    metrics = parse_pod_metrics(text)
    assert metrics.adapters == {"b"} and metrics.cpu_adapters == {"c"}
    # a is read back into host memory for its request, evicting c (b is in the slot);
    # a then takes the slot and b stays in host memory
    complete(server, "a")
    assert resident(server.base_url) == {"a": "device", "b": "cpu"}
