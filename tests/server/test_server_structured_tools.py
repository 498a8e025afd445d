"""Structured outputs, tool calling and the tokenizer endpoints through the real `openai`
SDK against a `pagefleet serve` subprocess with the built-in model: `.parse()` with a
pydantic model (stream and not) for 20 prompts, json_object, regex and choice on
/v1/completions, vLLM's structural_tag response format, a 400 for a schema that cannot
compile, tool calls with tool_choice required and named whose arguments validate, a
follow-up turn with the tool's result, streamed tool calls (the name first, then argument
fragments as they are generated) assembled by the SDK into the non-stream calls,
/tokenize, /detokenize and /v1/models' max_model_len."""

import asyncio
import json
import re
from enum import Enum
from typing import Annotated

import httpx
import jsonschema
import openai
import pytest
from pagefleet_serve.server.errors import APIError
from pagefleet_serve.server.protocol import ChatCompletionRequest, parse
from pagefleet_serve.structured.constraint import structural_tag_text
from pydantic import BaseModel, Field

MODEL_NAME = "smol"
MAX_MODEL_LEN = 1024


class Mood(str, Enum):
    happy = "happy"
    sad = "sad"
    calm = "calm"


class Place(BaseModel):
    city: str = Field(max_length=12)
    country: str = Field(max_length=12)


class Note(BaseModel):
    """Nested objects, an enum, an array and required fields; strings kept short so that
    the small model finishes each object well within max_tokens (60 characters of strings
    at most: about 200 tokens even when it writes them in Japanese)."""

    topic: str = Field(max_length=16)
    mood: Mood
    place: Place
    keywords: list[Annotated[str, Field(max_length=10)]] = Field(max_length=2)


PROMPTS = [
    f"Write a short note about {topic} as JSON."
    for topic in (
        "a rainy day in Paris",
        "a picnic in Rome",
        "snow in Oslo",
        "the sea at Lisbon",
        "a market in Tokyo",
        "a museum in Madrid",
        "a bakery in Vienna",
        "a concert in Berlin",
        "a storm over Dublin",
        "spring in Kyoto",
        "a train to Milan",
        "a bridge in Prague",
        "coffee in Istanbul",
        "a park in London",
        "a beach in Sydney",
        "a mountain near Zurich",
        "a river in Cairo",
        "a festival in Rio",
        "a library in Boston",
        "night in Seoul",
    )
]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def forced_call(tool_choice) -> dict:
    """A greedy chat request for ASK whose tool_choice forces a call of WEATHER or TIME."""
    return {
        "model": MODEL_NAME,
        "messages": ASK,
        "tools": [WEATHER, TIME],
        "tool_choice": tool_choice,
        "max_tokens": 80,
        "temperature": 0,
    }


@pytest.fixture(scope="module")
def server(tools_pod):
    """The session's tool-calling pod: served name "smol", MAX_MODEL_LEN tokens, 20
    sequences, auto tool choice with the hermes parser."""
    return tools_pod


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_parse_with_a_pydantic_model_for_20_prompts_stream_and_not(server):
    async def run() -> list:
        client = openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0
        )

        async def whole(prompt: str):
            completion = await client.chat.completions.parse(
                model=MODEL_NAME,
                messages=[{"role": "user", "content": prompt}],
                response_format=Note,
                max_tokens=256,
                temperature=0,
            )
            return completion.choices[0]

        async def streamed(prompt: str):
            async with client.chat.completions.stream(
                model=MODEL_NAME,
                messages=[{"role": "user", "content": prompt}],
                response_format=Note,
                max_tokens=256,
                temperature=0,
            ) as stream:
                return (await stream.get_final_completion()).choices[0]

        return await asyncio.gather(*[f(p) for p in PROMPTS for f in (whole, streamed)])

    choices = asyncio.run(run())
    assert len(choices) == 2 * len(PROMPTS)
    for choice in choices:
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Note), choice.message
        Note.model_validate_json(choice.message.content)
    # Greedy: the stream carries the same object as the whole response.
    for whole, streamed in zip(choices[::2], choices[1::2], strict=True):
        assert whole.message.parsed == streamed.message.parsed


