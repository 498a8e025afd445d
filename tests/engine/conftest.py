"""Shared pieces of the engine tests: the built-in model's prompts and an LLM factory, with
a cache of engines by config for each module, that checks for leaked KV blocks after every
test."""

import pytest
from pagefleet_serve import LLM
from pagefleet_serve.config import EngineConfig
from pagefleet_serve.frontend.detokenizer import _BYTE_LEVEL
from pagefleet_serve.frontend.tokenizer import load_tokenizer

from tests.engine.engine_prompts import QUESTIONS, SYSTEM_PROMPT

# Bytes of one KV block of SmolLM2-135M in float32 with 16-token blocks:
# 2 (K, V) x 30 layers x 16 tokens x 3 kv heads x 64 dims x 4 bytes.
SMOLLM_BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 4


def smollm_kv_bytes(num_blocks: int) -> int:
    return num_blocks * SMOLLM_BLOCK_BYTES


@pytest.fixture(scope="session")
def kv_bytes_for_blocks():
    """num_blocks -> kv_cache_memory_bytes that gives the built-in model that many blocks."""
    return smollm_kv_bytes


@pytest.fixture(scope="session")
def chat_prompts():
    """The 20 parity prompts, chat-templated, sharing one system prompt."""
    tokenizer = load_tokenizer("builtin://smollm2-135m")
    return [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def llm_cache():
    """The LLMs this module's tests built, with the configs they were built from: a later
    test asking for the same config gets the same engine instead of loading the model
    again. The engine keeps what earlier tests left in it that no test may rely on: cached
    prefix blocks, cumulative counters, the unseeded sampler's generator state."""
    return []


@pytest.fixture
def make_llm(llm_cache):
    """Build LLMs, or reuse one an earlier test of this module built from the same config;
    after the test, every block of every one must be free with ref count 0 (an engine that
    fails this is not reused). One test asking twice for one config gets two engines."""
    made = []

    def make(model="builtin://smollm2-135m", **config):
        # float32: token-exact comparisons with transformers and across batch compositions.
        settings = {"model": model, "dtype": "float32"} | config
        wanted = EngineConfig(**settings)
        llm = next((llm for built, llm in llm_cache if built == wanted and llm not in made), None)
        if llm is None:
            llm = LLM(**settings)
            llm_cache.append((wanted, llm))
        made.append(llm)
        return llm

    yield make
    for llm in made:
        try:
            assert not llm.engine.has_unfinished_requests()
            llm.engine.block_manager.check_no_leaks()
        except AssertionError:
            llm_cache[:] = [entry for entry in llm_cache if entry[1] is not llm]
            raise


@pytest.fixture(scope="module")
def smollm_tokenizer():
    """The built-in model's tokenizer (byte-level BPE)."""
    return load_tokenizer("builtin://smollm2-135m")


@pytest.fixture(scope="module")
def byte_token(smollm_tokenizer):
    """byte -> the built-in tokenizer's token for that single byte."""
    pieces = {byte: char for char, byte in _BYTE_LEVEL.items()}
    return lambda byte: smollm_tokenizer.convert_tokens_to_ids(pieces[byte])
