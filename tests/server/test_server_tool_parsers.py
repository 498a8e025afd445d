"""Tool-call parsers on model-shaped texts, whole and streamed: several calls, nested JSON,
text before the call, and malformed output that comes back as plain content (never an
error); the stream sends each call's name first, then its arguments in fragments as they
are generated, and the deltas assemble into the same calls as the whole text."""

import json

import pytest
from pagefleet_serve.server.tool_parsers import TOOL_CALL_PARSERS
from pagefleet_serve.server.tool_parsers.partial_json import normal_prefix
from pagefleet_serve.server.tools import NamedToolCall, RequiredToolCalls, ToolCallStream, ToolPlan

NESTED = {"filter": {"city": "Paris", "tags": ["a", "b"], "range": {"min": 1, "max": 2.5}}}
# Written as no normalizer would: compact, escapes, a surrogate pair, 1.50 and 1e2.
ODD_ARGUMENTS = '{"q":"caf\\u00e9 \\"x\\"\\n\\ud83d\\ude00","n":1.50,"e":1e2,"t":[true,null,-0]}'

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
        "hermes",
        f'<tool_call>{{"name":"search","arguments":{ODD_ARGUMENTS}}}</tool_call>',
        None,
        [("search", json.loads(ODD_ARGUMENTS))],
    ),
    (  # arguments written as JSON text
        "hermes",
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}</tool_call>',
        None,
        [("f", {"a": [1, 2]})],
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

# Malformed before any call has begun: the stream, too, ends as plain content.
MALFORMED = [
    ("hermes", "<tool_call>\nnot json\n</tool_call>"),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("mistral", '[TOOL_CALLS]{"name": "f", "arguments": {}}'),  # not an array
    ("mistral", "[TOOL_CALLS][{]"),
]
# Malformed only after a call has begun (its name was whole): the whole text is content,
# the stream cannot take back the call it began, and ends without an error.
MALFORMED_LATE = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call> and then more text'),
    ("llama3_json", '{"name": "get_weather", "parameters": [1, 2]}'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}'),
]

PLAIN = ["The weather in Paris is sunny.", "Use <b>tags</b> or {braces} freely.", ""]


def calls_of(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def stream_deltas(parser, text: str, piece: int) -> list[dict]:
    stream = ToolCallStream(ToolPlan(parser, None, None))
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)] or [""]
    return [
        delta
        for i, chunk in enumerate(pieces)
        for delta in stream.feed(chunk, finished=i == len(pieces) - 1)
    ]


def assemble(deltas: list[dict]) -> tuple[str | None, dict[int, dict]]:
    """Deltas -> (content, calls by index), as the OpenAI SDK's accumulator joins them."""
    content, calls = None, {}
    for delta in deltas:
        if "content" in delta:
            content = (content or "") + delta["content"]
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"arguments": "", "fragments": 0})
            if "id" in call:  # the first delta of a call: id and whole name, no arguments
                assert "id" not in entry and call["function"]["arguments"] == ""
                entry |= {"id": call["id"], "name": call["function"]["name"]}
            else:
                assert "id" in entry, "arguments before the call's name"
                entry["arguments"] += call["function"]["arguments"]
                entry["fragments"] += 1
    return content, calls


def streamed(parser, text: str, piece: int = 3) -> tuple[str | None, list]:
    """Feed `text` in pieces; assemble the deltas as the OpenAI SDK does."""
    content, calls = assemble(stream_deltas(parser, text, piece))
    return content, [(e["name"], json.loads(e["arguments"])) for _, e in sorted(calls.items())]