def test_json_object_output_always_parses(client):
    for question in (
        "Give a JSON object with a name and an age.",
        'Reply with a JSON object with keys "name" and "age" for Ann, aged 30.',
        'Output a JSON object with one key "ok" set to true.',
    ):
        completion = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": question}],
            response_format={"type": "json_object"},
            max_tokens=100,
            temperature=0,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(json.loads(choice.message.content), dict)


def test_regex_and_choice_on_completions_always_match(client):
    date = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
    regex = client.completions.create(
        model=MODEL_NAME,
        prompt=["The moon landing happened on", "The date today is"],
        max_tokens=16,
        n=2,
        temperature=1.0,
        seed=5,
        extra_body={"guided_regex": date},
    )
    choices = ("yes", "no", "maybe")
    choice = client.completions.create(
        model=MODEL_NAME,
        prompt=["Is water wet? Answer:", "Is fire cold? Answer:"],
        max_tokens=4,
        n=2,
        temperature=1.0,
        seed=5,
        extra_body={"structured_outputs": {"choice": list(choices)}},
    )
    assert len(regex.choices) == len(choice.choices) == 4
    for c in regex.choices:
        assert re.fullmatch(date, c.text) and c.finish_reason == "stop", c
    for c in choice.choices:
        assert c.text in choices and c.finish_reason == "stop", c


def test_max_tokens_before_the_grammar_completes_is_length(client):
    completion = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "note", "schema": Note.model_json_schema(), "strict": True},
        },
        max_tokens=5,
        temperature=0,
    )
    assert completion.choices[0].finish_reason == "length"


def test_a_schema_that_cannot_compile_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model=MODEL_NAME,
            prompt="hi",
            max_tokens=4,
            extra_body={"guided_json": {"type": "object", "properties": {"a": {"type": "nope"}}}},
        )
    error = caught.value.body
    assert error["param"] == "guided_json", error
    assert "cannot be compiled" in error["message"] and "nope" in error["message"], error


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "f0"}}]
)
def test_tools_too_large_to_constrain_are_a_400_naming_tools(client, tool_choice):
    """Over the constraint size bound (2,000 tools, or one 256 KiB schema): the request's
    fault, not a server error."""
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(12000)}}
    tools = [{"type": "function", "function": {"name": "f0", "parameters": big}}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL_NAME, messages=ASK, max_tokens=4, tools=tools, tool_choice=tool_choice
        )
    error = caught.value.body
    assert error["param"] == "tools", error
    assert "at most" in error["message"], error


