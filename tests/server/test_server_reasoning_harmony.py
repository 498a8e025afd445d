"""gpt-oss's harmony format, against the reference: the prompt the server renders for a
whole conversation (system, developer instructions and function tools, the user, an
analysis message, a commentary tool call, the tool's result) is, character for character,
what the `openai-harmony` package renders. The package cannot load its vocabulary here
(it downloads o200k_base's file at first use, and no network is reachable), so the oracle
is the published format (the package's docs/format.md, whose complete function-calling
example this conversation is), with the header order of the package's renderer (author,
recipient, channel, content type). Then the output side: a model's harmony tokens,
analysis then a tool call on the commentary channel, split by the gpt_oss parser into
reasoning and a call the `openai` tool-call parser reads, with a tokenizer written by
the test (tests/server/test_server_reasoning.py's, with harmony's special tokens)."""

from __future__ import annotations

import dataclasses

import pytest
from pagefleet_serve.reasoning import REASONING, family_parser, reasoning_parser
from pagefleet_serve.reasoning.harmony import render
from pagefleet_serve.server.tool_parsers.openai import OpenAIToolParser
from pagefleet_serve.structured.thinking import ThinkingSpec
from transformers import AutoTokenizer

from tests.engine.scripted_models import build
from tests.server.test_server_reasoning import GPT_OSS

TOOLS = [
    {"type": "function", "function": {"name": "get_location", "description": "Gets the location of the user."}},
    {
        "type": "function",
        "function": {
            "name": "get_current_weather",
            "description": "Gets the current weather in the provided location.",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
                    "format": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
                },
                "required": ["location"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_multiple_weathers",
            "description": "Gets the current weather in the provided list of locations.",
            "parameters": {
                "type": "object",
                "properties": {
                    "locations": {
                        "type": "array",
                        "items": {"type": "string"},
                        "description": 'List of city and state, e.g. ["San Francisco, CA", "New York, NY"]',
                    },
                    "format": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
                },
                "required": ["locations"],
            },
        },
    },
]  # fmt: skip
CONVERSATION = [
    {"role": "system", "content": "Use a friendly tone."},
    {"role": "user", "content": "What is the weather like in SF?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning": "Need to use function get_weather.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"location": "San Francisco"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sunny": true, "temperature": 20}'},
]
# docs/format.md, "Function calling": the complete input once the tool has answered.
REFERENCE = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\nCurrent date: 2025-06-28\n\nReasoning: high\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
    "Calls to these tools must go to the commentary channel: 'functions'.<|end|>"
    "<|start|>developer<|message|># Instructions\n\nUse a friendly tone.\n\n# Tools\n\n"
    "## functions\n\nnamespace functions {\n\n"
    "// Gets the location of the user.\ntype get_location = () => any;\n\n"
    "// Gets the current weather in the provided location.\n"
    "type get_current_weather = (_: {\n// The city and state, e.g. San Francisco, CA\n"
    'location: string,\nformat?: "celsius" | "fahrenheit", // default: celsius\n}) => any;\n\n'
    "// Gets the current weather in the provided list of locations.\n"
    "type get_multiple_weathers = (_: {\n"
    '// List of city and state, e.g. ["San Francisco, CA", "New York, NY"]\n'
    'locations: string[],\nformat?: "celsius" | "fahrenheit", // default: celsius\n}) => any;\n\n'
    "} // namespace functions<|end|>"
    "<|start|>user<|message|>What is the weather like in SF?<|end|>"
    "<|start|>assistant<|channel|>analysis<|message|>Need to use function get_weather.<|end|>"
    # The package writes the recipient before the channel (the docs show the model's order).
    "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
    '<|message|>{"location": "San Francisco"}<|call|>'
    "<|start|>functions.get_weather to=assistant<|channel|>commentary"
    '<|message|>{"sunny": true, "temperature": 20}<|end|>'
    "<|start|>assistant"
)


def test_the_prompt_is_the_reference_rendering():
    kwargs = {"reasoning_effort": "high", "current_date": "2025-06-28"}
    assert render(CONVERSATION, TOOLS, kwargs) == REFERENCE


def test_a_final_answer_drops_the_analysis_before_it_and_thinking_off_opens_final():
    """The package's auto-drop: with the last assistant message final, the analysis
    messages before the first final one are left out."""
    turns = [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4.", "reasoning": "Simple arithmetic."},
        {"role": "user", "content": "And 3 + 3?"},
    ]
    prompt = render(turns, None, {"current_date": "2025-06-28", "enable_thinking": False})
    assert "Simple arithmetic." not in prompt
    assert "<|start|>assistant<|channel|>final<|message|>4.<|end|>" in prompt
    assert "Calls to these tools" not in prompt and "<|start|>developer" not in prompt
    assert prompt.endswith("<|start|>assistant<|channel|>final<|message|>")
    with pytest.raises(ValueError, match="reasoning_effort: must be one of low, medium, high"):
        render(turns, None, {"reasoning_effort": "max"})


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    words = [*GPT_OSS.words, " to=functions.get_weather", " ", "json", '{"city": "Paris"}']
    script = dataclasses.replace(GPT_OSS, words=words)
    return AutoTokenizer.from_pretrained(build(tmp_path_factory.mktemp("harmony"), script))


def test_analysis_then_a_tool_call_split_from_token_ids(tokenizer):
    """Token by token, as the output pipeline feeds it: the analysis is reasoning (its
    header and end counted as thinking tokens), the call is content the `openai` tool
    parser reads; the header's recipient may stand before or after the channel."""
    assert family_parser(tokenizer) == "gpt_oss"
    parser = reasoning_parser(None, tokenizer)
    for header in (
        "<|channel|>commentary to=functions.get_weather <|constrain|>json",
        " to=functions.get_weather<|channel|>commentary json",
    ):
        output = (
            "<|channel|>analysis<|message|>Let me think<|end|>"
            f"<|start|>assistant{header}<|message|>" + '{"city": "Paris"}<|call|>'
        )
        ids = tokenizer.encode(output, add_special_tokens=False)
        stream = parser.stream(ThinkingSpec("gpt_oss", end=(1,), forced_end=(1,)))
        pieces = [
            p for t in ids for p in stream.feed(t, tokenizer.decode([t], skip_special_tokens=True))
        ]
        reasoning = "".join(text for channel, text in pieces if channel == REASONING)
        content = "".join(text for channel, text in pieces if channel != REASONING)
        assert reasoning == "Let me think"
        assert (
            stream.num_reasoning_tokens == ids.index(tokenizer.convert_tokens_to_ids("<|end|>")) + 1
        )
        text, calls = OpenAIToolParser().parse(content)
        assert text is None
        assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]
