"""`pagefleet serve --tensor-parallel-size 2` and `--pipeline-parallel-size 2` (two ranks
over gloo): the openai SDK streams the same greedy text as one rank serves, the token
counters count each token once; a killed rank turns /health to 503 within 5 s, naming it,
and the stream in flight ends with an error event; SIGTERM drains and takes every rank
down. Bad parallel flags are refused with a readable message."""

import os
import signal
import socket
import subprocess
import sys

import httpx
import openai
import pytest

from tests.server.server_harness import ServerProcess, assert_error, stream_then, wait_until
from tests.server.test_server_core_process import children, core_pid, health_within, is_running

FLAGS = ("--max-model-len", "512", "--kv-cache-memory", "32MiB")
BODY = {
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 24,
    "temperature": 0,
}


def streamed_text(server: ServerProcess) -> str:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(model=model, **BODY, stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def ranks_of(server: ServerProcess) -> tuple[int, list[int]]:
    """The core's pid (rank 0) and its workers' (ranks 1..: the children of the fork
    server the core started them from)."""
    core = core_pid(server)

    def workers() -> list[int]:
        return [pid for child in children(core) for pid in children(child)]

    return core, wait_until(workers, 30, "the tensor-parallel workers")


@pytest.fixture(scope="module")
def one_rank_text() -> str:
    """The greedy text one rank streams for BODY."""
    one = ServerProcess(*FLAGS).wait_ready()
    try:
        return streamed_text(one)
    finally:
        one.stop()


def generation_tokens(server: ServerProcess) -> float:
    """vllm:generation_tokens_total, summed over its labels."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:generation_tokens_total")
    )


@pytest.mark.parametrize(
    ("flags", "rank_1"),
    [
        (("--tensor-parallel-size", "2"), "tensor-parallel rank 1"),
        (("--pipeline-parallel-size", "2"), "rank 1 (pipeline stage 1)"),
    ],
    ids=["tp2", "pp2"],
)
def test_two_ranks_stream_one_ranks_text_and_a_killed_rank_fails_the_engine(
    flags, rank_1, one_rank_text
):
    server = ServerProcess(*FLAGS, *flags).wait_ready()
    try:
        assert streamed_text(server) == one_rank_text and one_rank_text
        before = generation_tokens(server)
        body = {"prompt": "Once", "max_tokens": 5, "ignore_eos": True}
        done = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).json()
        assert done["usage"]["completion_tokens"] == 5
        assert generation_tokens(server) - before == 5
        core, workers = ranks_of(server)
        assert len(workers) == 1
        body = {"prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}
        events = stream_then(server.base_url, body, lambda: os.kill(workers[0], signal.SIGKILL))
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            unhealthy = health_within(client, 503, 5)
        error = assert_error(unhealthy, 503, code="engine_unhealthy")
        assert rank_1 in error["message"] and "SIGKILL" in error["message"]
        assert events[-1] == "DONE"
        assert "error" in events[-2], events[-3:]
        wait_until(lambda: not is_running(core), 10, "rank 0's process to exit")
    finally:
        server.stop()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_nodes_serve_one_ranks_text_and_a_lost_node_fails_the_engine(one_rank_text):
    """`--nnodes 2`: node 0 serves the API with rank 0, node 1 (`--headless`, another
    process here as it is another pod of a LeaderWorkerSet group) runs rank 1; they meet
    at node 0's --master-port. The greedy text is one rank's; node 1 gone, the next
    request fails and /health turns 503."""
    expected = one_rank_text
    port = str(free_port())
    group = ("-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port)
    leader = ServerProcess(*FLAGS, *group)
    env = {**os.environ, "PAGEFLEET_DTYPE": "float32"}
    worker = subprocess.Popen(
        [sys.executable, "-m", "pagefleet_serve.cli", "serve", *FLAGS, *group]
        + ["--node-rank", "1", "--headless"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        leader.wait_ready()
        assert children(core_pid(leader)) == [], "node 0 holds rank 0 only"
        assert streamed_text(leader) == expected and expected
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0, worker.stdout.read()
        with httpx.Client(base_url=leader.base_url, timeout=60) as client:
            failed = client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 4})
            assert failed.status_code >= 500, failed.text
            unhealthy = health_within(client, 503, 10)
        assert_error(unhealthy, 503, code="engine_unhealthy")
    finally:
        worker.kill()
        leader.stop()


@pytest.mark.parametrize("flags", [("-tp", "2"), ("-pp", "2")], ids=["tp2", "pp2"])
def test_sigterm_takes_every_rank_down(flags):
    server = ServerProcess(
        "--model", "builtin://tiny-random", *FLAGS, *flags, "--shutdown-timeout", "30"
    ).wait_ready()
    try:
        core, workers = ranks_of(server)
        body = {"prompt": [1, 2, 3], "max_tokens": 8, "ignore_eos": True, "stream": True}
        events = stream_then(server.base_url, body, lambda: server.signal(signal.SIGTERM))
        assert events[-1] == "DONE" and not any("error" in e for e in events[:-1])
        assert server.process.wait(timeout=60) == 0
        for pid in [core, *workers]:
            wait_until(lambda pid=pid: not is_running(pid), 15, f"process {pid} to exit")
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ("--pipeline-parallel-size", "2", "--enable-lora"),
            "pipeline_parallel_size 2 does not support enable_lora",
        ),
        (("--nnodes", "2", "-tp", "2"), "nnodes 2 needs master_port"),
        (("--nnodes", "2", "-tp", "3", "--master-port", "29500"), "must split evenly"),
        (("--nnodes", "2", "--node-rank", "2", "-tp", "2", "--master-port", "29500"), "node_rank"),
        (("--headless",), "--headless runs the worker ranks"),
        (("-tp", "2", "--nnodes", "2", "--node-rank", "1", "--master-port", "29500"), "--headless"),
        (("-tp", "0"), "tensor_parallel_size must be a positive integer"),
    ],
)
def test_parallel_flags_that_cannot_run_are_refused(flags, message):
    result = subprocess.run(
        [sys.executable, "-m", "pagefleet_serve.cli", "serve", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert message in result.stderr
