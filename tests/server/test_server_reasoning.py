"""Reasoning models on a real server, for each parser: the thinking split from the answer
(`message.reasoning` and `reasoning_content`, streamed as reasoning deltas before the
content), thinking switched off by `chat_template_kwargs`, Responses reasoning items
(whole and streamed, and given back in `input`), a JSON schema applied after the
thinking, the thinking budget, the reasoning tokens in the usage and the metrics.

Each parser's model is a scripted tiny Qwen3 checkpoint (tests/engine/scripted_models.py)
with a tokenizer and chat template written here: qwen3 (the model writes `<think>`
itself; `enable_thinking: false` closes it in the prompt), deepseek_r1 (thinks from its
first token, no opening tag), granite (its phrases, when `thinking: true`) and gpt_oss
(a harmony conversation: an analysis message, then the final channel; the prompt is the
server's harmony rendering, thinking off opens the final channel). Where a grammar masks
the model's next token, its second choice is the JSON answer. The parser is chosen by
the tokenizer and template (deepseek_r1 is named by the flag)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
import openai
import pytest
from pagefleet_serve import LLM, SamplingParams

from tests.engine.scripted_models import Script, build
from tests.engine.test_engine_thinking import JSON_ANSWER, QWEN3, SCHEMA
from tests.server.server_harness import ThreadServer, read_metrics

QUESTION = [{"role": "user", "content": "What is the capital?"}]
ANSWER_WORDS = ["The", " capital", " is", " Paris", ".", JSON_ANSWER]
DEEPSEEK = Script(
    special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    added=["<think>", "</think>"],
    words=["user", "assistant", "\n", "\n\n", "What", "?", "Let", " me", " think", *ANSWER_WORDS],
    chat_template=(
        "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
        "{% endfor %}{{ '<|im_start|>assistant\\n' }}"
        "{% if thinking is defined and thinking is false %}{{ '</think>\\n\\n' }}{% endif %}"
    ),
    eos="<|im_end|>",
    steps=[
        ["\n", "Let", " me", " think", "</think>", "\n\n"],
        ["\n\n", "The", " capital", " is", " Paris", ".", "<|im_end|>"],
    ],
    alternatives=[("</think>", JSON_ANSWER), ("\n\n", JSON_ANSWER)],
)
THOUGHT, RESPONSE = "Here is my thought process:", "Here is my response:"
GRANITE = Script(
    special=["<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>"],
    added=[THOUGHT, RESPONSE],
    words=["user", "assistant", "\n", "\n\n", "What", "?", "Let", " me", " think", *ANSWER_WORDS],
    chat_template=(
        "{% for m in messages %}{{ '<|start_of_role|>' + m.role + '<|end_of_role|>' + m.content "
        "+ '<|end_of_text|>\\n' }}{% endfor %}{{ '<|start_of_role|>assistant<|end_of_role|>' }}"
        "{% if thinking is defined and thinking %}{{ '\\n' }}{% else %}{{ '\\n\\n' }}{% endif %}"
        # Granite's template asks for the thinking in these words.
        "{# Respond after: " + THOUGHT + " #}"
    ),
    eos="<|end_of_text|>",
    steps=[
        ["\n", THOUGHT, "Let", " me", " think", RESPONSE],
        [RESPONSE, "The", " capital", " is", " Paris", ".", "<|end_of_text|>"],
        ["\n\n", "The"],
    ],
    alternatives=[(RESPONSE, JSON_ANSWER)],
)
HARMONY_SPECIAL = ["<|startoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>"]
HARMONY_SPECIAL += ["<|end|>", "<|message|>", "<|call|>"]
GPT_OSS = Script(
    special=HARMONY_SPECIAL,
    added=[],
    # " analysis," and " final.": the system message's channel list is not the headers'
    # channel names, whose tokens flag what the model has written.
    words=["system", "developer", "user", "assistant", "analysis", "final", "commentary"]
    + [" analysis,", " commentary,", " final.", "What", "?", "Let", " me", " think", *ANSWER_WORDS],
    chat_template="",
    eos="<|return|>",
    stops=["<|call|>"],
    steps=[
        ["assistant", "<|channel|>"],
        ["analysis", "<|message|>"],
        ["Let", " me", " think", "<|end|>", "<|start|>", "assistant"],
        ["final", "<|message|>"],
        ["The", " capital", " is", " Paris", ".", "<|return|>"],
    ],
    # After <|channel|> and <|message|> the thinking decides: analysis and Let before it,
    # final and The once "Let" was written; a prompt that opened the final channel itself
    # has written neither "analysis" nor "Let": The.
    edges=[
        ("<|channel|>", "analysis", 2.0),
        ("<|channel|>", "final", 1.5),
        ("<|message|>", "Let", 1.5),
        ("<|message|>", "The", 2.0),
    ],
    flags=[("Let", "final", 1.0), ("Let", "The", 1.0), ("analysis", "Let", 1.0)],
    alternatives=[("<|message|>", JSON_ANSWER)],
)


@dataclass(frozen=True)
class Case:
    script: Script
    flag: str | None  # --reasoning-parser (None: chosen by the tokenizer and template)
    on: dict  # chat_template_kwargs that switch thinking on
    off: dict  # ... and off
    reasoning: str
    content: str
    reasoning_tokens: int
    budget: int
    budgeted_reasoning: str


CASES = {
    "qwen3": Case(QWEN3, None, {}, {"enable_thinking": False}, "Let me think",
                  "\n\nThe capital is Paris.", 5, 2, "Let"),
    "deepseek_r1": Case(DEEPSEEK, "deepseek_r1", {}, {"thinking": False}, "Let me think",
                        "\n\nThe capital is Paris.", 4, 1, "Let"),
    "granite": Case(GRANITE, None, {"thinking": True}, {}, "Let me think",
                    "The capital is Paris.", 5, 2, "Let\n\n"),
    "gpt_oss": Case(GPT_OSS, None, {"current_date": "2025-06-28"},
                    {"current_date": "2025-06-28", "enable_thinking": False}, "Let me think",
                    "The capital is Paris.", 7, 4, "Let"),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """A server on the case's checkpoint (float32, a small pool); `.case` its script."""
    name = request.param
    case = CASES[name]
    path = build(tmp_path_factory.mktemp(f"scripted-{name}"), case.script)
    settings = {"reasoning_parser": case.flag} if case.flag else {}
    server = ThreadServer(
        settings, model=str(path), max_model_len=512, kv_cache_memory_bytes=8 << 20
    )
    yield name, case, server
    server.stop()