def test_a_structural_tag_response_format(client):
    """vLLM's `structural_tag` response format: here the answer between tags, as JSON;
    one that cannot compile is a 400 naming the field."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    tag = {"type": "tag", "begin": "<answer>", "end": "</answer>"}
    tag["content"] = {"type": "json_schema", "json_schema": schema}
    completion = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Is water wet? Answer in JSON."}],
        max_tokens=30,
        temperature=0,
        extra_body={"response_format": {"type": "structural_tag", "format": tag}},
    )
    text = completion.choices[0].message.content
    assert text.startswith("<answer>") and text.endswith("</answer>"), text
    jsonschema.validate(json.loads(text.removeprefix("<answer>").removesuffix("</answer>")), schema)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=ASK,
            max_tokens=4,
            extra_body={"response_format": {"type": "structural_tag", "format": {"type": "nope"}}},
        )
    assert caught.value.body["param"] == "response_format", caught.value.body
    assert "nope" in caught.value.body["message"], caught.value.body


def structural_tag_of(extra: dict) -> str:
    body = {"messages": ASK} | extra
    return parse(ChatCompletionRequest, json.dumps(body).encode()).constraint().structural_tag


def test_structural_tag_in_each_form_vllm_takes():
    fmt = {"type": "tag", "begin": "<a>", "content": {"type": "json_schema", "json_schema": {}}}
    fmt["end"] = "</a>"
    current = {"type": "structural_tag", "format": fmt}
    legacy = {"structures": [{"begin": "<f=x>", "schema": {"type": "object"}, "end": "</f>"}]}
    legacy["triggers"] = ["<f="]
    assert structural_tag_of({"response_format": current}) == structural_tag_text(current)
    assert structural_tag_of(
        {"structured_outputs": {"structural_tag": json.dumps(current)}}
    ) == structural_tag_text(current)
    assert structural_tag_of(
        {"response_format": {"type": "structural_tag", **legacy}}
    ) == structural_tag_text(legacy)
    assert json.loads(structural_tag_text(legacy))["format"]["type"] == "triggered_tags"
    for extra, field in [
        ({"response_format": {"type": "structural_tag"}}, "response_format"),
        ({"structured_outputs": {"structural_tag": "{not json"}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": '{"structures": [{}]}'}}, "structured_outputs"),
    ]:
        with pytest.raises(APIError) as caught:
            structural_tag_of(extra)
        assert (caught.value.status_code, caught.value.param) == (400, field)


def assert_calls_validate(message, names: set[str]) -> None:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_tool_call_round_trip(client, tool_choice):
    first = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    )
    choice = first.choices[0]
    named = isinstance(tool_choice, dict)
    assert_calls_validate(choice.message, {"get_weather"} if named else set(SCHEMAS))
    assert len(choice.message.tool_calls) == 1
    assert choice.finish_reason == ("stop" if named else "tool_calls")
    call = choice.message.tool_calls[0]
    follow_up = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[
            *ASK,
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'},
        ],
        tools=[WEATHER, TIME],
        tool_choice="none",
        max_tokens=12,
        temperature=0,
    )
    answer = follow_up.choices[0]
    assert answer.finish_reason in ("stop", "length")
    assert answer.message.content and not answer.message.tool_calls


@pytest.mark.parametrize(
    ("tool_choice", "finish_reason"),
    [("required", "tool_calls"), ({"type": "function", "function": {"name": "get_time"}}, "stop")],
    ids=["required", "named"],
)
def test_streamed_tool_calls_assemble_into_the_same_calls(client, tool_choice, finish_reason):
    # logprobs: they mark the chunks that carry newly generated tokens
    request = forced_call(tool_choice) | {"logprobs": True}
    whole = client.chat.completions.create(**request).choices[0].message
    # Argument fragments per call that came with the tokens they were generated from (a
    # stream that waited for the whole call would send them all after the last token).
    live_fragments: dict[int, int] = {}
    with client.chat.completions.stream(**request) as stream:
        for event in stream:
            if event.type != "chunk" or not event.chunk.choices:
                continue
            choice = event.chunk.choices[0]
            for call in choice.delta.tool_calls or []:
                if call.id:  # a call's first delta: its name, before any argument
                    assert call.function.name and not call.function.arguments
                elif call.function.arguments and choice.logprobs and choice.logprobs.content:
                    live_fragments[call.index] = live_fragments.get(call.index, 0) + 1
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == finish_reason
    assert_calls_validate(streamed.message, set(SCHEMAS))
    assert len(live_fragments) == len(streamed.message.tool_calls), live_fragments
    assert all(n > 1 for n in live_fragments.values()), live_fragments
    # The fragments join into the very text of the whole response's arguments.
    assert [(c.function.name, c.function.arguments) for c in whole.tool_calls] == [
        (c.function.name, c.function.arguments) for c in streamed.message.tool_calls
    ]


def test_auto_tool_choice_answers_without_a_server_error(client):
    # SmolLM2's template does not render tools, so the model answers in words; the
    # hermes parser then finds no call and the text is the content.
    completion = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=[WEATHER], max_tokens=12, temperature=0
    )
    message = completion.choices[0].message
    assert message.content and not message.tool_calls


def test_tokenize_detokenize_and_models(server, client):
    base = server.base_url
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, max_tokens=1, temperature=0
    )
    tokenized = httpx.post(f"{base}/tokenize", json={"model": MODEL_NAME, "messages": ASK}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) == chat.usage.prompt_tokens
    assert tokenized["max_model_len"] == MAX_MODEL_LEN
    text = "Paged attention, tokenized."
    plain = httpx.post(f"{base}/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert len(plain["token_strs"]) == plain["count"]
    back = httpx.post(f"{base}/detokenize", json={"tokens": plain["tokens"]}).json()
    assert back == {"prompt": text}
    bad = httpx.post(f"{base}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    [model] = client.models.list().data
    assert model.model_extra["max_model_len"] == MAX_MODEL_LEN
