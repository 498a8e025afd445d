"""Structured outputs in the engine, with the built-in model: every sample matches its
constraint with n > 1, across preemption (recompute), chunked prefill and prefix-cache
hits; unconstrained requests in the same batch get the tokens they get alone; EOS comes
only once the grammar is complete, else "length"; a constraint that cannot compile is a
ValueError naming the field; a schema is compiled once."""

import asyncio
import contextlib
import json
import re
import time

import jsonschema
import pytest
import xgrammar as xgr
from pagefleet_serve import LLM, SamplingParams
from pagefleet_serve.config import EngineConfig
from pagefleet_serve.structured.constraint import StructuredOutputs, structural_tag_text
from pagefleet_serve.structured.grammar import GrammarCompiler

from tests.engine.engine_prompts import SYSTEM_PROMPT
from tests.engine.slow_grammar import SlowCompiler

DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
# Small on purpose: a handful of tokens per answer keeps these tests fast on a CPU.
ANSWER = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["answer", "count"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm():
    """One engine for the tests that need no special configuration (loading is slow)."""
    shared = LLM("builtin://smollm2-135m", dtype="float32", max_num_seqs=8)
    yield shared
    assert not shared.engine.has_unfinished_requests()
    shared.engine.block_manager.check_no_leaks()


def chat(llm, question: str) -> str:
    return llm.chat_prompt(
        [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    )


def test_regex_holds_for_every_sample_of_n(llm):
    params = SamplingParams(
        n=4,
        max_tokens=20,
        temperature=1.0,
        seed=7,
        structured_outputs=StructuredOutputs(regex=DATE),
    )
    [out] = llm.generate(chat(llm, "When was the Eiffel Tower finished? Give a date."), params)
    assert len(out.outputs) == 4
    for sample in out.outputs:
        assert re.fullmatch(DATE, sample.text), sample.text
        assert sample.finish_reason == "stop"


def test_unconstrained_rows_get_the_tokens_they_get_alone(llm):
    free = SamplingParams(max_tokens=8, temperature=0)
    prompts = [chat(llm, q) for q in ("Name a fruit.", "Name a colour.")]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, free)]
    constrained = SamplingParams(
        max_tokens=30, temperature=0, structured_outputs=StructuredOutputs(json=json.dumps(ANSWER))
    )
    mixed = llm.generate(
        [prompts[0], chat(llm, "Is the sky blue? Answer in JSON."), prompts[1]],
        [free, constrained, free],
    )
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), ANSWER)


