"""Fault isolation against a real server (uvicorn in a thread, so faults can be injected into
its engine): a request the engine cannot run fails alone, other requests in the same steps
finish with the tokens they get when run alone, failures a client causes never mark the
engine dead, the step thread survives errors in each of its duties and, should it crash,
/health says why; a grammar that compiles too long is a 400 for its request only; and 200
streams dropped at random times leave no KV block behind."""

import asyncio
import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from pagefleet_serve.engine import sampler
from pagefleet_serve.engine.core import EngineCore
from pagefleet_serve.structured.constraint import StructuredOutputs

from tests.engine.slow_grammar import SlowCompiler
from tests.server.inflight import StreamInFlight, run_normal
from tests.server.server_harness import ThreadServer, assert_error, read_metrics, wait_until

POISON_SEED = 666_666  # a sampling setting the injected sampler fault trips on
POISON_TOKEN = 4242  # a prompt token the injected model fault trips on
ENGINE = {"dtype": "float32", "max_num_seqs": 8, "max_model_len": 256}
ENGINE_BYTES = 64 << 20


@pytest.fixture(scope="module")
def server():
    running = ThreadServer({}, kv_cache_memory_bytes=ENGINE_BYTES, **ENGINE)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def alone(server):
    """The normal request's result with nothing else running."""
    return run_normal(server.base_url)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


@pytest.fixture
def healthy_after(server, http):
    """After the test: /health 200, the engine idle with every KV block free."""
    yield
    assert http.get("/health").status_code == 200
    engine = server.core
    wait_until(lambda: not engine.has_unfinished_requests(), 30, "the engine to go idle")
    wait_until(lambda: engine.block_manager.num_used_blocks == 0, 10, "all blocks to be free")
    engine.block_manager.check_no_leaks()


def poisoned_sampler(monkeypatch):
    """Sampling fails for the whole batch whenever one row carries POISON_SEED, as the
    original top_k overflow did (a batched tensor built from every row's setting)."""
    real = sampler._sample

    def sample(logits, rows, *generator):
        if any(r.params.seed == POISON_SEED for r in rows):
            raise OverflowError("Overflow when unpacking long long")
        return real(logits, rows, *generator)

    monkeypatch.setattr(sampler, "_sample", sample)


def poison_sampling_request(http) -> httpx.Response:
    return http.post(
        "/v1/completions",
        json={"prompt": "hi", "max_tokens": 2, "top_p": 0.9, "seed": POISON_SEED},
    )


def test_three_huge_top_k_requests_ten_times_leave_the_server_healthy(
    server, http, alone, healthy_after
):
    huge_top_k = {"prompt": "hi", "max_tokens": 2, "top_p": 0.9, "top_k": 10**30}
    with StreamInFlight(server.base_url) as normal:
        for _ in range(10):
            for _ in range(3):
                error = assert_error(http.post("/v1/completions", json=huge_top_k), 400)
                assert error["param"] == "top_k" and "64-bit" in error["message"]
            assert http.get("/health").status_code == 200
        assert normal.result() == alone
    # A top_k within 64 bits but above the vocabulary keeps every token (as vLLM does).
    seeded = {"prompt": "hi", "max_tokens": 8, "temperature": 1.0, "seed": 3}
    big = http.post("/v1/completions", json=seeded | {"top_k": 10**12})
    off = http.post("/v1/completions", json=seeded | {"top_k": 0})
    assert big.status_code == off.status_code == 200, big.text
    assert big.json()["choices"][0]["text"] == off.json()["choices"][0]["text"]


def test_a_request_the_sampler_cannot_serve_fails_alone(
    server, http, alone, healthy_after, monkeypatch
):
    poisoned_sampler(monkeypatch)
    failures = EngineCore.MAX_CONSECUTIVE_FAILURES + 2
    with StreamInFlight(server.base_url) as normal:
        for _ in range(failures):
            error = assert_error(poison_sampling_request(http), 500)
            assert error["type"] == "server_error" and "Overflow" in error["message"]
        assert normal.result() == alone
    # Alone in their steps too: a client's sampling settings never count against the engine.
    for _ in range(failures):
        assert_error(poison_sampling_request(http), 500)
    assert http.get("/health").status_code == 200
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_request_the_model_fails_on_fails_alone(server, http, alone, healthy_after):
    model = server.core.runner.model
    real_forward = model.forward

    def forward(input_ids, *args, **kwargs):
        if bool((input_ids == POISON_TOKEN).any()):
            raise RuntimeError("injected kernel fault")
        return real_forward(input_ids, *args, **kwargs)

    model.forward = forward
    try:
        with StreamInFlight(server.base_url) as normal:
            # More than MAX_CONSECUTIVE_FAILURES: each step also ran the normal stream's
            # row, which succeeded on its own, so the fault was the request's, not the engine's.
            for _ in range(EngineCore.MAX_CONSECUTIVE_FAILURES + 1):
                response = http.post(
                    "/v1/completions", json={"prompt": [1, 2, POISON_TOKEN], "max_tokens": 4}
                )
                error = assert_error(response, 500)
                assert "injected kernel fault" in error["message"]
            assert normal.result() == alone
    finally:
        del model.forward
    assert server.engine.is_healthy


