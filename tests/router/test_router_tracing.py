"""Router traces: the router and a real serving pod both export to one OTLP/HTTP receiver
on loopback; a request with a client `traceparent` yields the router's span (the client's
child) and the pod's `llm_request` span (the router span's child), in one trace."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
import pytest_asyncio
from aiohttp import web
from pagefleet_operator.tracing import get_tracer
from pagefleet_router.discovery import ScrapeSettings, StaticEndpoints
from pagefleet_router.proxy import Router, RouterSettings
from pagefleet_router.tracing import RequestTracing

from tests.server.otlp_receiver import SPAN_KIND_SERVER, OTLPReceiver, attributes
from tests.server.server_harness import ThreadServer, wait_until

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def receiver_and_pod():
    receiver = OTLPReceiver()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # export within 50 ms, not 5 s
        pod = ThreadServer({"otlp_traces_endpoint": receiver.url}, dtype="float32")
    try:
        yield receiver, pod
    finally:
        pod.stop()
        receiver.shutdown()


@pytest_asyncio.fixture
async def router_url(receiver_and_pod, monkeypatch):
    receiver, pod = receiver_and_pod
    receiver.spans.clear()
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    tracing = RequestTracing(get_tracer(receiver.url, "pagefleet-router"))
    settings = RouterSettings(scrape=ScrapeSettings(interval_s=0.2))
    router = Router(settings, StaticEndpoints((pod.base_url,)), tracing=tracing)
    runner = web.AppRunner(router.create_app(), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


@pytest.mark.asyncio
async def test_a_trace_runs_client_to_router_to_the_pods_engine_span(receiver_and_pod, router_url):
    receiver, pod = receiver_and_pod
    async with httpx.AsyncClient(timeout=120) as client:
        response = await client.post(
            f"{router_url}/v1/completions",
            json={"model": pod.state.settings.model_name, "prompt": "Hello", "max_tokens": 3},
            headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"},
        )
    assert response.status_code == 200, response.text

    def both_spans():
        names = {span.name: span for span in receiver.spans}
        return names if {"router_request", "llm_request"} <= names.keys() else None

    spans = wait_until(both_spans, 10, "the router's and the pod's spans")
    router_span, pod_span = spans["router_request"], spans["llm_request"]
    assert len(receiver.spans) == 2
    assert router_span.kind == SPAN_KIND_SERVER
    assert (router_span.trace_id.hex(), router_span.parent_span_id.hex()) == (
        TRACE_ID,
        CLIENT_SPAN_ID,
    )
    # The pod's span hangs under the router's, not under the client's.
    assert (pod_span.trace_id.hex(), pod_span.parent_span_id) == (TRACE_ID, router_span.span_id)
    found = attributes(router_span)
    assert found["pagefleet.router.pod"] == pod.base_url
    assert found["pagefleet.router.reason"] in ("hash", "load", "prefix", "bounded")
    assert found["pagefleet.router.attempt"] == 0
    assert found["http.response.status_code"] == 200
    assert found["url.path"] == "/v1/completions"
    assert router_span.start_time_unix_nano <= pod_span.start_time_unix_nano


def test_tracing_off_loads_no_opentelemetry_sdk_in_the_router():
    code = (
        "import sys\n"
        "from pagefleet_router.cli import get_parser\n"
        "from pagefleet_router import proxy\n"
        "args = get_parser().parse_args(['--endpoints', 'http://a:8000'])\n"
        "assert args.otlp_traces_endpoint is None\n"
        "bad = [m for m in sys.modules if m.startswith('opentelemetry')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
