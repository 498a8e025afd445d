"""Operator robustness against hostile or odd input (issue 11): every byte size the CRD
admits runs in the pod, bad specs become Degraded instead of endless retries, no path
escapes its claim, and a serving pod cannot harm the operator through /metrics."""

from __future__ import annotations

import http.server
import itertools
import re
import threading
import time

import pytest
from pagefleet_operator import metrics
from pagefleet_operator import reconcile as reconcile_module
from pagefleet_operator.metrics import fetch_metrics, scrape_pods
from pagefleet_operator.pod import get_volumes
from pagefleet_operator.spec import SpecError, parse_spec
from pagefleet_serve.config import BYTE_SIZE_PATTERN, parse_bytes

from tests.operator.operator_samples import DEFAULT_IMAGE, make_body
from tests.operator.test_operator_crd import SCHEMA, admit, resource
from tests.operator.test_operator_metrics import BODY
from tests.operator.test_operator_reconcile import BUILTIN, FakeKube, condition, run

CRD_BYTE_SIZE_PATTERN = SCHEMA["properties"]["spec"]["properties"]["engine"]["properties"][
    "kvCacheMemory"
]["pattern"]


def test_one_byte_size_grammar():
    # The operator checks spec.engine.kvCacheMemory with the engine's own pattern.
    assert CRD_BYTE_SIZE_PATTERN == BYTE_SIZE_PATTERN


def admitted_units() -> list[str]:
    """Every unit suffix the CRD pattern admits, found by trying all short suffixes."""
    letters = "KMGTPEkmgtpeiIbB"
    suffixes = [""] + ["".join(p) for n in (1, 2, 3) for p in itertools.product(letters, repeat=n)]
    return [s for s in suffixes if re.match(CRD_BYTE_SIZE_PATTERN, f"2{s}")]


@pytest.mark.parametrize("number", ["2", "1.5", "0"])
def test_every_unit_the_crd_admits_parses_in_the_pod(number):
    units = admitted_units()
    assert {"TB", "TiB", "GiB", "KB", ""} <= set(units)
    for unit in units:
        text = f"{number}{unit}"
        spec = {**BUILTIN, "engine": {"kvCacheMemory": text}}
        assert admit(resource(spec))[1] == []
        parse_spec(spec, default_image=DEFAULT_IMAGE)
        assert parse_bytes(text) == int(float(number) * (parse_bytes(f"1{unit}")))
    assert parse_bytes("1TB") == 10**12 and parse_bytes("1TiB") == 2**40


@pytest.mark.parametrize("text", ["1PB", "2g", "1 TB B", "-1GiB", "GiB"])
def test_sizes_the_crd_refuses_the_pod_refuses_too(text):
    assert admit(resource({**BUILTIN, "engine": {"kvCacheMemory": text}}))[1]
    with pytest.raises(ValueError, match="size in bytes"):
        parse_bytes(text)


@pytest.mark.parametrize("entry", ["gpu", 5, ["key", "gpu"]])
def test_a_malformed_toleration_is_degraded_not_retried(entry):
    kube = FakeKube(make_body({**BUILTIN, "tolerations": [{"key": "a"}, entry]}))
    outcome = run(kube)  # returns: kopf does not retry
    degraded = condition(kube, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "InvalidSpec")
    assert "spec.tolerations[1]" in degraded["message"]
    assert outcome.changes == ()


def test_any_builder_failure_is_degraded_with_its_message(monkeypatch):
    def broken_builder(body, spec):
        raise KeyError("limits")

    monkeypatch.setattr(reconcile_module, "get_desired_objects", broken_builder)
    kube = FakeKube(make_body(BUILTIN))
    run(kube)
    degraded = condition(kube, "Degraded")
    assert degraded["reason"] == "InvalidSpec" and "KeyError('limits')" in degraded["message"]


@pytest.mark.parametrize(
    "uri", ["pvc://claim/../../etc", "pvc://claim/models/..", "pvc://claim/a/../../b"]
)
def test_pvc_paths_cannot_climb_out_of_the_claim(uri):
    spec = {"model": {"uri": uri}}
    _, errors = admit(resource(spec))
    assert any("'..'" in e for e in errors), errors
    with pytest.raises(SpecError, match=r"'\.\.'"):
        parse_spec(spec, default_image=DEFAULT_IMAGE)


