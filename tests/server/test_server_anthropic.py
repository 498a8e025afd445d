"""Anthropic's Messages API through the real `anthropic` SDK against a `pagefleet serve`
pod (built-in model, an API key, auto tool choice with the hermes parser):
`messages.create` (greedy text equal to the chat endpoint's for the same messages),
`messages.stream` (text deltas joining into the final message), a tool round trip with
`tool_use` and `tool_result` blocks (streamed tool input equal to the whole one),
`count_tokens` equal to the usage a request reports, stop sequences, and the errors in
Anthropic's shape (`x-api-key` and bearer auth, a bad block, an unknown model, the
context); `thinking` on a model without a reasoning parser (thinking blocks of reasoning
models: test_server_reasoning_anthropic.py)."""

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.server.server_harness import ServerProcess, read_metrics
from tests.server.test_server_structured_tools import WEATHER as CHAT_WEATHER

KEY = "sk-anthropic-test"
MODEL_NAME = "smol"
HELLO = [{"role": "user", "content": "Name three colours."}]
# The chat tests' tool in the Messages API's shape.
WEATHER = {
    "name": CHAT_WEATHER["function"]["name"],
    "description": CHAT_WEATHER["function"]["description"],
    "input_schema": CHAT_WEATHER["function"]["parameters"],
}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
# This SDK's methods no longer take sampling fields; the server still reads them.
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def server():
    process = ServerProcess(
        "--api-key",
        KEY,
        "--served-model-name",
        MODEL_NAME,
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        "128MiB",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    )
    try:
        yield process.wait_ready()
    finally:
        process.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0)


def test_create_gives_the_chat_endpoint_s_greedy_text(server, client):
    message = client.messages.create(model=MODEL_NAME, max_tokens=12, messages=HELLO, **GREEDY)
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == MODEL_NAME
    [block] = message.content
    assert block.type == "text" and block.text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 0 and 0 < message.usage.output_tokens <= 12
    chat = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)
    completion = chat.chat.completions.create(
        model=MODEL_NAME, messages=HELLO, max_tokens=12, temperature=0
    )
    assert block.text == completion.choices[0].message.content
    assert message.usage.input_tokens == completion.usage.prompt_tokens


def test_a_system_prompt_and_stop_sequences(client):
    kwargs = {"model": MODEL_NAME, "max_tokens": 24, "messages": HELLO, **GREEDY}
    plain = client.messages.create(**kwargs).content[0].text
    words = plain.split()
    assert len(words) > 2
    stopped = client.messages.create(**kwargs, stop_sequences=["zzz", words[2]])
    cut = stopped.content[0].text
    assert words[2] not in cut and plain.startswith(cut)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", words[2])
    with client.messages.stream(**kwargs, stop_sequences=[words[2]]) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].text == cut
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", words[2])
    with_system = client.messages.create(**kwargs, system="Answer in French.")
    counted = client.messages.count_tokens(
        model=MODEL_NAME, messages=HELLO, system="Answer in French."
    )
    # (SmolLM2's template writes a default system prompt when none is given.)
    default = client.messages.count_tokens(model=MODEL_NAME, messages=HELLO)
    assert with_system.usage.input_tokens == counted.input_tokens != default.input_tokens


def test_stream_text_deltas_join_into_the_final_message(client):
    with client.messages.stream(
        model=MODEL_NAME, max_tokens=12, messages=HELLO, **GREEDY
    ) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1
    whole = client.messages.create(model=MODEL_NAME, max_tokens=12, messages=HELLO, **GREEDY)
    assert "".join(pieces) == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_raw_stream_events_are_in_anthropic_s_order(server):
    body = {"model": MODEL_NAME, "max_tokens": 5, "messages": HELLO, "stream": True}
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    with httpx.stream(
        "POST", f"{server.base_url}/v1/messages", json=body, headers=headers, timeout=60
    ) as response:
        kinds = [
            line.removeprefix("event: ")
            for line in response.iter_lines()
            if line.startswith("event: ")
        ]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_tool_round_trip(client, tool_choice):
    first = client.messages.create(
        model=MODEL_NAME,
        max_tokens=80,
        messages=ASK,
        tools=[WEATHER],
        tool_choice=tool_choice,
        **GREEDY,
    )
    [call] = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER["input_schema"])
    assert first.stop_reason == "tool_use"  # Anthropic's, a named tool's too
    with client.messages.stream(
        model=MODEL_NAME,
        max_tokens=80,
        messages=ASK,
        tools=[WEATHER],
        tool_choice=tool_choice,
        **GREEDY,
    ) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [
        (call.name, call.input)
    ]
    answer = client.messages.create(
        model=MODEL_NAME,
        max_tokens=12,
        messages=[
            *ASK,
            {"role": "assistant", "content": [c.model_dump() for c in first.content]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": call.id, "content": "18 degrees"}
                ],
            },
        ],
        tools=[WEATHER],
        tool_choice={"type": "none"},
        **GREEDY,
    )
    assert answer.content[0].type == "text" and answer.content[0].text


