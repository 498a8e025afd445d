"""Shared pieces of the engine tests: the built-in model's prompts and an LLM factory that
checks for leaked KV blocks after every test."""

import pytest
from pagefleet_serve import LLM
from pagefleet_serve.model.loader import load_tokenizer

# Bytes of one KV block of SmolLM2-135M in float32 with 16-token blocks:
# 2 (K, V) x 30 layers x 16 tokens x 3 kv heads x 64 dims x 4 bytes.
SMOLLM_BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 4

SYSTEM_PROMPT = (
    "You are a careful assistant for a test suite. Answer in the language of the question, "
    "keep answers short and factual, prefer plain sentences over lists, and never mention "
    "that you are an AI model unless you are asked about it directly."
)

QUESTIONS = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "List three prime numbers greater than 50.",
    "What does a paged KV cache do in an LLM server?",
    "Translate 'good morning, my friend' into Spanish.",
    "¿Cuál es el río más largo de Sudamérica?",
    "Écris une phrase sur la mer en hiver.",
    "Was ist die Hauptstadt von Österreich?",
    "用一句话介绍一下长城。",
    "日本の首都はどこですか？",
    "Что такое фотосинтез? Ответь кратко.",
    "Write a Python function that reverses a string.",
    "What is 17 multiplied by 23?",
    "Give me a short motivational quote about learning.",
    "Summarize the plot of Romeo and Juliet in one sentence.",
    "Name two differences between a cat and a dog.",
    "How many continents are there, and which is the largest?",
    "Describe the smell of rain using an emoji and a word: 🌧️",
    "What is the boiling point of water at sea level in Fahrenheit?",
]


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


@pytest.fixture
def make_llm():
    """Build LLMs; after the test, every block of every one must be free with ref count 0."""
    made = []

    def make(model="builtin://smollm2-135m", **config):
        # float32: token-exact comparisons with transformers and across batch compositions.
        llm = LLM(model, **{"dtype": "float32"} | config)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        assert not llm.engine.has_unfinished_requests()
        llm.engine.block_manager.check_no_leaks()
