"""Hostile constraints against a real server (uvicorn in a thread, the built-in model):
a schema nested past the structural bound is a 400 before any compile; a compile past its
worker's memory limit is a 400 while this (the API) process stays small and /health 200;
the compile queue is bounded (429 in OpenAI's shape), per client too; a queued compile
whose client left is dropped; and the compile timeout counts from the start of the compile,
so compiles stuck ahead of a request do not time it out (issue 42, items 1 and 5)."""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from pagefleet_serve.structured.constraint import MAX_CONSTRAINT_DEPTH, StructuredOutputs
from pagefleet_serve.structured.grammar import GrammarCompiler

from tests.server.server_harness import ThreadServer, assert_error, wait_until


@pytest.fixture(scope="module")
def server():
    running = ThreadServer({}, max_num_seqs=4, max_model_len=256, kv_cache_memory_bytes=32 << 20)
    yield running
    running.stop()


def nested_arrays(depth: int, max_items: int | None = None, title: str = "") -> str:
    """`depth` arrays of arrays around a string: compile cost grows fast with depth and
    with maxItems (at depth 60, maxItems 100 needs more than a GiB)."""
    schema = '{"type":"string"}'
    bounds = f',"maxItems":{max_items}' if max_items is not None else ""
    for _ in range(depth):
        schema = f'{{"type":"array","items":{schema}{bounds}}}'
    return schema[:-1] + f',"title":{json.dumps(title)}}}' if title else schema


def completion(schema: str) -> dict:
    return {"prompt": "hi", "max_tokens": 4, "guided_json": schema}


def chat(schema: dict) -> dict:
    return {
        "messages": [{"role": "user", "content": "Is water wet? Answer in JSON."}],
        "max_tokens": 6,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    }


_made: list[GrammarCompiler] = []


@pytest.fixture(autouse=True)
def close_compilers():
    """Each test's own compilers end with it (their threads would keep their worker
    processes running for the rest of the run)."""
    yield
    while _made:
        _made.pop().close()


def compiler_for(server, cls=GrammarCompiler, **limits) -> GrammarCompiler:
    core = server.core
    compiler = cls(
        server.engine.tokenizer,
        core.model_config.vocab_size,
        core.grammar_stop_token_ids,
        **limits,
    )
    _made.append(compiler)
    compiler.compile(StructuredOutputs(regex="warm"))  # the vocabulary read, a worker up
    return compiler


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_schema_nested_past_the_bound_is_a_400_naming_it_before_any_compile(server):
    # The probe's schema: ~225 KB, arrays nested 9,000 deep (under xgrammar's own guard of
    # 10,000), sent as a string.
    schema = nested_arrays(9_000)
    response = httpx.post(f"{server.base_url}/v1/completions", json=completion(schema), timeout=60)
    error = assert_error(response, 400, param="guided_json")
    assert f"at most {MAX_CONSTRAINT_DEPTH} are allowed" in error["message"], error
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200


def test_compiles_past_their_memory_limit_are_400s_and_the_api_process_stays_small(
    server, monkeypatch
):
    """Scaled down from 'four times at once, the API process grows less than 1 GiB': four
    distinct schemas that each need more than a GiB, under a 64 MiB limit per compile."""
    compiler = compiler_for(server, memory_limit_bytes=64 << 20)
    monkeypatch.setattr(server.core, "grammar_compiler", compiler)
    before = rss_bytes()
    peak, health, done = before, [], threading.Event()

    def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss_bytes())
            health.append(httpx.get(f"{server.base_url}/health", timeout=10).status_code)
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            responses = list(
                pool.map(
                    lambda i: httpx.post(
                        f"{server.base_url}/v1/completions",
                        json=completion(nested_arrays(60, 100, title=f"bomb {i}")),
                        timeout=120,
                    ),
                    range(4),
                )
            )
    finally:
        done.set()
        watcher.join()
    for response in responses:
        error = assert_error(response, 400, param="guided_json")
        assert "needs more than 64 MiB to compile" in error["message"], error
    assert peak - before < 200 << 20, f"the API process grew by {(peak - before) >> 20} MiB"
    assert health and set(health) == {200}, health
    # The workers are replaced: the next schema compiles.
    ok = httpx.post(
        f"{server.base_url}/v1/chat/completions", json=chat({"type": "boolean"}), timeout=120
    )
    assert ok.status_code == 200, ok.text


