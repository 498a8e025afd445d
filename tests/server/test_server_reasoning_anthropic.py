"""Anthropic's Messages API on reasoning models, through the real `anthropic` SDK against a
server on each scripted reasoning checkpoint of tests/server/test_server_reasoning.py
(qwen3, deepseek_r1, granite, gpt_oss): the thinking is a `thinking` block before the
text, equal to chat's `reasoning`; streamed, its `thinking_delta` events fill a block of
their own (its `signature_delta` last) before the text block's; `thinking: {"type":
"enabled", "budget_tokens": N}` is chat's thinking budget, `adaptive` switches the
thinking on and `disabled` off through the parser's template variable (count_tokens
follows), no `thinking` leaves the template's default; an earlier turn's thinking blocks
reach the template as that turn's reasoning; bad thinking settings are 400s in
Anthropic's shape."""

from __future__ import annotations

import anthropic
import openai
import pytest
from pagefleet_serve.server.anthropic_protocol import MessagesRequest

from tests.server.test_server_reasoning import QUESTION, case  # noqa: F401 (the fixture)

ON = {"type": "adaptive"}
OFF = {"type": "disabled"}
ANSWER = "The capital is Paris."
# This SDK's methods no longer take sampling fields; the server still reads them.
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture
def client(case):  # noqa: F811 (the fixture imported above)
    _, _, server = case
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


def model_name(server) -> str:
    return server.state.settings.model_name


def create(client, server, **extra):
    return client.messages.create(
        model=model_name(server), max_tokens=40, messages=QUESTION, **extra, **GREEDY
    )


