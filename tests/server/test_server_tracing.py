"""Request traces: a real server with --otlp-traces-endpoint pointing at an OTLP/HTTP
receiver on loopback (decoding the real protobuf export), one request with a
`traceparent`, and the span that arrives: vLLM's name and attributes, our parent."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.server.otlp_receiver import SPAN_KIND_SERVER, OTLPReceiver, attributes
from tests.server.server_harness import ThreadServer, wait_until

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def traced_server():
    receiver = OTLPReceiver()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # export within 50 ms, not 5 s
        server = ThreadServer({"otlp_traces_endpoint": receiver.url}, dtype="float32")
    try:
        yield server, receiver
    finally:
        server.stop()
        receiver.shutdown()


@pytest.fixture
def traced(traced_server):
    """The shared server, with no span left over from another test (in any order)."""
    server, receiver = traced_server
    receiver.spans.clear()
    return server, receiver


def test_one_span_per_request_with_vllms_attributes_and_our_parent(traced):
    server, receiver = traced
    httpx.get(f"{server.base_url}/metrics", timeout=10)  # not traced
    response = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": server.state.settings.model_name, "prompt": "Hello", "max_tokens": 5},
        headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    (span,) = wait_until(lambda: list(receiver.spans), 10, "the span to be exported")
    assert span.name == "llm_request"
    assert span.kind == SPAN_KIND_SERVER
    assert (span.trace_id.hex(), span.parent_span_id.hex()) == (TRACE_ID, PARENT_ID)

    found = attributes(span)
    assert found["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert found["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] == 5
    assert found["gen_ai.response.model"] == server.state.settings.model_name
    assert found["gen_ai.request.id"]
    phases = ("time_in_queue", "time_in_model_prefill", "time_in_model_decode")
    for name in (*phases, "time_to_first_token", "time_in_model_inference", "e2e"):
        assert found[f"gen_ai.latency.{name}"] >= 0, name
    assert found["gen_ai.latency.time_to_first_token"] <= found["gen_ai.latency.e2e"]
    total = sum(found[f"gen_ai.latency.{name}"] for name in phases)
    assert total == pytest.approx(found["gen_ai.latency.e2e"], abs=1e-6)
    # The span covers the HTTP request, so it holds the engine's e2e time.
    duration = (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9
    assert duration >= found["gen_ai.latency.e2e"] - 1e-3


def test_without_traceparent_the_span_is_a_root(traced):
    server, receiver = traced
    response = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={
            "model": server.state.settings.model_name,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2,
        },
        timeout=120,
    )
    assert response.status_code == 200, response.text
    (span,) = wait_until(lambda: list(receiver.spans), 10, "the span to be exported")
    assert span.parent_span_id == b"" and span.trace_id.hex() != TRACE_ID


def test_a_responses_request_is_traced_with_its_usage(traced):
    server, receiver = traced
    response = httpx.post(
        f"{server.base_url}/v1/responses",
        json={"input": "Hi", "max_output_tokens": 3},
        headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    (span,) = wait_until(lambda: list(receiver.spans), 10, "the span to be exported")
    assert (span.name, span.trace_id.hex()) == ("llm_request", TRACE_ID)
    found = attributes(span)
    assert found["gen_ai.usage.prompt_tokens"] == usage["input_tokens"]
    assert found["gen_ai.usage.completion_tokens"] == usage["output_tokens"] == 3


def test_tracing_off_loads_no_opentelemetry_sdk():
    # FastAPI itself imports the opentelemetry API; the SDK and exporter cost the import
    # time and the background thread, and stay out unless tracing is on.
    code = (
        "import sys; import pagefleet_serve.server.app, pagefleet_serve.server.metrics; "
        "print(sorted(m for m in sys.modules "
        "if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter'))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "[]"
