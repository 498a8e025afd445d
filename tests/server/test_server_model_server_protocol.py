"""The Gateway API Inference Extension's model-server protocol on a real pod's /metrics:
the queue, running and KV-usage gauges, and `vllm:cache_config_info`, a gauge whose
labels `block_size` and `num_gpu_blocks` give the KV cache's shape (what a prefix scorer
models the pod's cache with). `vllm:lora_requests_info` is checked with adapters in
test_server_lora.py."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import DEFAULT_POD_MODEL


def test_the_protocols_gauges_and_the_cache_config_info(default_pod):
    text = httpx.get(f"{default_pod.base_url}/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
    ):
        assert families[name].type == "gauge", name
    info = families["vllm:cache_config_info"]
    assert info.type == "gauge"
    (sample,) = info.samples
    (blocks,) = families["pagefleet:kv_cache_blocks"].samples
    assert sample.labels == {
        "model_name": DEFAULT_POD_MODEL,
        "block_size": "16",
        "num_gpu_blocks": str(int(blocks.value)),
    }
    assert sample.value == 1.0 and blocks.value > 0
