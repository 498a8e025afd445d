"""Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}`, several separated by
`;`, optionally after `<|python_tag|>` (vLLM's `llama3_json`). The section starts at the
tag or at the first `{"name"`; text before it is content."""

from pagefleet_serve.server.tool_parsers.base import (
    CallPrefix,
    ToolCall,
    ToolParser,
    json_values,
    make_call,
    object_call_prefix,
)
from pagefleet_serve.server.tool_parsers.partial_json import skip_whitespace

PYTHON_TAG = "<|python_tag|>"
ARGUMENTS_KEYS = ("parameters", "arguments")


class Llama3JsonToolParser(ToolParser):
    markers = (PYTHON_TAG, '{"name"')

    def parse_calls(self, section: str) -> list[ToolCall]:
        values = json_values(section.removeprefix(PYTHON_TAG), separators=";")
        return [
            make_call(v, "parameters" if isinstance(v, dict) and "parameters" in v else "arguments")
            for v in values
        ]

    def call_prefixes(self, section: str) -> list[CallPrefix]:
        text, position, prefixes = section.removeprefix(PYTHON_TAG), 0, []
        while True:
            while position < len(text) and text[position] == ";":
                position = skip_whitespace(text, position + 1)
            position = skip_whitespace(text, position)
            if position == len(text):
                return prefixes
            prefix, end = object_call_prefix(text, position, ARGUMENTS_KEYS)
            prefixes.append(prefix)
            if end is None:
                return prefixes
            position = end
