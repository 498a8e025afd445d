"""`pagefleet router` in front of two real `pagefleet serve` processes on loopback: SSE
streamed through with the openai SDK, Authorization forwarded, a client disconnect
reaching the pod, a prefix kept on one pod (the pods' own prefix-cache counters), a
/v1/responses conversation kept on the pod whose store holds it (the SDK's create, stream,
retrieve and delete), a pod failing before its first byte (retried) and after it (an
error event).

A pod "fails" by cutting a loopback TCP relay the router knows that pod by: the bytes are
the real pod's, and the pod process lives on for the other tests."""

from __future__ import annotations

import contextlib
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from pagefleet_router.policy import rendezvous_order
from pagefleet_router.prefix import block_hashes, prompt_text

from tests.server.server_harness import (
    ServerProcess,
    free_port,
    read_metrics,
    sse_events,
    wait_until,
)

API_KEY = "router-test-key"
POD_FLAGS = ("--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory", "128MiB")
BLOCK_CHARS = 64
MODEL = "smollm2-135m"  # the name the pods serve the built-in model under


@pytest.fixture(scope="module")
def pods():
    started = [ServerProcess(*POD_FLAGS, "--api-key", API_KEY) for _ in range(2)]
    try:
        yield [p.wait_ready() for p in started]
    finally:
        for process in started:
            process.stop()


class RouterProcess:
    """`python -m pagefleet_router` (the operator image's entry point) on a free port."""

    def __init__(self, endpoints: list[str], *flags: str) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkstemp(prefix="pagefleet-router-", suffix=".log")[1])
        command = [sys.executable, "-m", "pagefleet_router", "--port", str(self.port)]
        command += ["--endpoints", *endpoints, "--block-chars", str(BLOCK_CHARS), *flags]
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

        def ready() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"router exited:\n{self.log.read_text()}")
            try:
                return httpx.get(f"{self.base_url}/ready", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(ready, 30, "the router to become ready", interval=0.1)

    def metrics(self) -> dict[str, float]:
        return read_metrics(self.base_url)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)
        self.log.unlink(missing_ok=True)


@pytest.fixture
def start_router():
    started = []

    def start(endpoints: list[str], *flags: str) -> RouterProcess:
        started.append(RouterProcess(endpoints, *flags))
        return started[-1]

    yield start
    for router in started:
        router.stop()


class TcpRelay:
    """Relays loopback TCP connections to a pod; `cut()` is that pod failing as the router
    sees it: open connections reset, new ones refused."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # cut
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self.sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        # shutdown wakes the thread blocked in accept (close alone would leave it listening)
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for sock in self.sockets:
            # linger 0: a reset rather than a clean close, as when a pod's node goes away;
            # shutdown wakes the pump threads blocked in recv
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def home_of(prompt: str, urls: list[str]) -> str:
    """The pod the router's consistent hashing picks for a prompt nobody served yet."""
    text = prompt_text("/v1/completions", {"model": MODEL, "prompt": prompt})
    return rendezvous_order(block_hashes(text, BLOCK_CHARS, 64)[0], urls)[0]


def prompt_homed_on(url: str, urls: list[str]) -> str:
    for i in range(100):
        prompt = f"Story {i}: once upon a time, in a land far away, there lived a careful engineer"
        if home_of(prompt, urls) == url:
            return prompt
    raise AssertionError(f"no prompt hashes to {url}")


def completion(prompt: str, max_tokens: int, stream: bool = False) -> dict:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def test_streams_pass_through_chunk_by_chunk_with_the_openai_sdk(pods, start_router):
    router = start_router([p.base_url for p in pods])
    client = openai.OpenAI(base_url=f"{router.base_url}/v1", api_key=API_KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]

    direct = openai.OpenAI(base_url=f"{pods[0].base_url}/v1", api_key=API_KEY, max_retries=0)
    messages = [{"role": "user", "content": "Name three colours."}]
    expected = direct.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0
    )
    started = time.monotonic()
    arrivals, text = [], ""
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True
    )
    for chunk in stream:
        arrivals.append(time.monotonic() - started)
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    assert text == expected.choices[0].message.content
    # relayed as generated, not buffered to the end
    assert len(arrivals) > 3 and arrivals[0] < arrivals[-1] / 2, arrivals

    with pytest.raises(openai.AuthenticationError):  # the pod's 401, through the router
        openai.OpenAI(
            base_url=f"{router.base_url}/v1", api_key="wrong", max_retries=0
        ).completions.create(model=MODEL, prompt="hi", max_tokens=1)
    decisions = router.metrics()
    assert (
        sum(v for k, v in decisions.items() if k.startswith("pagefleet:router_requests_total")) == 3
    )


def test_a_client_disconnect_frees_the_pods_kv_blocks(pods, start_router):
    router = start_router([p.base_url for p in pods])

    def used_blocks() -> list[float]:
        return [read_metrics(p.base_url)["pagefleet:kv_cache_used_blocks"] for p in pods]

    with httpx.Client(base_url=router.base_url, timeout=60, headers=auth()) as client:
        body = completion("Once upon a time", max_tokens=900, stream=True)
        with client.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            assert sum(used_blocks()) > 0
    wait_until(lambda: sum(used_blocks()) == 0, 20, "the pod to free the stream's blocks")
    running = [read_metrics(p.base_url)["vllm:num_requests_running"] for p in pods]
    assert running == [0, 0]


