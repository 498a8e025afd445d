"""The engine core in its own process behind `pagefleet serve`: the messages it speaks
round-trip; a constraint is compiled by the core's workers only; a stalled core (SIGSTOP)
and a killed one turn /health to 503 with the reason (requests wait for a stalled core and
are refused by a dead one; the killed one's stream in flight ends with an error event);
SIGTERM drains and leaves no child process behind; a killed server takes its core with
it."""

import json
import os
import pickle
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from pathlib import Path

import httpx
import pytest
from pagefleet_serve.frontend.core_client import EngineCoreClient
from pagefleet_serve.messages import (
    PROTOCOL_VERSION,
    AbortRequest,
    AddRequest,
    CancelCompile,
    CompileConstraint,
    ConstraintCompiled,
    CoreFailed,
    CoreReady,
    EngineStats,
    Heartbeat,
    Request,
    RequestLimits,
    RequestRejected,
    Shutdown,
    StepOutputs,
)
from pagefleet_serve.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from pagefleet_serve.sampling_params import SamplingParams
from pagefleet_serve.structured.constraint import StructuredOutputs

from tests.server.server_harness import (
    ServerProcess,
    assert_error,
    sse_events,
    stream_then,
    wait_until,
)

ENGINE_FLAGS = ("--max-model-len", "512", "--kv-cache-memory", "64MiB")
# Where no text is read, the small random model (no tokenizer: prompts are token ids).
TINY_FLAGS = (
    "--model",
    "builtin://tiny-random",
    "--max-model-len",
    "512",
    "--kv-cache-memory",
    "8MiB",
)
STATS = EngineStats(1, 2, 64, 3, 3 / 64, 10, 4, 0, 40)


def children(pid: int) -> list[int]:
    """The live child processes of `pid` (Linux /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        found += [int(child) for child in task.read_text().split()]
    return found


def is_running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return status.rpartition(")")[2].split()[0] != "Z"


def core_pid(server: ServerProcess) -> int:
    """The core's pid, from the server's log line "engine core process <pid> ready"."""
    found = re.search(r"engine core process (\d+) ready", server.log_text())
    assert found, server.log_text()
    pid = int(found.group(1))
    assert pid in children(server.process.pid)
    return pid


@pytest.mark.parametrize(
    "message",
    [
        AddRequest(
            Request(
                "cmpl-1-0",
                [1, 2, 3],
                SamplingParams(n=2, max_tokens=5, stop=("\n",), seed=7, logprobs=2),
                1.5,
            )
        ),
        AbortRequest("cmpl-1-0", "stop", 1),
        Shutdown(),
        AddRequest(
            Request(
                "chatcmpl-2-0",
                [1, 2, 3],
                SamplingParams(
                    max_tokens=5,
                    structured_outputs=StructuredOutputs(
                        json='{"type": "object"}', field="response_format"
                    ),
                ),
                1.5,
            )
        ),
        CompileConstraint("op-1", StructuredOutputs(regex="[0-9]+", field="guided_regex"), "::1"),
        CancelCompile("op-1"),
        ConstraintCompiled("op-1", "guided_regex: this client already has 4 compiles", 429),
        CoreReady(PROTOCOL_VERSION, "smollm2", RequestLimits(512, 49152, 128), 64, STATS),
        StepOutputs(
            [
                RequestOutput(
                    "cmpl-1-0",
                    [1, 2, 3],
                    [CompletionOutput(0, "", [42], [TokenLogprob(42, -0.5, [(42, -0.5)])])],
                    False,
                    num_cached_tokens=16,
                    metrics=RequestMetrics(1.5, 1.6, 1.7, 1.7),
                )
            ],
            STATS,
        ),
        RequestRejected("cmpl-1-0", "request_id 'cmpl-1-0' is already running", True),
        Heartbeat(0.25),
        CoreFailed("engine failed 3 steps in a row"),
    ],
    ids=lambda message: type(message).__name__,
)
def test_messages_round_trip(message):
    again = pickle.loads(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
    assert again == message and type(again) is type(message)
    for field in fields(message):
        assert getattr(again, field.name) == getattr(message, field.name)


@pytest.fixture
def server():
    running = ServerProcess(*ENGINE_FLAGS).wait_ready()
    yield running
    running.stop()


def compile_workers_of(pid: int) -> list[int]:
    """The grammar compile worker processes among the children of `pid`."""
    return [
        child
        for child in children(pid)
        if b"pagefleet_serve.structured.compile_worker"
        in Path(f"/proc/{child}/cmdline").read_bytes()
    ]


def test_a_constraint_is_compiled_by_the_cores_workers_only(server):
    """The API process asks the core to compile a request's constraint (a bad one is
    still a 400 before anything runs) and starts no compile worker of its own."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    body = {
        "messages": [{"role": "user", "content": "Is water wet? Answer in JSON."}],
        "max_tokens": 20,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    }
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        answer = client.post("/v1/chat/completions", json=body)
        bad = client.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "guided_regex": "(unclosed"}
        )
    assert answer.status_code == 200, answer.text
    assert "ok" in json.loads(answer.json()["choices"][0]["message"]["content"])
    error = assert_error(bad, 400, param="guided_regex")
    assert "cannot be compiled" in error["message"], error
    assert compile_workers_of(core_pid(server))
    assert compile_workers_of(server.process.pid) == []


