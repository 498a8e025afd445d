"""Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}`, several separated by
`;`, optionally after `<|python_tag|>` (vLLM's `llama3_json`). The section starts at the
tag or at the first `{"name"`; text before it is content."""

from pagefleet_serve.server.tool_parsers.base import ToolCall, ToolParser, json_values, make_call

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    markers = (PYTHON_TAG, '{"name"')

    def parse_calls(self, section: str) -> list[ToolCall]:
        values = json_values(section.removeprefix(PYTHON_TAG), separators=";")
        return [
            make_call(v, "parameters" if isinstance(v, dict) and "parameters" in v else "arguments")
            for v in values
        ]
