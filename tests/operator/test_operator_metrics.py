"""Scraping real HTTP servers on loopback that serve Prometheus text."""

from __future__ import annotations

import http.server
import threading

import pytest
from pagefleet_operator.metrics import (
    MetricsError,
    get_metrics_url,
    is_pod_ready,
    parse_held_requests,
    parse_metrics,
    scrape_held_requests,
    scrape_pods,
)

BODY = """# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.5
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 3.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 7.0
"""


class MetricsServer:
    """A real HTTP server on 127.0.0.1 standing in for a serving pod's /metrics."""

    def __init__(self, text: str, status: int = 200):
        outer = self
        self.text, self.status = text, status

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # http.server's name
                payload = outer.text.encode()
                self.send_response(outer.status if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def servers():
    started = []

    def start(text: str, status: int = 200) -> MetricsServer:
        started.append(MetricsServer(text, status))
        return started[-1]

    yield start
    for server in started:
        server.close()


def pod(name: str, port: int, ready: bool = True, ip: str = "127.0.0.1") -> dict:
    return {
        "metadata": {"name": name},
        "spec": {"containers": [{"ports": [{"name": "http", "containerPort": port}]}]},
        "status": {
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_parse_reads_both_gauges():
    assert parse_metrics(BODY) == (0.5, 3.0)


def test_parse_sums_waiting_and_takes_the_busiest_cache_across_models():
    text = (
        'vllm:kv_cache_usage_perc{model_name="a"} 0.2\n'
        'vllm:kv_cache_usage_perc{model_name="b"} 0.7\n'
        'vllm:num_requests_waiting{model_name="a"} 1\n'
        'vllm:num_requests_waiting{model_name="b"} 4\n'
    )
    assert parse_metrics(text) == (0.7, 5.0)


@pytest.mark.parametrize(
    "text",
    ["", 'vllm:num_requests_waiting{model_name="m"} 3\n', "<html>not metrics</html>\n"],
)
def test_parse_rejects_incomplete_or_garbage(text):
    with pytest.raises((MetricsError, ValueError)):
        parse_metrics(text)


def test_metrics_url_uses_the_named_port_and_brackets_ipv6():
    assert get_metrics_url(pod("a", 8000, ip="10.0.0.5")) == "http://10.0.0.5:8000/metrics"
    assert get_metrics_url(pod("a", 8000, ip="fd00::5")) == "http://[fd00::5]:8000/metrics"


def test_readiness_of_pods():
    assert is_pod_ready(pod("a", 1))
    assert not is_pod_ready(pod("a", 1, ready=False))
    terminating = pod("a", 1)
    terminating["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    assert not is_pod_ready(terminating)


def test_scrape_real_servers(servers):
    busy = servers(BODY.replace("0.5", "0.9"))
    idle = servers(BODY.replace(" 3.0", " 0"))
    broken = servers("oops", status=500)
    garbage = servers("not prometheus at all {{{\n")
    samples = scrape_pods(
        [
            pod("busy", busy.port),
            pod("idle", idle.port),
            pod("broken", broken.port),
            pod("garbage", garbage.port),
            pod("starting", idle.port, ready=False),
            pod("gone", 1),  # nothing listens on port 1
        ]
    )
    by_name = {s.pod: s for s in samples}
    assert (by_name["busy"].kv_cache_usage, by_name["busy"].num_requests_waiting) == (0.9, 3.0)
    assert (by_name["idle"].kv_cache_usage, by_name["idle"].num_requests_waiting) == (0.5, 0.0)
    for name in ("broken", "garbage", "gone"):
        assert by_name[name].ready and not by_name[name].scraped
    assert not by_name["starting"].ready


def test_held_requests_summed_over_the_real_routers_metrics(servers):
    """The gauge is read from what the router itself renders; each router pod holds
    its own requests; a router that cannot be read, or is not ready, counts none."""
    from pagefleet_router.metrics import RouterMetrics

    rendered = []
    for held in (5, 2):
        metrics = RouterMetrics()
        metrics.held.set(held)
        rendered.append(servers(metrics.render().decode()))
    assert parse_held_requests(RouterMetrics().render().decode()) == 0
    with pytest.raises(MetricsError, match="pagefleet:router_held_requests"):
        parse_held_requests(BODY)  # a serving pod's /metrics
    routers = [
        pod("r0", rendered[0].port),
        pod("r1", rendered[1].port),
        pod("starting", rendered[0].port, ready=False),
        pod("gone", 1),
    ]
    assert scrape_held_requests(routers) == 7
    assert scrape_held_requests([]) == 0
