"""The grammar compiler's cache is least recently used, not oldest first: a constraint
that requests keep asking for stays compiled while newer, unused ones go. (A schema sent
with every request of an agent loop must not be recompiled because others arrived.)"""

import pytest
from pagefleet_serve.model.loader import load_tokenizer
from pagefleet_serve.structured import grammar
from pagefleet_serve.structured.constraint import StructuredOutputs
from pagefleet_serve.structured.grammar import GrammarCompiler


@pytest.fixture(scope="module")
def compiler():
    tokenizer = load_tokenizer("builtin://smollm2-135m")
    return GrammarCompiler(tokenizer, 49152, [tokenizer.eos_token_id])


def test_a_constraint_asked_for_again_outlives_newer_ones(compiler, monkeypatch):
    monkeypatch.setattr(grammar, "CACHE_SIZE", 3)
    a, b, c, d = (StructuredOutputs(regex=f"{word}[0-9]") for word in ("ab", "cd", "ef", "gh"))
    first = {constraint: compiler.compile_async(constraint) for constraint in (a, b, c)}
    assert compiler.compile_async(a) is first[a]  # a hit: a is now the most recently used
    compiler.compile_async(d)  # one too many: the least recently used, b, goes
    assert compiler.compile_async(a) is first[a]
    assert compiler.compile_async(c) is first[c]
    again = compiler.compile_async(b)
    assert again is not first[b]
    for future in (*first.values(), again):
        future.result(timeout=60)  # every one compiles (none was lost by the eviction)