@pytest.mark.parametrize(("name", "text", "content", "expected"), CASES)
def test_calls_are_parsed_whole_and_streamed(name, text, content, expected):
    parser = TOOL_CALL_PARSERS[name]()
    got_content, calls = parser.parse(text)
    assert (got_content, calls_of(calls)) == (content, expected)
    assert len({c.id for c in calls}) == len(calls)
    for piece in (1, 3, len(text)):
        streamed_content, streamed_calls = streamed(parser, text, piece)
        assert streamed_calls == expected
        assert (streamed_content or None) == (content or None)
    # Token by token, each call's arguments arrive in pieces (arguments written as JSON
    # text: once that string has ended), and join into exactly the text of the whole
    # response (normalized alike), not only into equal JSON.
    _, by_index = assemble(stream_deltas(parser, text, 1))
    assert [e["arguments"] for _, e in sorted(by_index.items())] == [c.arguments for c in calls]
    as_text = '"arguments": "' in text
    assert all(e["fragments"] > 1 or as_text for e in by_index.values())


@pytest.mark.parametrize(("name", "text"), MALFORMED)
def test_malformed_calls_come_back_as_plain_content(name, text):
    parser = TOOL_CALL_PARSERS[name]()
    assert parser.parse(text) == (text, [])
    assert streamed(parser, text) == (text, [])


@pytest.mark.parametrize(("name", "text"), MALFORMED_LATE)
def test_a_call_that_turns_malformed_after_it_began_ends_the_stream_quietly(name, text):
    parser = TOOL_CALL_PARSERS[name]()
    assert parser.parse(text) == (text, [])
    content, calls = assemble(stream_deltas(parser, text, 2))
    assert content is None and [e["name"] for e in calls.values()] in (["get_weather"], ["f"])


def test_arguments_stream_as_a_prefix_of_their_normal_form():
    text = f'{{"a": {ODD_ARGUMENTS}, "b": "x\\u00'
    whole = json.dumps(json.loads(ODD_ARGUMENTS), ensure_ascii=False)
    sent = ""
    for end in range(len(text) + 1):
        prefix, _ = normal_prefix(text[:end])
        assert prefix.startswith(sent)
        sent = prefix
    assert sent == f'{{"a": {whole}, "b": "x'
    assert normal_prefix(ODD_ARGUMENTS) == (whole, len(ODD_ARGUMENTS))
    with pytest.raises(ValueError, match="no JSON value"):
        normal_prefix('{"a": tru3}')


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


def test_a_named_choice_sends_its_name_before_any_argument():
    stream = ToolCallStream(ToolPlan(NamedToolCall("get_weather"), None, None, False, "stop"))
    [header] = stream.feed("", finished=False)
    assert header["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert stream.feed('{"city": "Pa', finished=False) == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Pa'}}]}
    ]


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


class CountingReads:
    """A parser whose section readings are counted (characters read in all)."""

    def __init__(self, parser):
        self.parser, self.chars_read = parser, 0

    def __getattr__(self, name):
        return getattr(self.parser, name)

    def call_prefixes(self, section: str):
        self.chars_read += len(section)
        return self.parser.call_prefixes(section)


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (
            TOOL_CALL_PARSERS["hermes"](),
            '<tool_call>{"name": "store", "arguments": {"items": ['
            + ", ".join(f'{{"id": {i}, "tag": "t{i}"}}' for i in range(2000))
            + "]}}</tool_call>",
        ),
        (
            RequiredToolCalls(),
            '[{"name": "store", "parameters": {"items": ['
            + ", ".join(f'"item number {i}"' for i in range(3000))
            + "]}}]",
        ),
    ],
)
def test_a_long_streamed_call_is_read_a_bounded_number_of_times(parser, text):
    """Issue 42, item 8: each delta used to re-read the whole section (quadratic: 2,000
    array items, 36 ms a delta on the event loop). Now a long section is read again only
    once it has grown by a sixteenth: a bounded multiple of its length in all, in 4-character
    deltas, and its fragments still join into the whole response's arguments."""
    counting = CountingReads(parser)
    _, by_index = assemble(stream_deltas(counting, text, 4))
    assert len(text) > 40_000
    assert counting.chars_read < 25 * len(text)  # was about len(text)**2 / 8
    [(_, call)] = by_index.items()
    [whole] = parser.parse(text)[1]
    assert call["name"] == whole.name and call["arguments"] == whole.arguments
    assert call["fragments"] > 10
