"""`parallel_tool_calls: false` with `tool_choice: "auto"`, streamed and not, through the
real `openai` SDK against the session's tool-calling pod (hermes parser): the model is
held by a regex to writing two hermes calls, and the response must carry only the first,
in the stream as in the whole response. With parallel calls allowed both come back."""

import json

import openai
import pytest

MODEL_NAME = "smol"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {
                "type": "object",
                "properties": {key: {"type": "string"}},
                "required": [key],
            },
        },
    }
    for name, key in (("get_weather", "city"), ("get_time", "zone"))
]
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})]
TWO_CALLS = "\n".join(
    f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
    for name, arguments in CALLS
)


def literal_regex(text: str) -> str:
    """`text` as a regex that matches only itself."""
    return "".join("\\" + c if c in "\\^$.|?*+()[]{}" else c for c in text)


@pytest.fixture(scope="module")
def client(tools_pod):
    return openai.OpenAI(base_url=f"{tools_pod.base_url}/v1", api_key="unused", max_retries=0)


def ask(client, parallel: bool, stream: bool):
    return client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Weather in Paris, and the time in UTC?"}],
        tools=TOOLS,
        tool_choice="auto",
        parallel_tool_calls=parallel,
        max_tokens=120,
        temperature=0,
        stream=stream,
        extra_body={"structured_outputs": {"regex": literal_regex(TWO_CALLS)}},
    )


def streamed_calls(chunks) -> list[tuple[str, dict]]:
    """The streamed deltas joined by call index, as the SDK's accumulator joins them."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += (call.function and call.function.name) or ""
                entry["arguments"] += (call.function and call.function.arguments) or ""
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("parallel", [False, True])
def test_parallel_tool_calls_false_keeps_only_the_first_call_streamed_and_not(client, parallel):
    expected = CALLS if parallel else CALLS[:1]
    whole = ask(client, parallel, stream=False).choices[0]
    got = [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    assert got == expected
    assert streamed_calls(ask(client, parallel, stream=True)) == expected
