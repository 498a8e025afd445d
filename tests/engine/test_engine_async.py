"""The background step loop: token-by-token outputs, aborts by leaving the iterator, and
failures that fail only the affected requests (then mark the engine dead)."""

import asyncio

import pytest
from pagefleet_serve import SamplingParams
from pagefleet_serve.config import EngineConfig
from pagefleet_serve.engine.core import EngineCore, ThreadLink
from pagefleet_serve.engine.llm_engine import LLMEngine
from pagefleet_serve.frontend.core_client import EngineCoreClient, EngineDeadError
from pagefleet_serve.messages import CoreFailed, Request

PARAMS = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture
def core():
    return LLMEngine(
        EngineConfig(
            model="builtin://tiny-random",
            dtype="float32",
            max_model_len=256,
            kv_cache_memory_bytes=4 << 20,
            block_size=4,
        )
    )


@pytest.fixture
def engine(core):
    client = EngineCoreClient(core.config, ThreadLink(core), core.tokenizer)
    yield client
    client.shutdown()


async def collect(engine, request_id, prompt, params=PARAMS, stop_after=None):
    outputs = []
    async for out in engine.generate(request_id, prompt, params):
        outputs.append(out)
        if stop_after is not None and len(outputs) >= stop_after:
            break
    return outputs


async def wait_until(predicate, timeout=10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_streams_one_token_per_step_and_matches_offline(engine, core):
    async def main():
        results = await asyncio.gather(*[collect(engine, f"r{i}", [3, 4, 5 + i]) for i in range(4)])
        for outputs in results:
            assert [len(o.outputs[0].token_ids) for o in outputs] == [1] * 20
            assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"
        return results

    results = asyncio.run(main())
    # The step thread must be gone before this thread steps the same engine: two threads
    # stepping one engine corrupt the scheduler (it failed once with a KeyError).
    engine.shutdown()
    assert not engine.is_healthy
    offline = core
    offline.add(Request("again", [3, 4, 5], PARAMS, 0.0))
    tokens = []
    while offline.has_unfinished_requests():
        tokens += [t for o in offline.step() for t in o.outputs[0].token_ids]
    assert tokens == [t for o in results[0] for t in o.outputs[0].token_ids]


def test_leaving_the_iterator_aborts_and_frees_blocks(engine, core):
    async def main():
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        outputs = await collect(engine, "quitter", list(range(10, 40)), long, stop_after=3)
        assert len(outputs) == 3
        await wait_until(
            lambda: engine.stats.num_used_blocks == 0 and engine.stats.num_running == 0
        )

    asyncio.run(main())
    core.block_manager.check_no_leaks()


def test_bad_input_raises_before_queueing(engine):
    async def main():
        with pytest.raises(ValueError, match="prompt"):
            await collect(engine, "empty", [])
        assert len(await collect(engine, "fine", [1, 2])) == 20

    asyncio.run(main())


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(engine, core, monkeypatch):
    executor = core.executor
    real_execute = executor.execute
    failures = {"left": 1}

    def flaky(step):
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("device fell over")
        return real_execute(step)

    monkeypatch.setattr(executor, "execute", flaky)

    async def main():
        failed = await collect(engine, "victim", [1, 2, 3])
        assert failed[-1].finished and failed[-1].error and "device fell over" in failed[-1].error
        assert engine.is_healthy
        assert len(await collect(engine, "survivor", [1, 2, 3])) == 20

    asyncio.run(main())
    core.block_manager.check_no_leaks()


def test_repeated_failures_mark_the_engine_dead(engine, core, monkeypatch):
    def broken(step):
        raise RuntimeError("gone for good")

    monkeypatch.setattr(core.executor, "execute", broken)

    async def main():
        for i in range(EngineCore.MAX_CONSECUTIVE_FAILURES):
            out = await collect(engine, f"r{i}", [1, 2, 3])
            assert out[-1].error
        await wait_until(lambda: not engine.is_healthy)
        with pytest.raises(EngineDeadError):
            await collect(engine, "late", [1, 2, 3])

    asyncio.run(main())


def test_a_core_that_reports_its_failure_then_exits_keeps_the_reported_reason(engine):
    """A lost tensor-parallel rank: the core sends CoreFailed with the rank and signal, then
    exits; its pipe's end (what the process link reports next) must not replace the cause
    in /health with "exited with code 1"."""
    reason = "engine failed: tensor-parallel rank 1 (pid 7) was killed by SIGKILL"
    engine._on_message(CoreFailed(reason))
    engine._on_core_lost("the engine core process exited with code 1")
    assert engine.unhealthy_reason == reason and engine.dead_reason == reason


def test_a_duplicate_request_id_is_refused_and_the_first_request_carries_on(engine, core):
    async def main():
        first = engine.generate("dup", [3, 4, 5], PARAMS)
        outputs = [await anext(first)]
        with pytest.raises(ValueError, match="request_id 'dup' is already in use"):
            await anext(engine.generate("dup", [6, 7], PARAMS))
        outputs += [out async for out in first]
        return outputs

    outputs = asyncio.run(main())
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1] * 20
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"
    # The engine core refuses one too (the step thread is stopped first: see above).
    engine.shutdown()
    core.add(Request("twice", [3, 4], PARAMS, 0.0))
    with pytest.raises(ValueError, match="request_id 'twice' is already running"):
        core.add(Request("twice", [5, 6], PARAMS, 0.0))
    core.abort_request("twice")
    core.block_manager.check_no_leaks()
