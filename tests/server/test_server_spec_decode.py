"""Speculative decoding behind the real server: `--speculative-config` from the command
line, the same greedy text through the OpenAI client as without it, and vLLM's
spec_decode counters on /metrics."""

import json
import subprocess
import sys

import pytest
from openai import OpenAI

from tests.server.server_harness import ServerProcess, read_metrics

# A pattern the model continues, so that prompt lookup proposes and the model accepts.
PROMPT = "1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4,"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


@pytest.fixture(scope="module")
def server():
    process = ServerProcess(
        "--host", "127.0.0.1", "--max-model-len", "512", "--speculative-config", json.dumps(NGRAM)
    ).wait_ready()
    try:
        yield process
    finally:
        process.stop()


def test_spec_decode_counters_count_the_drafts_of_a_real_request(server):
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    response = client.completions.create(
        model="smollm2-135m", prompt=PROMPT, max_tokens=24, temperature=0
    )
    assert response.choices[0].text.startswith(" 5, 6, 7, 8")
    metrics = read_metrics(server.base_url)
    drafts = metrics["vllm:spec_decode_num_drafts_total"]
    draft_tokens = metrics["vllm:spec_decode_num_draft_tokens_total"]
    accepted = metrics["vllm:spec_decode_num_accepted_tokens_total"]
    per_position = [
        metrics[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}']
        for i in range(4)
    ]
    assert 0 < drafts <= draft_tokens <= 4 * drafts
    assert 0 < accepted <= draft_tokens
    assert sum(per_position) == accepted
    assert per_position == sorted(per_position, reverse=True)  # position i needs i - 1
    # Accepted drafts are tokens the request produced beyond one per verification step.
    assert response.usage.completion_tokens >= accepted


@pytest.mark.parametrize(
    ("config", "complaint"),
    [
        # Refused while reading the flags, before any model loads.
        ({"method": "draft_model"}, "speculative_config.model is required"),
        # Refused at start-up: tiny-random's 512 token ids are not SmolLM2's 49152.
        ({"model": "builtin://tiny-random"}, "speculative_config.model: the draft tiny-random"),
    ],
)
def test_a_draft_model_the_server_cannot_use_stops_it_with_the_field_named(config, complaint):
    result = subprocess.run(
        [sys.executable, "-m", "pagefleet_serve.cli", "serve", "--max-model-len", "512"]
        + ["--speculative-config", json.dumps(config)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert complaint in result.stderr + result.stdout, result.stderr