def health_within(client: httpx.Client, status: int, seconds: float) -> httpx.Response:
    since = time.monotonic()
    response = wait_until(
        lambda: (r := client.get("/health")).status_code == status and r,
        seconds,
        f"/health {status}",
    )
    assert time.monotonic() - since < seconds
    return response


def test_a_stalled_then_killed_core_fails_health_and_ends_the_stream(server):
    stall_noticed_s = EngineCoreClient.HEARTBEAT_TIMEOUT_S + 5
    pid = core_pid(server)
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        os.kill(pid, signal.SIGSTOP)  # hung: alive, but silent
        try:
            stalled = health_within(client, 503, stall_noticed_s)
            # A stall may pass: a request is queued for the core, not refused.
            waiting = ThreadPoolExecutor(1).submit(
                httpx.post,
                f"{server.base_url}/v1/completions",
                json={"prompt": "Once", "max_tokens": 4},
                timeout=120,
            )
            time.sleep(1)
            assert not waiting.done(), waiting.result().text
        finally:
            os.kill(pid, signal.SIGCONT)
        assert waiting.result().status_code == 200, waiting.result().text
        error = assert_error(stalled, 503, code="engine_unhealthy")
        assert "engine core has not answered" in error["message"]
        health_within(client, 200, 5)

        body = {"prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            os.kill(pid, signal.SIGKILL)
            events = sse_events([first, *lines])
        killed = health_within(client, 503, 5)
        late = client.post("/v1/completions", json={"prompt": "hi"})
    error = assert_error(killed, 503, code="engine_unhealthy")
    assert "engine core process was killed by SIGKILL" in error["message"]
    assert events[-1] == "DONE"
    assert "error" in events[-2], events[-3:]
    assert "SIGKILL" in events[-2]["error"]["message"]
    assert_error(late, 503, code="engine_unhealthy")


def test_sigterm_drains_and_leaves_no_child_process():
    server = ServerProcess(*TINY_FLAGS, "--shutdown-timeout", "30").wait_ready()
    try:
        pid = core_pid(server)
        assert pid != server.process.pid and is_running(pid)
        body = {"prompt": [1, 2, 3], "max_tokens": 8, "ignore_eos": True, "stream": True}
        events = stream_then(server.base_url, body, lambda: server.signal(signal.SIGTERM))
        assert events[-1] == "DONE" and not any("error" in e for e in events[:-1])
        assert server.process.wait(timeout=60) == 0
        wait_until(lambda: not is_running(pid), 10, "the engine core process to exit")
    finally:
        server.stop()


def test_a_killed_server_takes_its_core_with_it():
    server = ServerProcess(*TINY_FLAGS).wait_ready()
    try:
        pid = core_pid(server)
        server.signal(signal.SIGKILL)
        server.process.wait(timeout=30)
        wait_until(lambda: not is_running(pid), 10, "the orphaned engine core to die")
    finally:
        server.stop()
