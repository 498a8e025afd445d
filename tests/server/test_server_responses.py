"""/v1/responses through the real `openai` SDK against the session's tool-calling pod
(`pagefleet serve` with the built-in model): text whole and streamed (events parsed by the
SDK's own stream helper), greedy text equal to /v1/chat/completions' for the same messages,
forced function calls whole and streamed, a tool result sent back, `.parse()` with a
pydantic model, a conversation continued by `previous_response_id`, `store: false`, a
stored response read back and deleted (`responses.retrieve`, `responses.delete`), ids in
OpenAI's shapes, and the refusals (unknown id 404, unsupported parts 400, errors naming
the Responses fields). The store's own bounds are tested on `ResponseStore` with a fake
clock."""

import json

import httpx
import jsonschema
import openai
import pytest
from pagefleet_serve.server.response_store import ResponseStore
from pydantic import BaseModel, Field

from tests.server.server_harness import assert_error, read_metrics
from tests.server.test_server_structured_tools import WEATHER as CHAT_WEATHER

MODEL_NAME = "smol"
# The chat tests' tool in the Responses API's flat shape.
WEATHER = {"type": "function", **CHAT_WEATHER["function"]}
ASK = "What is the weather in Paris right now?"


class City(BaseModel):
    name: str = Field(max_length=16)
    country: str = Field(max_length=16)


@pytest.fixture(scope="module")
def server(tools_pod):
    return tools_pod


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_text_whole_and_streamed_agree_and_stream_events_are_in_order(client):
    whole = client.responses.create(
        model=MODEL_NAME, input="Name a colour.", max_output_tokens=12, temperature=0
    )
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.status in ("completed", "incomplete")
    [message] = whole.output
    assert message.type == "message" and message.role == "assistant"
    assert whole.output_text and whole.output_text == message.content[0].text
    usage = whole.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 12
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0
    assert usage.output_tokens_details.reasoning_tokens == 0

    with client.responses.stream(
        model=MODEL_NAME, input="Name a colour.", max_output_tokens=12, temperature=0
    ) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    done = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        done,
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text  # greedy: the same text
    final = events[-1].response
    assert final.output_text == whole.output_text
    assert final.usage.output_tokens == usage.output_tokens
    assert final.usage.input_tokens == usage.input_tokens


def test_greedy_text_equals_the_chat_endpoint_for_the_same_messages(client):
    instructions = "You answer in one short sentence."
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[
            {"role": "system", "content": instructions},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        max_tokens=16,
        temperature=0,
    )
    response = client.responses.create(
        model=MODEL_NAME,
        instructions=instructions,
        input=[
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "What is the capital of France?"}],
            }
        ],
        max_output_tokens=16,
        temperature=0,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens


@pytest.mark.parametrize("tool_choice", [{"type": "function", "name": "get_weather"}, "required"])
def test_forced_function_call_whole_and_streamed(client, tool_choice):
    request = {
        "model": MODEL_NAME,
        "input": ASK,
        "tools": [WEATHER],
        "tool_choice": tool_choice,
        "max_output_tokens": 60,
        "temperature": 0,
    }
    whole = client.responses.create(**request)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert calls, whole.output
    for call in calls:
        assert call.name == "get_weather" and call.call_id and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])

    with client.responses.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    assert kinds[-1] == "response.completed"
    streamed = [item for item in final.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == "".join(c.arguments for c in streamed)
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"][:1]
    assert done.arguments == streamed[0].arguments

    if tool_choice == "required":
        return
    # The tool's result goes back as a function_call_output item; the model answers in text.
    call = calls[0]
    answer = client.responses.create(
        model=MODEL_NAME,
        input=[
            {"role": "user", "content": ASK},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "21 C, sunny"},
        ],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=12,
        temperature=0,
    )
    assert answer.output[0].type == "message" and answer.output_text
    assert answer.usage.input_tokens > whole.usage.input_tokens