@pytest.mark.parametrize(
    "uri",
    [
        "pvc://claim/llama..v3/model.gguf",
        "pvc://claim/llama../model.gguf",  # `..` ends a name, not a segment
        "pvc://claim/..cache/model.gguf",  # `..` starts one
        "pvc://claim/models/llama..",
    ],
)
def test_pvc_paths_with_dots_in_names_are_fine(uri):
    spec = {"model": {"uri": uri}}
    assert admit(resource(spec))[1] == []
    parse_spec(spec, default_image=DEFAULT_IMAGE)


def test_tmp_has_a_size_limit():
    volumes, _ = get_volumes("demo", parse_spec(BUILTIN, default_image=DEFAULT_IMAGE))
    tmp = next(v for v in volumes if v["name"] == "tmp")
    assert tmp["emptyDir"]["sizeLimit"]


class HostilePod:
    """A serving pod whose image misbehaves: it answers /metrics with `handler`."""

    def __init__(self, handler):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # http.server's name
                handler(self)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.port}/metrics"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hostile():
    pods = []

    def start(handler) -> HostilePod:
        pods.append(HostilePod(handler))
        return pods[-1]

    yield start
    for pod in pods:
        pod.close()


def _answer(request, body: bytes, status: int = 200, **headers):
    request.send_response(status)
    for key, value in headers.items():
        request.send_header(key, value)
    request.end_headers()
    request.wfile.write(body)


def test_scrape_refuses_a_huge_answer(hostile):
    def endless(request):
        request.send_response(200)
        request.end_headers()
        chunk = b"# padding\n" * 10000
        try:
            for _ in range(1000):  # 100 MB unless the reader stops
                request.wfile.write(chunk)
        except OSError:
            pass

    pod = hostile(endless)
    with pytest.raises(metrics.MetricsError, match="exceeds"):
        fetch_metrics(pod.url)


def test_scrape_refuses_redirects(hostile):
    target = hostile(lambda r: _answer(r, BODY.encode()))
    pod = hostile(lambda r: _answer(r, b"", 302, Location=target.url))
    with pytest.raises(OSError, match="redirect"):
        fetch_metrics(pod.url)


def test_scrape_gives_up_on_a_slow_drip(hostile):
    """The whole answer takes 4.5 s (9 lines, 0.5 s apart): the scrape must give up while
    the pod is still dripping, judged by the pod's progress rather than by a clock that a
    loaded machine slows."""
    lines = BODY.encode().splitlines(keepends=True)
    assert len(lines) * 0.5 >= 4 * 1.0  # the drip outlasts the timeout several times over
    sent_all = threading.Event()

    def drip(request):
        request.send_response(200)
        request.end_headers()
        try:
            for line in lines:
                request.wfile.write(line)
                request.wfile.flush()
                time.sleep(0.5)
        except OSError:
            return
        sent_all.set()

    pod = hostile(drip)
    with pytest.raises(metrics.MetricsError, match="longer than"):
        fetch_metrics(pod.url, timeout=1.0)
    assert not sent_all.is_set(), "the scrape waited for the whole answer"


def test_a_hostile_pod_is_unscraped_not_fatal(hostile):
    pod = hostile(lambda r: _answer(r, b"", 302, Location="http://169.254.169.254/"))
    manifest = {
        "metadata": {"name": "evil"},
        "spec": {"containers": [{"ports": [{"name": "http", "containerPort": pod.port}]}]},
        "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    (sample,) = scrape_pods([manifest])
    assert sample.ready and not sample.scraped


ALLOWED = ("registry.example.com/ml/",)


@pytest.mark.parametrize(
    ("image", "allowed"),
    [
        (None, True),  # the operator's default image
        ("registry.example.com/ml/pagefleet:1", True),
        ("registry.example.com/mlx/evil:1", False),
        ("docker.io/evil/miner:latest", False),
    ],
)
def test_images_can_be_restricted_to_allowed_prefixes(image, allowed):
    spec = {**BUILTIN, "engine": {"image": image} if image else {}}
    kube = FakeKube(make_body(spec))
    reconcile_module.reconcile(
        kube,
        kube.body(),
        default_image=DEFAULT_IMAGE,
        allowed_image_prefixes=ALLOWED,
        now=lambda: "T",
    )
    degraded = condition(kube, "Degraded")
    if allowed:
        assert degraded["status"] == "False"
        assert kube.get("Deployment", "ml", "demo") is not None
    else:
        assert degraded["status"] == "True" and "spec.engine.image" in degraded["message"]
        assert kube.get("Deployment", "ml", "demo") is None
