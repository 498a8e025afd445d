"""Text made on the frontend side of an engine core: the same text, tokens and finish
reasons as the offline engine (the same output processor, stepped in process), with a stop string found by the
frontend ending just that sample in the core, whose blocks are then freed."""

import asyncio
import time

from pagefleet_serve import LLM, SamplingParams
from pagefleet_serve.engine.core import ThreadLink
from pagefleet_serve.frontend.core_client import EngineCoreClient
from pagefleet_serve.frontend.output_processor import OutputProcessor
from pagefleet_serve.outputs import CompletionOutput

PROMPT = "Write a sentence about the sea:"
# Seeded sampling: the same tokens both ways. "e" stops each sample within a few tokens,
# at a different point in each.
PARAMS = SamplingParams(n=2, max_tokens=30, temperature=1.0, seed=5, stop=("e",))


def client_in_thread(llm: LLM) -> EngineCoreClient:
    core = llm.engine
    return EngineCoreClient(core.config, ThreadLink(core), core.tokenizer)


def test_frontend_text_and_stop_strings_match_the_offline_engine():
    llm = LLM(
        "builtin://smollm2-135m", dtype="float32", max_model_len=256, kv_cache_memory_bytes=32 << 20
    )
    offline = llm.generate(PROMPT, PARAMS)[0].outputs
    engine = client_in_thread(llm)
    try:
        samples = [CompletionOutput(i) for i in range(PARAMS.n)]

        async def run() -> None:
            async for output in engine.generate("frontend", PROMPT, PARAMS):
                for delta in output.outputs:
                    samples[delta.index].extend(delta)

        asyncio.run(run())
        deadline = time.monotonic() + 10
        while engine.stats.num_used_blocks or engine.stats.num_running:
            assert time.monotonic() < deadline, f"the core still holds {engine.stats}"
            time.sleep(0.05)
    finally:
        engine.shutdown()
    assert [s.finish_reason for s in offline] == ["stop", "stop"]
    assert [(s.text, s.token_ids, s.finish_reason) for s in samples] == [
        (s.text, s.token_ids, s.finish_reason) for s in offline
    ]
    llm.engine.block_manager.check_no_leaks()


def test_an_output_the_frontend_cannot_handle_fails_only_its_request(monkeypatch):
    """Text for one request that cannot be made (a broken detokenizer, say) ends that
    request with an error and stops it in the core; a request beside it finishes whole,
    the engine stays healthy and every block comes back."""
    llm = LLM(
        "builtin://smollm2-135m", dtype="float32", max_model_len=256, kv_cache_memory_bytes=32 << 20
    )
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    [alone] = llm.generate(PROMPT, params)
    engine = client_in_thread(llm)
    add_text = OutputProcessor._add_text

    def broken_for_one(self, state, sample):
        if state.request.request_id == "broken" and sample.token_ids:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return add_text(self, state, sample)

    monkeypatch.setattr(OutputProcessor, "_add_text", broken_for_one)

    async def collect(request_id: str):
        sample = CompletionOutput(0)
        async for output in engine.generate(request_id, PROMPT, params):
            for delta in output.outputs:
                sample.extend(delta)
        return sample

    async def run():
        return await asyncio.gather(collect("broken"), collect("fine"), return_exceptions=True)

    try:
        broken, fine = asyncio.run(run())
        deadline = time.monotonic() + 10
        while engine.stats.num_used_blocks or engine.stats.num_running:
            assert time.monotonic() < deadline, f"the core still holds {engine.stats}"
            time.sleep(0.05)
        assert engine.is_healthy
    finally:
        engine.shutdown()
    assert isinstance(broken, RuntimeError) and "UnicodeDecodeError" in str(broken)
    assert (fine.text, fine.token_ids) == (alone.outputs[0].text, alone.outputs[0].token_ids)
    llm.engine.block_manager.check_no_leaks()
