"""Tool-call parsers on model-shaped texts, whole and streamed: several calls, nested JSON,
text before the call, and malformed output that comes back as plain content (never an
error); the stream's deltas assemble into the same calls as the whole text."""

import json

import pytest
from pagefleet_serve.server.tool_parsers import TOOL_CALL_PARSERS
from pagefleet_serve.server.tools import NamedToolCall, RequiredToolCalls, ToolCallStream, ToolPlan

NESTED = {"filter": {"city": "Paris", "tags": ["a", "b"], "range": {"min": 1, "max": 2.5}}}

# (parser, text, expected content, expected [(name, arguments)])
CASES = [
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "hermes",
        "Let me check both.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
        f'{{"name": "search", "arguments": {json.dumps(NESTED)}}}\n</tool_call>',
        "Let me check both.\n",
        [("get_weather", {"city": "Paris"}), ("search", NESTED)],
    ),
    (  # stopped at EOS before closing the tag
        "hermes",
        '<tool_call>\n{"name": "get_time", "arguments": {}}',
        None,
        [("get_time", {})],
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        f'{{"name": "search", "parameters": {json.dumps(NESTED)}}}',
        None,
        [("get_weather", {"city": "Paris"}), ("search", NESTED)],
    ),
    (
        "llama3_json",
        'Sure! {"name": "get_weather", "parameters": {"city": "Paris"}}',
        "Sure! ",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        f'{{"name": "search", "arguments": {json.dumps(NESTED)}}}]',
        None,
        [("get_weather", {"city": "Paris"}), ("search", NESTED)],
    ),
    (
        "mistral",
        'I will look.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
        f"[TOOL_CALLS]search[ARGS]{json.dumps(NESTED)}",
        "I will look.",
        [("get_weather", {"city": "Paris"}), ("search", NESTED)],
    ),
]

MALFORMED = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),
    ("hermes", "<tool_call>\nnot json\n</tool_call>"),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call> and then more text'),
    ("llama3_json", '{"name": "get_weather", "parameters": [1, 2]}'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}'),
    ("mistral", '[TOOL_CALLS]{"name": "f", "arguments": {}}'),  # not an array
    ("mistral", "[TOOL_CALLS][{]"),
]

PLAIN = ["The weather in Paris is sunny.", "Use <b>tags</b> or {braces} freely.", ""]


def calls_of(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def streamed(parser, text: str, piece: int = 3) -> tuple[str | None, list]:
    """Feed `text` in pieces; assemble the deltas as the OpenAI SDK does."""
    stream = ToolCallStream(ToolPlan(parser, None, None))
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)] or [""]
    content, calls = None, {}
    for i, chunk in enumerate(pieces):
        for delta in stream.feed(chunk, finished=i == len(pieces) - 1):
            if "content" in delta:
                content = (content or "") + delta["content"]
            for call in delta.get("tool_calls", []):
                entry = calls.setdefault(call["index"], {"name": "", "arguments": "", "id": None})
                entry["id"] = call.get("id", entry["id"])
                entry["name"] += call.get("function", {}).get("name", "")
                entry["arguments"] += call.get("function", {}).get("arguments", "")
    assert all(e["id"] for e in calls.values())
    return content, [(e["name"], json.loads(e["arguments"])) for _, e in sorted(calls.items())]


@pytest.mark.parametrize(("name", "text", "content", "expected"), CASES)
def test_calls_are_parsed_whole_and_streamed(name, text, content, expected):
    parser = TOOL_CALL_PARSERS[name]()
    got_content, calls = parser.parse(text)
    assert (got_content, calls_of(calls)) == (content, expected)
    assert len({c.id for c in calls}) == len(calls)
    streamed_content, streamed_calls = streamed(parser, text)
    assert streamed_calls == expected
    assert (streamed_content or None) == (content or None)


@pytest.mark.parametrize(("name", "text"), MALFORMED)
def test_malformed_calls_come_back_as_plain_content(name, text):
    parser = TOOL_CALL_PARSERS[name]()
    assert parser.parse(text) == (text, [])
    assert streamed(parser, text) == (text, [])


@pytest.mark.parametrize("name", sorted(TOOL_CALL_PARSERS))
@pytest.mark.parametrize("text", PLAIN)
def test_plain_text_streams_as_it_comes(name, text):
    parser = TOOL_CALL_PARSERS[name]()
    assert parser.parse(text) == (text, [])
    assert streamed(parser, text, piece=1) == (text or None, [])


def test_a_partial_marker_is_held_back_until_it_is_decided():
    stream = ToolCallStream(ToolPlan(TOOL_CALL_PARSERS["hermes"](), None, None))
    assert stream.feed("Hello <tool", finished=False) == [{"content": "Hello "}]
    assert stream.feed("s are fun", finished=False) == [{"content": "<tools are fun"}]


def test_mistral_ids_are_nine_letters_and_digits():
    _, calls = TOOL_CALL_PARSERS["mistral"]().parse('[TOOL_CALLS][{"name": "f", "arguments": {}}]')
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()


def test_grammar_shaped_outputs_of_required_and_named_choices():
    required = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "f", "parameters": {}}]'
    assert calls_of(RequiredToolCalls().parse(required)[1]) == [
        ("get_weather", {"city": "Paris"}),
        ("f", {}),
    ]
    assert calls_of(NamedToolCall("get_weather").parse('{"city": "Paris"}')[1]) == [
        ("get_weather", {"city": "Paris"})
    ]
    # Cut short by max_tokens: plain content, as with any parser.
    assert RequiredToolCalls().parse('[{"name": "get_wea') == ('[{"name": "get_wea', [])
