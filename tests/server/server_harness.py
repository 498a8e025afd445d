"""Real servers for the server tests: a `pagefleet serve` subprocess, or a uvicorn server
in a thread of the test process (so a test can reach into its engine), both on port 0
(the OS picks a free loopback port and the server reports the one it bound, so no other
process can take it between a check and the bind) with the built-in model; plus helpers to read /metrics and to poll."""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL = "builtin://smollm2-135m"
START_TIMEOUT_S = 240.0


def free_port() -> int:
    """A port that was free a moment ago (kept for tests that run their own listeners; the
    servers here bind port 0 instead, as another process may take this one first)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.05):
    """Poll until `predicate()` is truthy; return its value, or fail naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def _is_ready(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/ready", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


# The startup line of `DrainingServer`: "serving <names> on http://<host>:<port>".
_SERVING_LINE = re.compile(r"serving .* on http://[^\s:]+:(\d+)")


class ServerProcess:
    """`python -m pagefleet_serve.cli serve ...` with its log in a temporary file."""

    def __init__(self, *flags: str, env: dict[str, str] | None = None) -> None:
        self._port: int | None = None
        self.log = Path(tempfile.mkstemp(prefix="pagefleet-serve-", suffix=".log")[1])
        command = [sys.executable, "-m", "pagefleet_serve.cli", "serve", "--port", "0", *flags]
        # float32 unless a test says otherwise: the same tokens on every CPU (auto would
        # pick bfloat16 only where the CPU has native bfloat16).
        env = {**os.environ, "PAGEFLEET_DTYPE": "float32", **(env or {})}
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)

    @property
    def port(self) -> int:
        """The port the server bound, from its startup line (waits for it)."""
        if self._port is None:
            self._port = wait_until(
                self._bound_port, START_TIMEOUT_S, "the server to bind a port", interval=0.2
            )
        return self._port

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _bound_port(self) -> int | None:
        if self.process.poll() is not None:
            raise AssertionError(
                f"server exited with {self.process.returncode}:\n{self.log_text()}"
            )
        found = _SERVING_LINE.search(self.log_text())
        return int(found.group(1)) if found else None

    def wait_ready(self) -> ServerProcess:
        def ready() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(
                    f"server exited with {self.process.returncode}:\n{self.log_text()}"
                )
            return _is_ready(self.base_url)

        wait_until(ready, START_TIMEOUT_S, "the server to become ready", interval=0.2)
        return self

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.process.send_signal(sig)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        self.log.unlink(missing_ok=True)


class ThreadServer:
    """The same app under uvicorn in a thread of this process; `.engine` is its core client,
    `.core` the LLMEngine the client's core thread steps."""

    def __init__(self, settings: dict, **engine_config) -> None:
        from pagefleet_serve.config import EngineConfig
        from pagefleet_serve.engine.core import ThreadLink
        from pagefleet_serve.engine.llm_engine import LLMEngine
        from pagefleet_serve.frontend.core_client import EngineCoreClient
        from pagefleet_serve.frontend.tokenizer import load_engine_tokenizer
        from pagefleet_serve.server.settings import ServerSettings
        from pagefleet_serve.server.uvicorn_server import create_server

        config = EngineConfig(**{"model": MODEL, "dtype": "float32"} | engine_config)
        engine = LLMEngine(config, tokenizer=load_engine_tokenizer(config))
        self.core = engine
        self.engine = EngineCoreClient(engine.config, ThreadLink(engine), engine.tokenizer)
        self.server = create_server(
            ServerSettings(**{"served_model_names": (engine.model_name,), "port": 0} | settings),
            self.engine,
            log_level="warning",
        )
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.thread.start()
        wait_until(
            lambda: self.server.started or not self.thread.is_alive(),
            START_TIMEOUT_S,
            "the server to bind a port",
        )
        assert self.server.started, "the uvicorn thread ended before the server started"
        self.port = self.server.bound_port
        self.base_url = f"http://127.0.0.1:{self.port}"
        wait_until(lambda: _is_ready(self.base_url), START_TIMEOUT_S, "the server to start")

    @property
    def state(self):
        return self.server.state

    def stop(self) -> None:
        """Stop uvicorn, then the core's step thread, and let the engine go: a module's
        in-process server must not hold its model and KV pool for the rest of the run (the
        suite's one process ran out of memory when each stayed)."""
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.engine.shutdown()
        del self.core, self.engine, self.server
        gc.collect()


def probe_health(base_url: str, into: list[float], until: threading.Event, interval: float) -> None:
    """/health's latencies into `into`, one probe each `interval` seconds, until `until`
    is set (each must answer 200)."""
    with httpx.Client(base_url=base_url, timeout=10) as client:
        while not until.is_set():
            started = time.perf_counter()
            assert client.get("/health").status_code == 200
            into.append(time.perf_counter() - started)
            time.sleep(interval)


def read_metrics(base_url: str) -> dict[str, float]:
    """/metrics as {'name{label="value",...}': value}, labels sorted, model_name left out."""
    response = httpx.get(f"{base_url}/metrics", timeout=10)
    response.raise_for_status()
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = {k: v for k, v in sorted(sample.labels.items()) if k != "model_name"}
            inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
            samples[f"{sample.name}{{{inner}}}" if inner else sample.name] = sample.value
    return samples


def sse_events(lines) -> list:
    """Parse SSE lines into a list of JSON payloads, ':' comments (as str) and 'DONE'."""
    events = []
    for line in lines:
        if line.startswith(":"):
            events.append(line)
        elif line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append("DONE" if data == "[DONE]" else json.loads(data))
    return events


def assert_error(
    response: httpx.Response, status: int, code: str | None = None, param: str | None = None
) -> dict:
    """An OpenAI error body with this status; returns its "error" object."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert "Traceback" not in response.text
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


def stream_then(base_url: str, body: dict, then: Callable[[], object]) -> list:
    """Stream a completion; once its first data event has arrived run `then()` (kill,
    signal...), read the rest; the parsed events (see `sse_events`)."""
    with httpx.Client(base_url=base_url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            then()
            return sse_events([first, *lines])