def test_count_tokens_is_the_input_a_request_reports(client):
    for extra in ({}, {"tools": [WEATHER], "system": "Be brief."}):
        counted = client.messages.count_tokens(model=MODEL_NAME, messages=ASK, **extra)
        created = client.messages.create(
            model=MODEL_NAME,
            max_tokens=1,
            messages=ASK,
            **GREEDY,
            tool_choice={"type": "none"} if extra else anthropic.NOT_GIVEN,
            **extra,
        )
        assert counted.input_tokens == created.usage.input_tokens > 0


def test_auth_by_x_api_key_or_bearer_and_errors_in_anthropic_s_shape(server, client):
    bearer = anthropic.Anthropic(base_url=server.base_url, auth_token=KEY, max_retries=0)
    assert bearer.messages.count_tokens(model=MODEL_NAME, messages=HELLO).input_tokens > 0
    wrong = anthropic.Anthropic(base_url=server.base_url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(model=MODEL_NAME, max_tokens=4, messages=HELLO)
    assert refused.value.body["error"]["type"] == "authentication_error"
    image = [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}}
    ]
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(
            model=MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": image}]
        )
    assert bad.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": bad.value.body["error"]["message"]},
    }
    assert "'image'" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="other", max_tokens=4, messages=HELLO)
    assert missing.value.body["error"]["type"] == "not_found_error"
    too_long = [{"role": "user", "content": "word " * 1200}]
    with pytest.raises(anthropic.BadRequestError) as context:
        client.messages.create(model=MODEL_NAME, max_tokens=4, messages=too_long)
    assert "context length" in context.value.body["error"]["message"]
    raw = httpx.post(
        f"{server.base_url}/v1/messages",
        json={"model": MODEL_NAME, "messages": HELLO},
        headers={"x-api-key": KEY},
        timeout=30,
    )
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in raw.json()["error"]["message"]
    # The OpenAI routes keep OpenAI's shape.
    openai_shape = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"messages": "hi"},
        headers={"x-api-key": KEY},
        timeout=30,
    )
    assert set(openai_shape.json()["error"]) == {"message", "type", "param", "code"}


def test_thinking_on_a_model_whose_thinking_the_server_does_not_read(client):
    kwargs = {"model": MODEL_NAME, "max_tokens": 8, "messages": HELLO, **GREEDY}
    plain = client.messages.create(**kwargs)
    # disabled and adaptive switch nothing: no reasoning parser, no template variable
    for thinking in ({"type": "disabled"}, {"type": "adaptive"}):
        message = client.messages.create(**kwargs, thinking=thinking)
        assert [b.type for b in message.content] == ["text"]
        assert message.content[0].text == plain.content[0].text
    with pytest.raises(anthropic.BadRequestError) as budget:
        client.messages.create(**kwargs, thinking={"type": "enabled", "budget_tokens": 1024})
    message = budget.value.body["error"]["message"]
    assert message.startswith("thinking.budget_tokens") and "--reasoning-parser" in message


def test_messages_count_in_the_request_metrics(server, client):
    def finished(samples: dict) -> float:
        return sum(v for k, v in samples.items() if k.startswith("vllm:request_success_total"))

    before = read_metrics(server.base_url)
    message = client.messages.create(model=MODEL_NAME, max_tokens=2, messages=HELLO)
    after = read_metrics(server.base_url)
    assert finished(after) == finished(before) + 1
    generated = "vllm:generation_tokens_total"
    assert after[generated] - before[generated] == message.usage.output_tokens
