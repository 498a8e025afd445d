"""A new user's walk, as steps both end-to-end runs share: stream a chat completion with
the `openai` SDK, load the service with concurrent streams until the autoscaler adds a
replica, then keep streams in flight while it scales back down and check none was cut.

Every step is synchronous and talks HTTP to `base_url` only, so the real-cluster run
(through `kubectl port-forward`) and the local run (through the least-connections forwarder
in e2e/kubelet_sim.py) drive exactly the same code.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml
from openai import OpenAI

REPO = Path(__file__).resolve().parents[1]
CPU_EXAMPLE = REPO / "examples" / "smollm2-cpu.yaml"
PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]


def load_cpu_example() -> dict:
    """examples/smollm2-cpu.yaml, with autoscaling switched on and its windows made short.

    maxNumSeqs 2 makes a handful of concurrent streams queue up, so the queue-depth
    signal crosses its target quickly on any machine.
    """
    resource = yaml.safe_load(CPU_EXAMPLE.read_text())
    resource["spec"]["engine"]["maxNumSeqs"] = 2
    # Streams still running at SIGTERM may take this long to finish (the drain).
    resource["spec"]["engine"]["shutdownTimeoutSeconds"] = 120
    resource["spec"]["autoscaling"] = {
        "enabled": True,
        "minReplicas": 1,
        "maxReplicas": 2,
        "targetQueueDepth": 2,
        "intervalSeconds": 5,
        "scaleDownStabilizationSeconds": 20,
    }
    return resource


@dataclass
class StreamResult:
    text: str = ""
    chunks: int = 0
    finish_reason: str | None = None
    error: str | None = None
    seconds: float = 0.0
    first_token_seconds: float | None = None  # from the request to its first content


def stream_chat(
    base_url: str, model: str, max_tokens: int = 32, ignore_eos: bool = False
) -> StreamResult:
    """One streamed chat completion; transport and API errors are returned, not raised,
    so a load thread records them and the test reports every one. `ignore_eos` (a vLLM
    extension the server has) makes every stream exactly `max_tokens` long."""
    result = StreamResult()
    started = time.monotonic()
    # A client (and so a connection) per stream: the Service balances connections.
    with OpenAI(base_url=f"{base_url}/v1", api_key="e2e", max_retries=0, timeout=300) as client:
        try:
            stream = client.chat.completions.create(
                model=model,
                messages=PROMPT,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True} if ignore_eos else None,
            )
            for chunk in stream:
                for choice in chunk.choices:
                    if choice.delta.content:
                        if result.first_token_seconds is None:
                            result.first_token_seconds = time.monotonic() - started
                        result.text += choice.delta.content
                        result.chunks += 1
                    if choice.finish_reason:
                        result.finish_reason = choice.finish_reason
        except Exception as exc:  # noqa: BLE001 (the test asserts on every error)
            result.error = f"{type(exc).__name__}: {exc}"
    result.seconds = time.monotonic() - started
    return result


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 1.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


class Load:
    """`concurrency` streams at once, each replaced as it finishes, until `stop()`.
    Stream i asks for `max_tokens + i * stagger` tokens: with ignore_eos, streams batched
    together on one pod then do not all end on the same step."""

    def __init__(
        self,
        base_url: str,
        model: str,
        concurrency: int,
        max_tokens: int,
        ignore_eos: bool = False,
        stagger: int = 0,
    ):
        self.results: list[StreamResult] = []
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(
                target=self._run,
                args=(base_url, model, max_tokens + i * stagger, ignore_eos),
                name=f"load-{i}",
                daemon=True,
            )
            for i in range(concurrency)
        ]

    def _run(self, base_url: str, model: str, max_tokens: int, ignore_eos: bool) -> None:
        while True:  # at least one stream each, however soon the load is stopped
            result = stream_chat(base_url, model, max_tokens, ignore_eos)
            with self._lock:
                self.results.append(result)
            if self._stopping.is_set():
                return

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def stop(self, timeout: float = 300) -> list[StreamResult]:
        """Let every stream in flight finish (none is cut), then return them all."""
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout)
        return self.results


def check_streams(results: list[StreamResult], max_tokens: int) -> None:
    """Every stream ended normally: no error, a finish reason, and text."""
    failed = [r for r in results if r.error or r.finish_reason not in ("length", "stop")]
    assert not failed, f"{len(failed)}/{len(results)} streams failed, e.g. {failed[:3]}"
    assert all(r.text for r in results), "a stream produced no text"
    assert any(r.finish_reason == "length" for r in results), f"no stream reached {max_tokens}"


def load_until(
    base_url: str,
    model: str,
    done: Callable[[], bool],
    timeout: float,
    concurrency: int = 8,
    max_tokens: int = 32,
) -> list[StreamResult]:
    """Queue more streams than the pods can batch until `done()`. Waiting for the added
    replica to be ready (not only requested) keeps the load, and so the scale-up
    recommendation, up while it starts: no scale-down before it could ever serve. Short
    streams let the load end soon after, well within a scale-down window."""
    with Load(base_url, model, concurrency, max_tokens) as load:
        wait_for(done, timeout, "the autoscaler's new replica under load")
    check_streams(load.results, max_tokens)
    return load.results


def stream_through_scale_down(
    base_url: str,
    model: str,
    settled: Callable[[], bool],
    timeout: float,
    concurrency: int = 4,
    max_tokens: int = 256,
) -> list[StreamResult]:
    """Keep a light load (no queue on two pods, so below every target) in flight until
    `settled()` says the scale-down is complete, pods gone; then check that no stream
    was cut. The streams are long and of equal length (ignore_eos), so they start and
    end together and each round-robin round puts some on every pod: the pod that goes
    has streams in flight when it is told to stop."""
    with Load(base_url, model, concurrency, max_tokens, ignore_eos=True) as load:
        wait_for(settled, timeout, "the scale-down to complete")
    check_streams(load.results, max_tokens)
    return load.results
