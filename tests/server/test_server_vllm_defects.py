"""The five defects vLLM's own OpenAI-API tests found (issue 69), each through the real
`openai` SDK or raw HTTP against the session's tool-calling pod (`pagefleet serve` with the
built-in model):

1. `tool_choice: "required"` with parameters that use `$defs` and `$ref` (pydantic's nested
   models, `openai.pydantic_function_tool`) compiles and gives a call that validates.
2. A forced call cut by `max_tokens` is `tool_calls` with the partial arguments and
   `finish_reason: "length"`, no content, the same calls streamed and not.
3. `/v1/responses` with `top_logprobs` and `include: ["message.output_text.logprobs"]`
   returns the output text's logprobs, whole and streamed.
4. `stream_options` without `stream: true` is a 400 naming it.
5. `/v1/completions` with `logprobs: 0` has the sampled token's entry in `top_logprobs`.
"""

import json

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.server_harness import assert_error
from tests.server.test_server_structured_tools import forced_call

MODEL_NAME = "smol"


class Address(BaseModel):
    city: str = Field(max_length=12)
    country: str = Field(max_length=12)


class Trip(BaseModel):
    """Nested models: pydantic writes `Address` once under `$defs` and refers to it."""

    origin: Address
    destination: Address
    nights: int = Field(ge=1, le=9)


class Parcel(BaseModel):
    """Another tool whose `$defs` hold an `Address` too: each keeps its own."""

    recipient: Address
    weight_kg: int = Field(ge=1, le=99)


def test_required_tool_choice_with_a_nested_pydantic_model_gives_a_valid_call(tools_client):
    tools = [
        openai.pydantic_function_tool(Trip, name="plan_trip"),
        openai.pydantic_function_tool(Parcel, name="send_parcel"),
    ]
    assert all("$defs" in t["function"]["parameters"] for t in tools)  # what failed
    completion = tools_client.chat.completions.parse(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Plan a trip from Paris to Rome."}],
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=150,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    model = {"plan_trip": Trip, "send_parcel": Parcel}[call.function.name]
    assert isinstance(call.function.parsed_arguments, model)


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_a_forced_call_cut_by_max_tokens_is_the_same_partial_call_streamed_and_not(
    tools_client, tool_choice
):
    request = forced_call(tool_choice)
    # Cut three tokens before the call's end: inside its arguments.
    uncut = tools_client.chat.completions.create(**request)
    request["max_tokens"] = uncut.usage.completion_tokens - 3
    whole = tools_client.chat.completions.create(**request).choices[0]
    assert whole.finish_reason == "length"
    assert whole.message.content is None
    assert whole.message.tool_calls, whole.message
    arguments = whole.message.tool_calls[0].function.arguments
    assert arguments.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(arguments)  # cut short: the partial arguments, as vLLM sends them
    streamed: dict[int, list[str]] = {}  # index -> [name, arguments]
    finish_reasons = []
    for chunk in tools_client.chat.completions.create(**request, stream=True):
        choice = chunk.choices[0]
        assert not choice.delta.content
        finish_reasons.append(choice.finish_reason)
        for call in choice.delta.tool_calls or []:
            entry = streamed.setdefault(call.index, ["", ""])
            entry[0] += call.function.name or ""
            entry[1] += call.function.arguments or ""
    assert finish_reasons[-1] == "length"
    assert [[c.function.name, c.function.arguments] for c in whole.message.tool_calls] == [
        streamed[i] for i in sorted(streamed)
    ]


def test_responses_with_top_logprobs_include_the_output_text_s_logprobs(tools_client):
    request = {
        "model": MODEL_NAME,
        "input": "Name a colour.",
        "max_output_tokens": 5,
        "temperature": 0,
        "top_logprobs": 2,
        "include": ["message.output_text.logprobs"],
    }
    whole = tools_client.responses.create(**request)
    [part] = whole.output[0].content
    assert "".join(entry.token for entry in part.logprobs) == part.text
    for entry in part.logprobs:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token  # greedy: the likeliest
    with tools_client.responses.stream(**request) as stream:
        events = list(stream)
    streamed = [
        entry
        for event in events
        if event.type == "response.output_text.delta"
        for entry in event.logprobs
    ]
    # (The same values but for the last bits: the prompt now comes from the prefix cache.)
    assert [(e.token, e.logprob) for e in streamed] == [
        (e.token, pytest.approx(e.logprob, abs=1e-4)) for e in part.logprobs
    ]
    final = events[-1]
    assert final.type in ("response.completed", "response.incomplete")
    kept = final.response.output[0].content[0].logprobs
    assert [(e.token, e.logprob) for e in kept] == [(e.token, e.logprob) for e in streamed]


def test_responses_refuse_other_includes_by_name(tools_pod):
    response = httpx.post(
        f"{tools_pod.base_url}/v1/responses",
        json={"input": "hi", "include": ["reasoning.encrypted_content"]},
        timeout=30,
    )
    error = assert_error(response, 400, "unsupported_field", "include")
    assert "reasoning.encrypted_content" in error["message"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
    ],
    ids=["chat", "completions"],
)
@pytest.mark.parametrize("stream", [False, None], ids=["false", "absent"])
def test_stream_options_without_stream_is_a_400(tools_pod, path, body, stream):
    body = body | {"max_tokens": 2, "stream_options": {"include_usage": True}}
    if stream is not None:
        body["stream"] = stream
    response = httpx.post(f"{tools_pod.base_url}{path}", json=body, timeout=30)
    error = assert_error(response, 400, param="stream_options")
    assert "stream" in error["message"]


def test_completions_logprobs_0_give_the_sampled_token_s_entry(tools_client):
    completion = tools_client.completions.create(
        model=MODEL_NAME, prompt="The sky is", max_tokens=4, temperature=0, logprobs=0
    )
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.top_logprobs) == 4
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert top == {token: logprob}
