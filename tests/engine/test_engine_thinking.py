"""A reasoning model's thinking in the engine core: a structured output's grammar starts
where the thinking ends (the JSON schema constrains the answer, not the thoughts), a
thinking budget forces the end of the thinking token by token and the answer follows,
and the output pipeline splits the text into `reasoning` and `text`.

On a scripted Qwen3 checkpoint (tests/engine/scripted_models.py): after the generation
prompt it writes `<think>Let me think</think>\\n\\nThe capital is Paris.`; where a grammar
masks its next token, its second choice is the JSON answer `{"city": "Paris"}`."""

from __future__ import annotations

import json

import pytest
from pagefleet_serve import LLM, SamplingParams
from pagefleet_serve.structured.constraint import StructuredOutputs
from pagefleet_serve.structured.thinking import ThinkingSpec

from tests.engine.scripted_models import Script, build, reference_tokens

TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}"
)
JSON_ANSWER = '{"city": "Paris"}'
QWEN3 = Script(
    special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    added=["<think>", "</think>"],
    words=["user", "assistant", "system", "\n", "\n\n", "What", " is", " the", " capital", "?"]
    + ["Let", " me", " think", "The", " Paris", ".", JSON_ANSWER],
    chat_template=TEMPLATE,
    eos="<|im_end|>",
    steps=[
        ["\n", "<think>", "Let", " me", " think", "</think>", "\n\n"],
        ["\n\n", "The", " capital", " is", " Paris", ".", "<|im_end|>"],
    ],
    alternatives=[("</think>", JSON_ANSWER), ("\n\n", JSON_ANSWER)],
)
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
THINKING = "<think>Let me think</think>"
ANSWER = "\n\nThe capital is Paris."


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """The checkpoint, an engine on it, its tokenizer and the templated prompt's ids."""
    path = build(tmp_path_factory.mktemp("scripted-qwen3"), QWEN3)
    llm = LLM(str(path), dtype="float32", max_model_len=256, kv_cache_memory_bytes=4 << 20)
    tokenizer = llm.engine.tokenizer
    messages = [{"role": "user", "content": "What is the capital?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    return path, llm, tokenizer, prompt


def spec(tokenizer, budget: int | None = None) -> ThinkingSpec:
    start, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    return ThinkingSpec("qwen3", end=(end,), forced_end=(end,), start_token=start, budget=budget)


def generate(llm, prompt, **params):
    return llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, **params))[0]


def test_the_script_is_what_transformers_writes(qwen3):
    path, llm, tokenizer, prompt = qwen3
    out = generate(llm, prompt).outputs[0]
    assert out.token_ids == reference_tokens(path, prompt, 30)
    assert tokenizer.decode(out.token_ids, skip_special_tokens=True) == THINKING + ANSWER


def test_the_pipeline_splits_thinking_from_the_answer(qwen3):
    _, llm, tokenizer, prompt = qwen3
    out = generate(llm, prompt, thinking=spec(tokenizer)).outputs[0]
    assert (out.reasoning, out.text) == ("Let me think", ANSWER)
    assert out.num_reasoning_tokens == 5  # <think>, three words, </think>


def test_the_grammar_starts_where_the_thinking_ends(qwen3):
    """Without the thinking's end the schema masks `<think>` at once and the answer is JSON
    from the first token; with it the thoughts run free and only the answer is JSON."""
    _, llm, tokenizer, prompt = qwen3
    constraint = StructuredOutputs(json=json.dumps(SCHEMA))
    plain = generate(llm, prompt, structured_outputs=constraint).outputs[0]
    assert plain.text == JSON_ANSWER
    thought = generate(llm, prompt, structured_outputs=constraint, thinking=spec(tokenizer))
    out = thought.outputs[0]
    assert (out.reasoning, out.text, out.finish_reason) == ("Let me think", JSON_ANSWER, "stop")
    assert json.loads(out.text) == {"city": "Paris"}


@pytest.mark.parametrize(
    ("budget", "reasoning"),
    [(0, ""), (1, ""), (2, "Let"), (4, "Let me think"), (9, "Let me think")],
)
def test_a_spent_budget_forces_the_end_of_the_thinking(qwen3, budget, reasoning):
    """The budget counts `<think>` and the thoughts; once spent, `</think>` is written and
    the model goes on with its answer (a budget the thinking does not reach changes
    nothing)."""
    _, llm, tokenizer, prompt = qwen3
    out = generate(llm, prompt, thinking=spec(tokenizer, budget)).outputs[0]
    assert (out.reasoning, out.text) == (reasoning, ANSWER)
    assert tokenizer.decode(out.token_ids) == f"<think>{reasoning}</think>{ANSWER}<|im_end|>"


def test_budget_and_grammar_together_and_in_every_sample(qwen3):
    """n=3 samples fork from one sequence: each sibling's gate is at the same point."""
    _, llm, tokenizer, prompt = qwen3
    constraint = StructuredOutputs(json=json.dumps(SCHEMA))
    out = generate(llm, prompt, n=3, structured_outputs=constraint, thinking=spec(tokenizer, 2))
    assert [(o.reasoning, o.text) for o in out.outputs] == [("Let", JSON_ANSWER)] * 3


def test_an_answer_without_thinking_is_constrained_from_its_first_token(qwen3):
    """A prompt that closed the thinking (enable_thinking false) has no spec: the output
    is the answer, and the grammar holds from its first token."""
    _, llm, tokenizer, _ = qwen3
    messages = [{"role": "user", "content": "What is the capital?"}]
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    prompt = tokenizer.encode(text, add_special_tokens=False)
    assert generate(llm, prompt).outputs[0].text == "The capital is Paris."
    constraint = StructuredOutputs(json=json.dumps(SCHEMA))
    assert generate(llm, prompt, structured_outputs=constraint).outputs[0].text == JSON_ANSWER


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"end": ()}, "thinking.end must be 1 to 32 token ids"),
        ({"forced_end": (1, 2)}, "thinking.forced_end must end with thinking.end"),
        ({"budget": -1}, "thinking_token_budget must be an integer in [0, 2147483647]"),
        ({"start_token": True}, "thinking.start_token must be a token id"),
    ],
)
def test_a_bad_spec_is_refused_naming_its_field(fields, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ThinkingSpec(**({"parser": "qwen3", "end": (3,), "forced_end": (3,)} | fields))
