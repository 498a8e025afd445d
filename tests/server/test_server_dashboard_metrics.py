"""The Grafana dashboard against what PageFleet really exports: every metric name in every
panel query and variable exists on a real serving pod's /metrics (after some traffic) or
on the operator's /metrics, and every pod series has a sample (at 0) from the pod's start,
before any request, so that no panel reads "No data"; and the JSON is a well-formed
Grafana dashboard model."""

from __future__ import annotations

import json
import re
import socket
import urllib.request
from pathlib import Path

import httpx
import pytest
from pagefleet_operator.autoscale import PodSample, decide
from pagefleet_operator.plan import Plan
from pagefleet_operator.reconcile import Outcome
from pagefleet_operator.spec import AutoscalingSpec
from pagefleet_operator.telemetry import OperatorMetrics
from prometheus_client.parser import text_string_to_metric_families

from tests.server.server_harness import ServerProcess

DASHBOARD = Path(__file__).resolve().parents[2] / "charts/pagefleet/dashboards/pagefleet.json"
_IDENTIFIER = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\()?")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (a small parser for the subset the
    dashboard uses: functions, aggregations with by/without, matchers, ranges, numbers)."""
    if match := re.fullmatch(r"\s*label_values\((.*),\s*[a-zA-Z_]\w*\)\s*", expr):
        expr = match[1]  # label_values(selector, label): only the selector names a metric
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values may hold anything
    expr = re.sub(r"\{[^}]*\}", " ", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", " ", expr)  # range durations
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", " ", expr)  # grouping labels
    expr = re.sub(r"\b\d+(\.\d+)?\b", " ", expr)
    return {
        name
        for name, call in _IDENTIFIER.findall(expr)
        if not call and name not in _KEYWORDS  # a name followed by "(" is a function
    }


def test_the_parser_finds_selectors_and_skips_functions_and_labels():
    expr = (
        'histogram_quantile(0.9, sum by (le, model_name) (rate(vllm:x_bucket{pod=~"a|b"}'
        "[$__rate_interval]))) / on (pod) time() - vllm:y + max without (le) (z_total)"
    )
    assert metric_names(expr) == {"vllm:x_bucket", "vllm:y", "z_total"}
    assert metric_names('label_values(vllm:w{ns=~"$ns"}, model_name)') == {"vllm:w"}


def dashboard_queries(dashboard: dict) -> list[str]:
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            queries.append(query["query"] if isinstance(query, dict) else query)
    return queries


_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def series_names(text: str) -> set[str]:
    """The series names /metrics exports or declares: a labelled counter that has not
    counted yet (no rejection so far) has HELP and TYPE lines but no sample."""
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {sample.name for sample in family.samples}
        names |= {family.name + suffix for suffix in _SUFFIXES.get(family.type, ())}
    return names


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(default_pod):
    """The session's default pod (served name "smol")."""
    return default_pod


def operator_metrics_text() -> str:
    """The operator's /metrics over HTTP after a reconcile, an API error and a round of
    autoscaling, recorded by the same calls the kopf handlers make."""
    metrics = OperatorMetrics()
    port = free_port()
    metrics.serve(port, "127.0.0.1")
    metrics.record_reconcile("ml", "chat", Outcome(Plan(), (), None, False, True, None, 1, 1))
    metrics.record_reconcile_error("Deployment")
    decision = decide(1, [PodSample("a", True, 0.5, 3)], AutoscalingSpec(enabled=True), [], 1e9)
    metrics.record_autoscale("ml", "chat", decision, 1e9)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def test_every_dashboard_metric_is_exported(server):
    prompt = "The capital of France is a city called"
    for _ in range(2):  # the second one hits the prefix cache
        response = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"model": "smol", "prompt": prompt, "max_tokens": 4},
            timeout=120,
        )
        assert response.status_code == 200, response.text
    pod = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    exported = series_names(pod) | series_names(operator_metrics_text())

    queries = dashboard_queries(json.loads(DASHBOARD.read_text()))
    used = set().union(*(metric_names(q) for q in queries))
    assert len(used) >= 25  # the parser found the dashboard's selectors
    missing = {name: [q for q in queries if name in metric_names(q)] for name in used - exported}
    assert missing == {}, "dashboard queries name metrics nobody exports"


def test_every_pod_series_of_the_dashboard_has_a_sample_from_the_pod_s_start():
    pod = ServerProcess("--max-model-len", "256", "--kv-cache-memory", "32MiB")
    try:
        text = httpx.get(f"{pod.wait_ready().base_url}/metrics", timeout=10).text
    finally:
        pod.stop()
    sampled = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    queries = dashboard_queries(json.loads(DASHBOARD.read_text()))
    used = set().union(*(metric_names(q) for q in queries))
    pod_series = {name for name in used if not name.startswith("pagefleet_operator_")}
    assert {"pagefleet:requests_rejected_total", "vllm:time_to_first_token_seconds_bucket"} <= (
        pod_series
    )
    assert pod_series - sampled == set(), "series without a sample before any request"


def test_the_dashboard_is_a_grafana_dashboard_model():
    dashboard = json.loads(DASHBOARD.read_text())
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] and dashboard["title"]
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"

    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    datasource = variables["datasource"]
    assert (datasource["type"], datasource["query"]) == ("datasource", "prometheus")
    for name, variable in variables.items():
        if variable["type"] == "query":
            assert variable["datasource"]["uid"] == "${datasource}", name

    text = json.dumps(panels)
    used = set(re.findall(r"\$(\w+)", text)) - {"__rate_interval"}
    assert used <= set(variables), used - set(variables)

    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert ref_ids and len(ref_ids) == len(set(ref_ids)), panel["title"]
        assert all(t["expr"].strip() for t in panel["targets"]), panel["title"]
    # Panels do not overlap on the grid.
    cells = set()
    for panel in panels:
        grid = panel["gridPos"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, panel["title"]
                cells.add((x, y))