def test_step_thread_survives_errors_in_its_duties(server, http, alone, healthy_after, monkeypatch):
    engine = server.core
    real_stats, real_add = engine.stats, engine.add
    broken = {"stats": 3, "add": 1}

    def stats():
        if broken["stats"]:
            broken["stats"] -= 1
            raise RuntimeError("injected stats failure")
        return real_stats()

    def add(request):
        if broken["add"]:
            broken["add"] -= 1
            raise RuntimeError("injected add failure")
        return real_add(request)

    monkeypatch.setattr(engine, "stats", stats)
    monkeypatch.setattr(engine, "add", add)
    error = assert_error(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}), 500)
    assert "injected add failure" in error["message"]
    assert run_normal(server.base_url) == alone
    assert broken == {"stats": 0, "add": 0}
    assert server.engine.is_healthy


def structured_chat(schema: dict) -> dict:
    return {
        "messages": [{"role": "user", "content": "Is water wet? Answer in JSON."}],
        "max_tokens": 6,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    }


def test_a_grammar_that_compiles_too_long_is_a_400_and_holds_up_no_other_request(
    server, http, healthy_after, monkeypatch
):
    slow_schema = {"title": "Slowpoke", "type": "object", "properties": {"a": {"type": "string"}}}
    compiler = SlowCompiler(  # the core's compiler: it compiles every constraint, once
        server.engine.tokenizer,
        server.core.model_config.vocab_size,
        server.core.grammar_stop_token_ids,
        StructuredOutputs(json=json.dumps(slow_schema)),
        # Long enough for the other schema's compile, which may first start a compile
        # worker process (it imports torch: seconds on a loaded 2-core machine).
        compile_timeout=20,
    )
    monkeypatch.setattr(server.core, "grammar_compiler", compiler)
    other_schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    try:
        with ThreadPoolExecutor(1) as pool:
            refused = pool.submit(
                httpx.post,
                f"{server.base_url}/v1/chat/completions",
                json=structured_chat(slow_schema),
                timeout=60,
            )
            assert compiler.started.wait(30)
            # While it compiles: a plain request and one under another schema run through.
            plain = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            other = http.post("/v1/chat/completions", json=structured_chat(other_schema))
            assert not refused.done(), "the other requests waited for the slow grammar"
            compiler.time_out_now()
            response = refused.result()
    finally:
        compiler.release.set()
    assert plain.status_code == other.status_code == 200, (plain.text, other.text)
    error = assert_error(response, 400)
    assert error["param"] == "response_format", error
    assert "Slowpoke" in error["message"] and "did not compile within 20 s" in error["message"]


def test_disconnect_storm_leaves_no_kv_block_behind(server, healthy_after):
    """200 streams, up to 8 at a time, each dropped after a random number of chunks (some
    before the first one, some never)."""
    rng = random.Random(11)
    plans = [rng.choice([0, 1, 2, 3, None]) for _ in range(200)]

    async def one(client: httpx.AsyncClient, gate: asyncio.Semaphore, drop_after) -> None:
        body = {
            "prompt": f"Story {rng.random():.6f}:",
            "max_tokens": 4,
            "ignore_eos": True,
            "stream": True,
        }
        async with gate, client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            seen = 0
            async for _ in response.aiter_lines():
                if drop_after is not None and seen >= drop_after:
                    break  # leaving the block closes the connection mid-stream
                seen += 1

    async def storm() -> None:
        limits = httpx.Limits(max_connections=8, max_keepalive_connections=0)
        gate = asyncio.Semaphore(8)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60, limits=limits) as c:
            await asyncio.gather(*(one(c, gate, plan) for plan in plans))

    asyncio.run(storm())
    wait_until(
        lambda: read_metrics(server.base_url)["pagefleet:kv_cache_used_blocks"] == 0,
        30,
        "pagefleet:kv_cache_used_blocks to return to 0",
    )
    assert read_metrics(server.base_url)["pagefleet:num_requests_queued"] == 0


def test_a_crashed_step_thread_is_reported_by_health(monkeypatch):
    """Its own server: the step loop is broken for good here."""
    broken = ThreadServer({}, kv_cache_memory_bytes=16 << 20, **ENGINE)
    try:
        engine = broken.core

        def has_unfinished_requests():
            raise MemoryError("injected crash of the loop itself")

        with StreamInFlight(broken.base_url, body={"prompt": "hi", "max_tokens": 200}) as normal:
            monkeypatch.setattr(engine, "has_unfinished_requests", has_unfinished_requests)
            with pytest.raises(AssertionError):
                normal.result()  # the stream ends with an error event
        health = httpx.get(f"{broken.base_url}/health", timeout=10)
        error = assert_error(health, 503, code="engine_unhealthy")
        assert "step loop crashed" in error["message"] and "MemoryError" in error["message"]
    finally:
        broken.stop()