def test_ids_have_openai_s_shapes_whole_and_streamed(client):
    def check(response) -> None:
        assert response.id.startswith("resp_")
        for item in response.output:
            if item.type == "message":
                assert item.id.startswith("msg_")
            else:
                assert item.id.startswith("fc_") and item.call_id.startswith("call_")

    ask = {"input": ASK, "tools": [WEATHER], "max_output_tokens": 60, "temperature": 0}
    for tool_choice in ("none", "required"):
        whole = client.responses.create(model=MODEL_NAME, tool_choice=tool_choice, **ask)
        check(whole)
        with client.responses.stream(model=MODEL_NAME, tool_choice=tool_choice, **ask) as stream:
            events = list(stream)
        check(events[-1].response)
        assert {e.response.id for e in events if hasattr(e, "response")} == {events[-1].response.id}
        item_ids = {e.item.id for e in events if e.type == "response.output_item.added"}
        assert item_ids == {item.id for item in events[-1].response.output}


def test_a_stored_response_is_retrieved_and_deleted(client, server):
    base = f"{server.base_url}/v1/responses"
    body = {"input": "Name a colour.", "max_output_tokens": 8, "temperature": 0}
    created = httpx.post(base, json=body, timeout=60)
    assert created.status_code == 200, created.text
    response_id = created.json()["id"]
    retrieved = httpx.get(f"{base}/{response_id}", timeout=30)
    assert retrieved.status_code == 200 and retrieved.json() == created.json()
    assert (
        client.responses.retrieve(response_id).output_text
        == created.json()["output"][0]["content"][0]["text"]
    )

    # A streamed response is kept as its last event has it.
    with client.responses.stream(model=MODEL_NAME, **body) as stream:
        final = list(stream)[-1].response
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()

    assert client.responses.delete(response_id) is None  # the SDK returns nothing...
    deleted = httpx.delete(f"{base}/{final.id}", timeout=30)  # ...OpenAI's body is this
    assert deleted.status_code == 200
    assert deleted.json() == {"id": final.id, "object": "response", "deleted": True}
    for gone in (response_id, final.id):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(gone)
        with pytest.raises(openai.NotFoundError):
            client.responses.delete(gone)
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model=MODEL_NAME, input="Again.", previous_response_id=gone)
        continued = httpx.post(
            base, json={"input": "Again.", "previous_response_id": gone}, timeout=30
        )
        assert_error(continued, 404, "previous_response_not_found", "previous_response_id")
        error = assert_error(httpx.get(f"{base}/{gone}", timeout=30), 404, "response_not_found")
        assert gone in error["message"]
        assert_error(httpx.delete(f"{base}/{gone}", timeout=30), 404, "response_not_found")

    unstored = client.responses.create(model=MODEL_NAME, store=False, **body)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    kept = client.responses.create(model=MODEL_NAME, **body)
    again = httpx.get(f"{base}/{kept.id}", params={"stream": "true"}, timeout=30)
    assert_error(again, 400, param="stream")