@pytest.fixture
def client(case):
    _, _, server = case
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def chat(client, case, **extra):
    body = {"chat_template_kwargs": case.on} | extra
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=QUESTION,
        temperature=0,
        max_tokens=40,
        extra_body=body,
    )


def test_the_parser_is_chosen_and_the_split_is_whole(case, client):
    name, case, server = case
    assert server.state.reasoning_parser.name == name
    response = chat(client, case)
    message = response.choices[0].message
    assert message.reasoning == message.reasoning_content == case.reasoning
    assert message.content == case.content
    assert response.choices[0].finish_reason == "stop"
    details = response.usage.completion_tokens_details
    assert details.reasoning_tokens == case.reasoning_tokens
    assert response.usage.completion_tokens > case.reasoning_tokens


def test_the_offline_llm_renders_and_splits_the_chat_as_the_server(case, client):
    """One chat path: the offline `LLM.chat`, with the server's parser, renders the prompt
    the server renders (harmony for gpt_oss) and splits the same thinking off."""
    _, case, server = case
    offline = LLM(
        server.core.config.model,
        reasoning_parser=case.flag,
        max_model_len=512,
        kv_cache_memory_bytes=8 << 20,
    )
    assert offline.inputs.reasoning_parser.name == server.state.reasoning_parser.name
    params = SamplingParams(temperature=0, max_tokens=40)
    [output] = offline.chat(QUESTION, params, chat_template_kwargs=case.on)
    tokens = httpx.post(
        f"{server.base_url}/tokenize",
        json={"messages": QUESTION, "chat_template_kwargs": case.on},
        timeout=30,
    ).json()["tokens"]
    assert output.prompt_token_ids == tokens
    [sample] = output.outputs
    assert (sample.reasoning, sample.text) == (case.reasoning, case.content)
    assert sample.num_reasoning_tokens == case.reasoning_tokens
    [budgeted] = offline.chat(
        QUESTION, params, chat_template_kwargs=case.on, thinking_token_budget=case.budget
    )
    assert budgeted.outputs[0].reasoning == case.budgeted_reasoning
    with pytest.raises(ValueError, match="thinking_token_budget: must be an integer"):
        offline.chat(QUESTION, params, thinking_token_budget=-1)