def test_constraints_survive_preemption_chunked_prefill_and_prefix_hits(
    make_llm, kv_bytes_for_blocks
):
    # 12 blocks of 16 tokens for 4 sequences of ~90 tokens each: they preempt one another;
    # 32-token steps prefill every prompt in chunks; the shared system prompt hits the cache.
    llm = make_llm(
        max_num_seqs=4,
        max_num_batched_tokens=32,
        kv_cache_memory_bytes=kv_bytes_for_blocks(12),
        max_model_len=192,
    )
    schema = StructuredOutputs(json=json.dumps(ANSWER))
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=3, structured_outputs=schema)
    questions = [f"Is {i} an even number? Answer in JSON." for i in range(4)]
    outputs = llm.generate([chat(llm, q) for q in questions], params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.prefix_cache_hits > 0
    for out in outputs:
        sample = out.outputs[0]
        assert sample.finish_reason == "stop", sample
        jsonschema.validate(json.loads(sample.text), ANSWER)


def test_eos_only_once_the_grammar_is_complete(llm):
    at_least_ten = StructuredOutputs(regex=r"[a-z]{10,12}")
    [out] = llm.generate(
        chat(llm, "Say hi."),
        SamplingParams(max_tokens=20, temperature=0, structured_outputs=at_least_ten),
    )
    assert re.fullmatch(r"[a-z]{10,12}", out.outputs[0].text), out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"
    [cut] = llm.generate(
        chat(llm, "Say hi."),
        SamplingParams(max_tokens=2, temperature=0, structured_outputs=at_least_ten),
    )
    assert cut.outputs[0].finish_reason == "length"
    assert len(cut.outputs[0].text) < 10


def test_choice_yields_one_of_the_choices(llm):
    choices = ("positive", "negative", "neutral")
    outputs = llm.generate(
        [chat(llm, f"Sentiment of: {t}") for t in ("I love it", "Awful.", "It is a chair.")],
        SamplingParams(
            max_tokens=8,
            temperature=1.0,
            seed=1,
            structured_outputs=StructuredOutputs(choice=choices),
        ),
    )
    assert all(o.outputs[0].text in choices for o in outputs), [o.outputs[0].text for o in outputs]


@pytest.mark.parametrize(
    ("constraint", "words"),
    [
        (StructuredOutputs(regex="(unclosed", field="guided_regex"), "guided_regex: the regex"),
        (StructuredOutputs(json='{"type": "objectx"}'), "objectx"),
        (StructuredOutputs(json="{not json", field="response_format"), "response_format:"),
        (StructuredOutputs(grammar='start ::= "a"'), "root"),
    ],
)
def test_a_constraint_that_cannot_compile_is_a_value_error(llm, constraint, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        llm.make_request("bad", "Hi", SamplingParams(structured_outputs=constraint))


def test_exactly_one_kind_of_constraint():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputs(regex="a", choice=("a",))
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputs()


def test_a_schema_compiles_once(llm, monkeypatch):
    compiler: GrammarCompiler = llm.engine.grammar_compiler
    compiles: list[StructuredOutputs] = []
    compile_one = compiler._compile
    monkeypatch.setattr(compiler, "_compile", lambda c: compiles.append(c) or compile_one(c))
    schema = json.dumps({"title": "Once", **ANSWER})
    first = StructuredOutputs(json=schema, field="response_format")
    again = StructuredOutputs(json=schema, field="guided_json")
    assert compiler.compile_async(first) is compiler.compile_async(again)
    # One compile: the frontend's validation (the core compiles what the frontend asks it
    # to) and the core's masks share it.
    params = SamplingParams(max_tokens=4, temperature=0, structured_outputs=first)
    request = llm.make_request("once", "Hi", params)
    assert compiler.compile_async(request.params.structured_outputs) is compiler.compile_async(
        again
    )
    llm.add(request)
    while llm.has_unfinished_requests():
        llm.step()
    assert compiles == [first]


def test_a_request_whose_grammar_the_engine_has_not_compiled_yet_runs(llm):
    """A request can reach the core before its grammar is in the core's cache (here it was
    validated with another compiler; in a server, its compile may have left the cache since
    the frontend's check): it waits for the compile, then runs, even when no other request
    comes to move it along."""
    engine = llm.engine
    frontend = GrammarCompiler(
        engine.tokenizer, engine.model_config.vocab_size, engine.grammar_stop_token_ids
    )
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    params = SamplingParams(
        max_tokens=20, temperature=0, structured_outputs=StructuredOutputs(json=json.dumps(schema))
    )
    prompt = engine.tokenizer.encode(chat(llm, "Is water wet? Answer in JSON."))
    llm.add(validated(llm, frontend, "uncompiled", prompt, params))
    text, deadline = "", time.monotonic() + 60
    while llm.has_unfinished_requests():
        assert time.monotonic() < deadline, "the request never left the grammar queue"
        text += "".join(o.outputs[0].text for o in llm.step() if o.outputs)
    jsonschema.validate(json.loads(text), schema)


def validated(llm, compiler, request_id, prompt, params):
    """A request validated by the frontend, its constraint compiled (and waited for) by
    `compiler`, not by the engine's compiler."""
    if params.structured_outputs is not None:
        compiler.compile(params.structured_outputs)
    return llm.inputs.process(request_id, prompt, params)


SLOW = StructuredOutputs(json=json.dumps({"title": "Slowpoke", **ANSWER}), field="response_format")


def test_a_grammar_that_compiles_too_long_is_refused_and_holds_up_no_other(llm):
    compiler = SlowCompiler.of(llm.engine, SLOW, compile_timeout=0.5)
    try:
        slow = compiler.compile_async(SLOW)
        assert compiler.started.wait(10)
        # Another constraint compiles while the slow one is stuck.
        compiler.matcher(StructuredOutputs(regex="[0-9]+"))
        with pytest.raises(ValueError) as caught:  # noqa: PT011 - its message is checked below
            slow.result(timeout=10)
        message = str(caught.value)
        assert message.startswith("response_format: the json constraint ")
        assert "Slowpoke" in message and "did not compile within 0.5 s" in message
        assert "--structured-outputs-compile-timeout" in message
        # Sent again while it still compiles: refused from the first failure, no second
        # compile (which would be refused only after another timeout).
        with pytest.raises(ValueError, match="did not compile within"):
            compiler.compile(SLOW)
        assert compiler.slow_compiles == 1
    finally:
        compiler.release.set()
    # Its worker is stopped at the timeout: no grammar comes late, the failure stays.
    time.sleep(0.5)
    with pytest.raises(ValueError, match="did not compile within"):
        compiler.compile(SLOW)


def test_a_request_that_leaves_while_its_grammar_compiles_cancels_it_for_no_other(llm):
    """The server awaits a shared compile future on its event loop; a request whose task is
    cancelled there (the client left, the server stops) must not cancel the compile."""
    compiler = SlowCompiler.of(llm.engine, SLOW, compile_timeout=30)

    async def leave() -> None:
        waiting = asyncio.ensure_future(asyncio.wrap_future(compiler.compile_async(SLOW)))
        await asyncio.sleep(0.05)
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting

    try:
        asyncio.run(leave())
        assert compiler.started.wait(10)
    finally:
        compiler.release.set()
    assert compiler.matcher(SLOW) is not None


def test_a_grammar_the_core_cannot_compile_in_time_fails_only_its_request(llm, monkeypatch):
    """A request that reaches the core before its grammar is compiled there (validated
    elsewhere, as above) waits for the core's compile; past the timeout, the request,
    already streaming, ends with an error naming the schema, and a request in the same
    steps runs on."""
    engine = llm.engine
    frontend = engine.grammar_compiler  # it compiles SLOW at once
    core = SlowCompiler.of(engine, SLOW, compile_timeout=0.3)
    monkeypatch.setattr(engine.admission, "grammar_compiler", core)  # what the core compiles with
    prompt = engine.tokenizer.encode(chat(llm, "Is water wet? Answer in JSON."))
    try:
        slow = SamplingParams(max_tokens=20, temperature=0, structured_outputs=SLOW)
        llm.add(validated(llm, frontend, "slow", prompt, slow))
        llm.add(validated(llm, None, "plain", prompt, SamplingParams(max_tokens=4)))
        finished, deadline = {}, time.monotonic() + 60
        while llm.has_unfinished_requests():
            assert time.monotonic() < deadline
            finished |= {o.request_id: o for o in llm.step() if o.finished}
    finally:
        core.release.set()
    assert finished["slow"].outputs[0].finish_reason == "error"
    assert "did not compile within 0.3 s" in finished["slow"].error
    assert finished["plain"].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("seconds", [0, -1.5])
def test_the_compile_timeout_is_a_positive_number_of_seconds(seconds):
    with pytest.raises(ValueError, match="structured_outputs_compile_timeout must be a positive"):
        EngineConfig(structured_outputs_compile_timeout=seconds)


def test_a_structural_tag_holds_the_output_to_its_tags(llm):
    """vLLM's current form: xgrammar's format, here one tag around a JSON schema."""
    tag = {"type": "tag", "begin": "<answer>", "end": "</answer>"}
    tag["content"] = {"type": "json_schema", "json_schema": ANSWER}
    constraint = StructuredOutputs(structural_tag=structural_tag_text({"format": tag}))
    params = SamplingParams(max_tokens=40, temperature=0, structured_outputs=constraint)
    [output] = llm.generate([chat(llm, "Is water wet? Answer in JSON.")], params)
    text = output.outputs[0].text
    assert text.startswith("<answer>") and text.endswith("</answer>"), text
    jsonschema.validate(json.loads(text.removeprefix("<answer>").removesuffix("</answer>")), ANSWER)


def test_the_older_structural_tag_form_is_free_text_with_triggered_tags(llm):
    """vLLM's older form (structures and triggers) means: any text, in which a trigger
    opens one of the tags, whose content then matches its schema."""
    legacy = {
        "structures": [{"begin": "<f=add>", "schema": ANSWER, "end": "</f>"}],
        "triggers": ["<f="],
    }
    constraint = StructuredOutputs(structural_tag=structural_tag_text(legacy))
    compiled = llm.engine.grammar_compiler.compile(constraint)

    def accepts(text: str) -> bool:
        return xgr.GrammarMatcher(compiled).accept_string(text)

    assert accepts('Let me see. <f=add>{"answer": "yes", "count": 2}</f> Done.')
    assert accepts("No call at all.")
    assert not accepts('<f=add>{"answer": "maybe", "count": 2}</f>')


def test_a_choice_holds_under_a_repetition_penalty_float32_rounds_to_zero(llm):
    """The mask comes after the penalties: a penalty of 1e-300 is 0 in float32, and a
    masked -inf times 0 would be a NaN that greedy argmax picks. SamplingParams refuses
    such a value now; the sampler must hold the constraint even if one slips past."""
    params = SamplingParams(
        max_tokens=8,
        temperature=0,
        repetition_penalty=2.0,
        structured_outputs=StructuredOutputs(choice=("yes", "no")),
    )
    object.__setattr__(params, "repetition_penalty", 1e-300)
    [out] = llm.generate(chat(llm, "Is the sky blue?"), params)
    assert out.outputs[0].text in ("yes", "no"), out.outputs[0].text


@pytest.mark.parametrize(
    "constraint",
    [StructuredOutputs(choice=("yes", "no")), StructuredOutputs(json='{"type": "boolean"}')],
)
def test_a_constrained_sequence_ends_with_its_grammar_whatever_ignore_eos_says(llm, constraint):
    [out] = llm.generate(
        chat(llm, "Is the sky blue?"),
        SamplingParams(
            max_tokens=24, temperature=0, ignore_eos=True, structured_outputs=constraint
        ),
    )
    text = out.outputs[0].text
    assert text in ("yes", "no", "true", "false"), text
    assert out.outputs[0].finish_reason == "stop"