@pytest.mark.parametrize(
    ("body", "param", "starts"),
    [
        (  # refused as the request is read
            {
                "input": ASK,
                "text": {"format": {"type": "json_schema", "name": "c", "schema": {}}},
                "tools": [WEATHER],
                "tool_choice": "required",
            },
            "text",
            "text.format: cannot be combined with tool_choice",
        ),
        (  # refused as its grammar compiles, after the request was read
            {
                "input": "Hi.",
                "text": {
                    "format": {
                        "type": "json_schema",
                        "name": "s",
                        "schema": {"type": "string", "pattern": "(("},
                    }
                },
            },
            "text",
            "text.format: ",
        ),
        ({"input": "Hi.", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ],
)
def test_errors_name_the_responses_fields_not_the_chat_ones(server, body, param, starts):
    response = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=30)
    error = assert_error(response, 400, param=param)
    assert error["message"].startswith(starts), error
    assert "response_format" not in error["message"] and "max_tokens" not in error["message"]


def test_parse_with_a_pydantic_model_gives_a_parsed_object(client):
    response = client.responses.parse(
        model=MODEL_NAME,
        input="Give a city and its country as JSON.",
        text_format=City,
        max_output_tokens=60,
        temperature=0,
    )
    assert response.status == "completed"
    assert isinstance(response.output_parsed, City)
    assert City.model_validate_json(response.output_text) == response.output_parsed


def test_previous_response_id_continues_the_conversation(client, server):
    first = client.responses.create(
        model=MODEL_NAME, input="My name is Ada. Say hello.", max_output_tokens=16, temperature=0
    )
    second = client.responses.create(
        model=MODEL_NAME,
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=16,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    # The first turn's input and output are in the second's prompt.
    assert second.usage.input_tokens > first.usage.total_tokens
    # A continuation of a continuation carries both turns.
    third = client.responses.create(
        model=MODEL_NAME,
        input="Thanks.",
        previous_response_id=second.id,
        max_output_tokens=4,
        temperature=0,
    )
    assert third.usage.input_tokens > second.usage.total_tokens

    unstored = client.responses.create(
        model=MODEL_NAME, input="Hi.", store=False, max_output_tokens=4, temperature=0
    )
    for missing in (unstored.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model=MODEL_NAME, input="Again.", previous_response_id=missing)
        raw = httpx.post(
            f"{server.base_url}/v1/responses",
            json={"input": "Again.", "previous_response_id": missing},
            timeout=30,
        )
        error = assert_error(raw, 404, "previous_response_not_found", "previous_response_id")
        assert missing in error["message"]


@pytest.mark.parametrize(
    ("body", "param", "named"),
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
            "input_image",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input", "reasoning"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools", "web_search"),
        ({"input": "hi", "background": True}, "background", "background"),
        ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning", "reasoning"),
        ({"input": []}, "input", "empty"),
        ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text", "schema"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
            "input",
            "JSON",
        ),
    ],
)
def test_unsupported_or_bad_parts_are_400s_naming_them(server, body, param, named):
    response = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=30)
    error = assert_error(response, 400, param=param)
    assert named in error["message"]


def test_context_length_is_the_chat_endpoint_s_error(server):
    response = httpx.post(
        f"{server.base_url}/v1/responses",
        json={"input": "hello " * 600, "max_output_tokens": 1000},
        timeout=30,
    )
    assert_error(response, 400, "context_length_exceeded", "input")


def test_a_response_is_counted_in_the_request_metrics(client, server):
    def successes() -> float:
        samples = read_metrics(server.base_url)
        return sum(v for k, v in samples.items() if k.startswith("vllm:request_success_total"))

    before = successes()
    client.responses.create(model=MODEL_NAME, input="Hi.", max_output_tokens=3, temperature=0)
    assert successes() == before + 1


# -- the store -----------------------------------------------------------------------------
class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_store_evicts_the_least_recently_used_first():
    store: ResponseStore[str] = ResponseStore(max_entries=2, max_age_s=100, clock=_Clock())
    store.put("a", "A")
    store.put("b", "B")
    assert store.get("a") == "A"  # a is now the most recently used
    store.put("c", "C")
    assert store.ids() == ["a", "c"]
    assert store.get("b") is None


def test_store_forgets_entries_older_than_its_age_bound():
    clock = _Clock()
    store: ResponseStore[str] = ResponseStore(max_entries=10, max_age_s=60, clock=clock)
    store.put("a", "A")
    clock.now = 30
    store.put("b", "B")
    assert store.get("a") == "A"  # used, but its age counts from when it was stored
    clock.now = 61
    assert store.get("a") is None
    assert store.ids() == ["b"]
    clock.now = 95
    store.put("c", "C")  # b, expired at the cold end, goes
    assert store.ids() == ["c"]


def test_store_deletes_an_entry_once_and_not_an_expired_one():
    clock = _Clock()
    store: ResponseStore[str] = ResponseStore(max_entries=10, max_age_s=60, clock=clock)
    store.put("a", "A")
    store.put("b", "B")
    assert store.delete("a") and store.get("a") is None and store.ids() == ["b"]
    assert not store.delete("a") and not store.delete("unknown")
    clock.now = 61
    assert not store.delete("b") and store.ids() == []


def test_store_with_no_entries_is_off():
    store: ResponseStore[str] = ResponseStore(max_entries=0, max_age_s=60)
    store.put("a", "A")
    assert not store.enabled and store.get("a") is None and len(store) == 0
    with pytest.raises(ValueError, match="max_entries"):
        ResponseStore(max_entries=-1, max_age_s=60)
    with pytest.raises(ValueError, match="max_age_s"):
        ResponseStore(max_entries=1, max_age_s=0)