class HeldCompiler(GrammarCompiler):
    """A compiler whose constraints titled "Held..." wait for `release` before compiling
    (a schema xgrammar would chew on); it records what it compiled."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.release = threading.Event()
        self.held = threading.Semaphore(0)
        self.compiled: list[str] = []

    def _compile(self, constraint):
        if constraint.json is not None and '"title": "Held' in constraint.json:
            self.held.release()
            self.release.wait(60)
        self.compiled.append(constraint.json or "")
        return super()._compile(constraint)


def held(name: str) -> dict:
    return {"title": f"Held {name}", "type": "object", "properties": {"a": {"type": "string"}}}


def post_chat(server, schema: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=chat(schema), timeout=timeout)


def test_a_client_over_its_compile_budget_gets_a_429(server, monkeypatch):
    compiler = compiler_for(server, HeldCompiler, max_per_client=1)
    monkeypatch.setattr(server.core, "grammar_compiler", compiler)
    try:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(post_chat, server, held("one"))
            assert compiler.held.acquire(timeout=60)
            refused = post_chat(
                server, {"type": "object", "properties": {"b": {"type": "integer"}}}
            )
            compiler.release.set()
            assert first.result().status_code == 200, first.result().text
    finally:
        compiler.release.set()
    error = assert_error(refused, 429, code="compile_queue_full", param="response_format")
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert "at most 1" in error["message"], error
    assert refused.headers["retry-after"] == "1"


def test_one_clients_slow_compiles_leave_a_worker_for_another_client(server, monkeypatch):
    """Four workers, of which one client may hold three (set here: the default also
    depends on the CPUs): its four slow compiles hold three (the fourth waits in the
    queue); another client's constraint compiles on the free worker at once, and its
    request is answered while the first client's are still held."""
    compiler = compiler_for(server, HeldCompiler, max_per_client=10, max_running_per_client=3)
    monkeypatch.setattr(server.core, "grammar_compiler", compiler)
    other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=120)
    try:
        with ThreadPoolExecutor(4) as pool:
            held_ones = [pool.submit(post_chat, server, held(str(i))) for i in range(4)]
            for _ in range(3):
                assert compiler.held.acquire(timeout=60)
            wait_until(lambda: len(compiler._queue) == 1, 30, "the fourth compile to queue")
            assert not compiler.held.acquire(timeout=0.5), "one client held every worker"
            schema = {"type": "object", "properties": {"v": {"type": "boolean"}}}
            answer = other.post(f"{server.base_url}/v1/chat/completions", json=chat(schema))
            assert answer.status_code == 200, answer.text
            assert not any(f.done() for f in held_ones)
            compiler.release.set()
            assert all(f.result().status_code == 200 for f in held_ones)
    finally:
        compiler.release.set()
        other.close()


def test_the_compile_queue_is_bounded(server, monkeypatch):
    compiler = compiler_for(server, HeldCompiler, workers=1, max_queued=1, max_per_client=10)
    monkeypatch.setattr(server.core, "grammar_compiler", compiler)
    try:
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(post_chat, server, held("running"))
            assert compiler.held.acquire(timeout=60)
            queued = pool.submit(post_chat, server, {"type": "integer"})
            wait_until(lambda: len(compiler._queue) == 1, 30, "the second compile to queue")
            refused = post_chat(server, {"type": "number"})
            compiler.release.set()
            assert running.result().status_code == queued.result().status_code == 200
    finally:
        compiler.release.set()
    error = assert_error(refused, 429, code="compile_queue_full")
    assert "waiting for a worker" in error["message"], error


def test_compiles_nobody_waits_for_are_dropped_and_the_timeout_counts_from_the_start(
    server, monkeypatch
):
    """Every worker held by a compile that outlives its timeout; meanwhile one request
    leaves while its compile waits in the queue, and a victim's waits there too. The one
    whose client left is never compiled; the victim's timeout starts when its compile
    does, so it compiles once the workers are free."""
    compiler = compiler_for(
        server, HeldCompiler, compile_timeout=3, max_per_client=100, max_running_per_client=4
    )
    monkeypatch.setattr(server.core, "grammar_compiler", compiler)
    left = {"title": "Left", "type": "object", "properties": {"c": {"type": "boolean"}}}
    victim = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    try:
        with ThreadPoolExecutor(5) as pool:
            stuck = [pool.submit(post_chat, server, held(str(i))) for i in range(4)]
            for _ in stuck:
                assert compiler.held.acquire(timeout=120)
            with pytest.raises(httpx.ReadTimeout):
                post_chat(server, left, timeout=0.5)
            queued = time.monotonic()
            victim_response = pool.submit(post_chat, server, victim)
            for response in stuck:  # each times out 3 s after its compile started
                assert_error(response.result(), 400, param="response_format")
            # Until the victim has waited in the queue longer than the timeout.
            time.sleep(max(0.0, queued + compiler.compile_timeout + 0.2 - time.monotonic()))
            compiler.release.set()
            answer = victim_response.result()
    finally:
        compiler.release.set()
    assert answer.status_code == 200, answer.text
    assert not any('"Left"' in text for text in compiler.compiled), "a dropped compile ran"


def test_a_compile_past_its_timeout_or_left_by_its_waiters_has_its_worker_killed(server):
    """The worker itself is stopped: at the timeout, and as soon as the last waiter of a
    running compile leaves; the next compile gets a fresh worker."""
    compiler = compiler_for(server, compile_timeout=0.5, memory_limit_bytes=1 << 30)
    slow = StructuredOutputs(json=nested_arrays(60, 100, title="slow"), field="guided_json")
    with pytest.raises(ValueError, match=r"guided_json: .* did not compile within 0\.5 s"):
        compiler.compile(slow)
    left = StructuredOutputs(json=nested_arrays(60, 100, title="left"), field="guided_json")
    compiler.compile_timeout = 60
    future = compiler.compile_async(left, client="a")
    time.sleep(0.2)
    compiler.stop_waiting(future)
    with pytest.raises(ValueError, match="dropped: no request waits for it"):
        future.result(timeout=30)
    assert compiler.compile(StructuredOutputs(regex="[0-9]+")) is not None