def test_streamed_reasoning_comes_first_and_joins_into_the_whole(case, client):
    _, case, _ = case
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=QUESTION,
        temperature=0,
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"chat_template_kwargs": case.on},
    )
    kinds, reasoning, content, usage = [], "", "", None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            thought = getattr(delta, "reasoning", None)
            if thought:
                assert delta.reasoning_content == thought and not delta.content
                reasoning += thought
                kinds.append("reasoning")
            if delta.content:
                content += delta.content
                kinds.append("content")
    assert (reasoning, content) == (case.reasoning, case.content)
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning")  # all thinking first
    assert usage.completion_tokens_details.reasoning_tokens == case.reasoning_tokens


def test_include_reasoning_false_leaves_the_thinking_out(case, client):
    _, case, _ = case
    message = chat(client, case, include_reasoning=False).choices[0].message
    assert message.content == case.content
    assert getattr(message, "reasoning", None) is None


def test_chat_template_kwargs_switch_the_thinking_off(case, client):
    _, case, _ = case
    response = chat(client, case, chat_template_kwargs=case.off)
    message = response.choices[0].message
    assert message.content == "The capital is Paris."
    assert getattr(message, "reasoning", None) is None
    assert getattr(response.usage, "completion_tokens_details", None) is None


def test_a_json_schema_constrains_the_answer_after_the_thinking(case, client):
    _, case, _ = case
    response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    message = chat(client, case, response_format=response_format).choices[0].message
    assert message.reasoning == case.reasoning
    assert json.loads(message.content) == {"city": "Paris"}
    off = chat(client, case, response_format=response_format, chat_template_kwargs=case.off)
    assert off.choices[0].message.content == JSON_ANSWER


def test_the_thinking_budget_forces_the_end_and_the_answer_follows(case, client):
    _, case, _ = case
    message = chat(client, case, thinking_token_budget=case.budget).choices[0].message
    assert message.reasoning == case.budgeted_reasoning
    assert message.content.strip() == "The capital is Paris."


def test_responses_carry_a_reasoning_item_whole_and_streamed(case, client):
    _, case, server = case
    model = client.models.list().data[0].id
    extra = {"chat_template_kwargs": case.on}
    whole = client.responses.create(
        model=model, input="What is the capital?", temperature=0, extra_body=extra
    )
    thought, message = whole.output
    assert thought.type == "reasoning" and thought.id.startswith("rs_")
    assert [c.text for c in thought.content] == [case.reasoning]
    assert message.type == "message" and whole.output_text == case.content
    assert whole.usage.output_tokens_details.reasoning_tokens == case.reasoning_tokens

    events = list(
        client.responses.create(
            model=model, input="What is the capital?", temperature=0, stream=True, extra_body=extra
        )
    )
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == case.reasoning
    [done] = [e for e in events if e.type == "response.reasoning_text.done"]
    assert done.text == case.reasoning and done.output_index == 0
    first_text = next(i for i, e in enumerate(events) if e.type == "response.output_text.delta")
    last_thought = max(i for i, e in enumerate(events) if e.type.startswith("response.reasoning"))
    assert last_thought < first_text
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output_text == case.content

    # The reasoning item given back in input reaches the template as the turn's thinking.
    again = client.responses.create(
        model=model,
        input=[
            {"role": "user", "content": "What is the capital?"},
            *[item.model_dump(exclude_none=True) for item in whole.output],
            {"role": "user", "content": "What?"},
        ],
        temperature=0,
        extra_body=extra,
    )
    assert again.status == "completed"
    continued = client.responses.create(
        model=model, input="What?", previous_response_id=whole.id, temperature=0, extra_body=extra
    )
    assert continued.status == "completed"
    samples = read_metrics(server.base_url)
    assert any(
        k.startswith("pagefleet:reasoning_tokens_total") and v > 0 for k, v in samples.items()
    )


def test_bad_reasoning_fields_are_400s_naming_them(case):
    _, case, server = case
    url = f"{server.base_url}/v1/chat/completions"
    for body, param in [
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {str(i): i for i in range(33)}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"x": "y" * 20000}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": "on"}, "chat_template_kwargs"),
        ({"thinking_token_budget": -1}, "thinking_token_budget"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ]:
        response = httpx.post(url, json={"messages": QUESTION} | body, timeout=30)
        assert response.status_code == 400, body
        assert response.json()["error"]["param"] == param, body