def chat(server, messages=QUESTION, **template_kwargs):
    """The same conversation on /v1/chat/completions, greedy."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(
        model=model_name(server),
        messages=messages,
        temperature=0,
        max_tokens=40,
        extra_body={"chat_template_kwargs": template_kwargs},
    )


def blocks(message) -> list[tuple[str, str]]:
    return [(b.type, b.thinking if b.type == "thinking" else b.text) for b in message.content]


def test_the_thinking_is_a_block_before_the_text_as_chat_s_reasoning(case, client):  # noqa: F811
    _, case, server = case
    message = create(client, server, thinking=ON)
    thought, text = message.content
    assert (thought.type, thought.thinking, thought.signature) == ("thinking", case.reasoning, "")
    assert (text.type, text.text) == ("text", case.content)
    assert message.stop_reason == "end_turn"
    # adaptive is the parser's own switch turned on, as a chat request would send it
    switch = server.state.reasoning_parser.switch
    completion = chat(server, **{switch: True})
    assert completion.choices[0].message.reasoning == thought.thinking
    assert completion.choices[0].message.content == text.text
    assert message.usage.input_tokens == completion.usage.prompt_tokens
    assert message.usage.output_tokens == completion.usage.completion_tokens

    # Without `thinking`, the template's default: what chat gives without template kwargs
    # (granite's template thinks only when asked).
    plain = chat(server).choices[0].message
    reasoning = getattr(plain, "reasoning", None)  # absent where the output did not think
    expected = [("thinking", reasoning)] if reasoning else []
    assert blocks(create(client, server)) == expected + [("text", plain.content)]


def test_streamed_thinking_fills_its_own_block_before_the_text(case, client):  # noqa: F811
    _, case, server = case
    with client.messages.stream(
        model=model_name(server), max_tokens=40, messages=QUESTION, thinking=ON, **GREEDY
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    raw = [e for e in events if e.type.startswith("content_block")]
    kinds = [
        (
            e.type.removeprefix("content_block_"),
            e.index,
            e.delta.type if e.type.endswith("delta") else "",
        )
        for e in raw
    ]
    thinking_deltas = kinds.count(("delta", 0, "thinking_delta"))
    text_deltas = kinds.count(("delta", 1, "text_delta"))
    assert thinking_deltas >= 1 and text_deltas >= 1
    assert kinds == (
        [("start", 0, "")]
        + [("delta", 0, "thinking_delta")] * thinking_deltas
        + [("delta", 0, "signature_delta"), ("stop", 0, ""), ("start", 1, "")]
        + [("delta", 1, "text_delta")] * text_deltas
        + [("stop", 1, "")]
    )
    assert [e.content_block.type for e in raw if e.type == "content_block_start"] == [
        "thinking",
        "text",
    ]
    deltas = [e.delta for e in raw if e.type == "content_block_delta"]
    thinking = "".join(d.thinking for d in deltas if d.type == "thinking_delta")
    text = "".join(d.text for d in deltas if d.type == "text_delta")
    assert (thinking, text) == (case.reasoning, case.content)
    whole = create(client, server, thinking=ON)
    assert blocks(final) == blocks(whole)
    assert final.content[0].signature == ""
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_budget_tokens_is_the_thinking_budget(case, client):  # noqa: F811
    _, case, server = case
    budget = {"type": "enabled", "budget_tokens": case.budget}
    thought, text = create(client, server, thinking=budget).content
    assert thought.thinking == case.budgeted_reasoning
    assert text.text.strip() == ANSWER


def test_disabled_switches_the_thinking_off_and_count_tokens_follows(case, client):  # noqa: F811
    _, _, server = case
    off = create(client, server, thinking=OFF)
    assert blocks(off) == [("text", ANSWER)]
    on = create(client, server, thinking=ON)
    for thinking, message in [(OFF, off), (ON, on)]:
        counted = client.messages.count_tokens(
            model=model_name(server), messages=QUESTION, thinking=thinking
        )
        assert counted.input_tokens == message.usage.input_tokens
    # display "omitted": no thinking block (this server has no signature to give alone)
    omitted = create(client, server, thinking=ON | {"display": "omitted"})
    assert blocks(omitted) == blocks(on)[1:]
    assert omitted.usage.output_tokens == on.usage.output_tokens


def test_an_earlier_turn_s_thinking_blocks_are_its_reasoning(case, client):  # noqa: F811
    _, case, server = case
    first = create(client, server, thinking=ON)
    turns = [
        *QUESTION,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": "What?"},
    ]
    again = client.messages.create(
        model=model_name(server), max_tokens=40, messages=turns, thinking=ON, **GREEDY
    )
    assert again.stop_reason in ("end_turn", "max_tokens")
    counted = client.messages.count_tokens(model=model_name(server), messages=turns, thinking=ON)
    # chat with the thinking as the assistant message's reasoning renders the same prompt
    thought, text = first.content
    assistant = {"role": "assistant", "content": text.text, "reasoning": thought.thinking}
    completion = chat(
        server, [*QUESTION, assistant, turns[-1]], **{server.state.reasoning_parser.switch: True}
    )
    assert counted.input_tokens == completion.usage.prompt_tokens == again.usage.input_tokens
    # (these templates leave an earlier turn's reasoning out: the chat message it becomes)
    [_, message, _] = MessagesRequest(max_tokens=4, messages=turns).chat_request(None).messages
    assert (message.reasoning, message.content) == (thought.thinking, text.text)


def test_bad_thinking_settings_are_400s_naming_them(case, client):  # noqa: F811
    _, _, server = case
    for thinking, named in [
        ({"type": "between_tools"}, "thinking.type"),
        ({"type": "enabled"}, "thinking.budget_tokens"),
        ({"type": "adaptive", "budget_tokens": 5}, "thinking.budget_tokens"),
        ({"type": "enabled", "budget_tokens": -1}, "thinking.budget_tokens"),
        ({"type": "adaptive", "display": "full"}, "thinking.display"),
    ]:
        with pytest.raises(anthropic.BadRequestError) as bad:
            create(client, server, thinking=thinking)
        assert bad.value.body["error"]["type"] == "invalid_request_error", thinking
        assert bad.value.body["error"]["message"].startswith(named), thinking
    with pytest.raises(anthropic.BadRequestError) as reserved:
        client.messages.create(
            model=model_name(server),
            max_tokens=4,
            messages=QUESTION,
            extra_body={"chat_template_kwargs": {"add_generation_prompt": False}},
        )
    assert reserved.value.body["error"]["message"].startswith("chat_template_kwargs")
