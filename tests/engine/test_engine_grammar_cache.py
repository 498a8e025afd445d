"""The grammar compiler's cache is least recently used, not oldest first: a constraint
that requests keep asking for stays compiled while newer, unused ones go. (A schema sent
with every request of an agent loop must not be recompiled because others arrived.)
A closed compiler, or the compiler of an engine that is closed or dropped, ends its
worker processes."""

import gc
import os
from pathlib import Path

import pytest
from pagefleet_serve import LLM, SamplingParams
from pagefleet_serve.frontend.tokenizer import load_tokenizer
from pagefleet_serve.structured import grammar
from pagefleet_serve.structured.constraint import StructuredOutputs
from pagefleet_serve.structured.grammar import GrammarCompiler

from tests.server.server_harness import wait_until
from tests.server.test_server_core_process import children, is_running


@pytest.fixture(scope="module")
def compiler():
    tokenizer = load_tokenizer("builtin://smollm2-135m")
    compiler = GrammarCompiler(tokenizer, 49152, [tokenizer.eos_token_id])
    yield compiler
    compiler.close()


def compile_workers() -> set[int]:
    """This process's live grammar compile worker processes."""
    workers = set()
    for pid in children(os.getpid()):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:  # gone meanwhile
            continue
        if is_running(pid) and b"pagefleet_serve.structured.compile_worker" in command:
            workers.add(pid)
    return workers


def wait_for_none_of(pids: set[int]) -> None:
    wait_until(lambda: not pids & compile_workers(), 30, f"compile workers {pids} to end")


def test_a_closed_compiler_ends_its_workers_and_refuses_new_compiles():
    before = compile_workers()
    tokenizer = load_tokenizer("builtin://smollm2-135m")
    closed = GrammarCompiler(tokenizer, 49152, [tokenizer.eos_token_id], workers=2)
    closed.compile(StructuredOutputs(regex="(yes|no)"))
    started = compile_workers() - before
    assert started
    closed.close()
    wait_for_none_of(started)
    with pytest.raises(RuntimeError, match="the grammar compiler is closed"):
        closed.compile_async(StructuredOutputs(regex="a"))


@pytest.mark.parametrize("how", ["closed", "dropped"])
def test_an_engine_closed_or_dropped_ends_its_compile_workers(how):
    """Its compile threads keep the compiler alive: without the engine ending it, each
    `LLM` built and dropped left its worker processes running."""
    before = compile_workers()
    llm = LLM("builtin://smollm2-135m", max_model_len=128, kv_cache_memory_bytes=8 << 20)
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(regex="(yes|no)"))
    assert llm.generate(["Is water wet?"], params)[0].outputs[0].text in ("yes", "no")
    started = compile_workers() - before
    assert started
    if how == "closed":
        llm.engine.close()
    del llm
    gc.collect()
    wait_for_none_of(started)


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


@pytest.mark.parametrize(
    ("cpus", "quota", "expected"),
    [
        (2, None, 2),  # a 2-core machine: two, so one slow schema holds up nothing else
        (16, None, 3),  # many cores: all workers but one
        (16, 2.0, 2),  # a pod limited to 2 CPUs on a large node
        (16, 0.5, 2),  # less than a core: still two
        (8, None, 3),
        (6, None, 3),
        (4, None, 2),
    ],
)
def test_one_client_holds_at_most_half_the_cpus_of_compile_workers(
    monkeypatch, cpus, quota, expected
):
    """By default one client's compiles hold all workers but one, and no more than half the
    CPUs the process may use (affinity and cgroup quota), so its slow schemas cannot take
    every core from the engine and the other clients' compiles; two at least, so that a
    client (behind a proxy: every client) is not held up by its own one slow schema."""
    monkeypatch.setattr(grammar, "available_cpus", lambda: list(range(cpus)))
    monkeypatch.setattr(grammar, "cpu_quota", lambda: quota)
    compiler = GrammarCompiler(None, 100, [], workers=4)
    assert compiler.max_running_per_client == expected
    assert (
        GrammarCompiler(None, 100, [], workers=4, max_running_per_client=4).max_running_per_client
        == 4
    )
    assert GrammarCompiler(None, 100, [], workers=2).max_running_per_client == 1
