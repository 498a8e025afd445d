"""Text made on the frontend side of an engine core: the same text, tokens and finish
reasons as the offline engine (which makes text itself), with a stop string found by the
frontend ending just that sample in the core, whose blocks are then freed."""

import asyncio
import time

from pagefleet_serve import LLM, SamplingParams
from pagefleet_serve.engine.async_engine import AsyncEngine
from pagefleet_serve.outputs import CompletionOutput

PROMPT = "Write a sentence about the sea:"
# Seeded sampling: the same tokens both ways. "e" stops each sample within a few tokens,
# at a different point in each.
PARAMS = SamplingParams(n=2, max_tokens=30, temperature=1.0, seed=5, stop=("e",))


def test_frontend_text_and_stop_strings_match_the_offline_engine():
    llm = LLM(
        "builtin://smollm2-135m", dtype="float32", max_model_len=256, kv_cache_memory_bytes=32 << 20
    )
    offline = llm.generate(PROMPT, PARAMS)[0].outputs
    engine = AsyncEngine(llm.engine)
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