def test_requests_sharing_a_prefix_land_on_one_pod(pods, start_router):
    router = start_router([p.base_url for p in pods])
    shared = (
        "You are a support assistant for a bicycle shop. Be brief and friendly. Our opening "
        "hours are nine to six on weekdays and ten to four on Saturdays; we repair every "
        "brand, sell parts for road, gravel and city bikes, and offer a free check-up within "
        "a month of any purchase. Customer question: "
    )
    questions = ["Are you open on Sunday?", "Do you fix e-bikes?", "How much is a tune-up?"]

    def hits() -> list[float]:
        return [read_metrics(p.base_url)["vllm:prefix_cache_hits_total"] for p in pods]

    before = hits()
    with httpx.Client(base_url=router.base_url, timeout=60, headers=auth()) as client:
        for question in [*questions, *questions]:
            response = client.post("/v1/completions", json=completion(shared + question, 1))
            assert response.status_code == 200, response.text
    gained = [after - b for after, b in zip(hits(), before, strict=True)]
    metrics = router.metrics()
    per_pod = [
        metrics.get(f'pagefleet:router_requests_total{{code="200",pod="{p.base_url}"}}', 0)
        for p in pods
    ]
    assert sorted(per_pod) == [0, 6]
    home = per_pod.index(6)
    # five later requests each found the shared prefix (~60 tokens) in that pod's cache
    assert gained[home] >= 5 * 48 and gained[1 - home] == 0, gained
    assert metrics['pagefleet:router_routing_decisions_total{reason="prefix"}'] == 5


def test_a_responses_conversation_stays_on_the_pod_that_stores_it_with_the_openai_sdk(
    pods, start_router
):
    urls = [p.base_url for p in pods]
    router = start_router(urls)
    client = openai.OpenAI(base_url=f"{router.base_url}/v1", api_key=API_KEY, max_retries=0)

    def homed_on(url: str, topic: str) -> str:
        """An input the prefix policy alone would send to `url`."""
        for i in range(200):
            text = f"Question {i}: tell me one short fact about {topic}, please. " * 2
            body = {"model": MODEL, "input": text}
            hashes = block_hashes(prompt_text("/v1/responses", body), BLOCK_CHARS, 64)
            if rendezvous_order(hashes[0], urls)[0] == url:
                return text
        raise AssertionError(f"no input hashes to {url}")

    turn = {"model": MODEL, "max_output_tokens": 4, "temperature": 0}
    first = client.responses.create(input=homed_on(urls[0], "tides"), **turn)
    # The later turns are homed on the other pod, whose store does not hold the first.
    with client.responses.stream(
        input=homed_on(urls[1], "waves"), previous_response_id=first.id, **turn
    ) as stream:
        second = list(stream)[-1].response
    third = client.responses.create(
        input=homed_on(urls[1], "storms"), previous_response_id=second.id, **turn
    )
    # Each turn's prompt holds the ones before it.
    assert third.usage.input_tokens > second.usage.input_tokens > first.usage.input_tokens
    assert client.responses.retrieve(third.id).output_text == third.output_text
    client.responses.delete(first.id)
    metrics = router.metrics()
    per_pod = [
        metrics.get(f'pagefleet:router_requests_total{{code="200",pod="{url}"}}', 0) for url in urls
    ]
    assert per_pod == [5, 0]
    assert metrics['pagefleet:router_routing_decisions_total{reason="response"}'] == 4
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_a_pod_failing_before_its_first_byte_is_retried_and_after_it_ends_the_stream(
    pods, start_router
):
    relay = TcpRelay(pods[1].port)
    urls = [pods[0].base_url, relay.url]
    # one scrape, at start: the relayed pod keeps its fresh metrics after it fails
    router = start_router(urls, "--scrape-interval", "60", "--metrics-max-age", "120")
    prompt = prompt_homed_on(relay.url, urls)
    with httpx.Client(base_url=router.base_url, timeout=60, headers=auth()) as client:
        with client.stream("POST", "/v1/completions", json=completion(prompt, 400, True)) as s:
            lines = s.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            relay.cut()
            events = sse_events([first, *lines])
        assert events[-1] == "DONE"
        assert events[-2]["error"]["code"] == "upstream_failed"
        assert len(events) < 100  # cut short
        wait_until(
            lambda: read_metrics(pods[1].base_url)["pagefleet:kv_cache_used_blocks"] == 0,
            20,
            "the cut-off pod to free the stream's blocks",
        )

        retried = client.post(
            "/v1/completions", json=completion(prompt_homed_on(relay.url, urls), 4)
        )
    assert retried.status_code == 200, retried.text
    assert retried.json()["usage"]["completion_tokens"] == 4
    metrics = router.metrics()
    assert metrics["pagefleet:router_retries_total"] == 1
    assert metrics["pagefleet:router_upstream_errors_after_first_byte_total"] == 1
    assert metrics[f'pagefleet:router_requests_total{{code="200",pod="{pods[0].base_url}"}}'] == 1
