"""Hermes / Qwen style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one
tag pair per call, after optional text (vLLM's `hermes`). A last tag the model did not
close before it stopped still counts."""

import re

from pagefleet_serve.server.tool_parsers.base import (
    CallPrefix,
    ToolCall,
    ToolParser,
    json_values,
    make_call,
    object_call_prefix,
)

TOOL_CALL = "<tool_call>"

_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


class HermesToolParser(ToolParser):
    markers = (TOOL_CALL,)

    def parse_calls(self, section: str) -> list[ToolCall]:
        calls = []
        for body in _CALL.findall(section):
            values = json_values(body)
            if len(values) != 1:
                raise ValueError("one JSON object per <tool_call> tag")
            calls.append(make_call(values[0]))
        if _CALL.sub("", section).strip():
            raise ValueError("text between or after the tool-call tags")
        return calls

    def call_prefixes(self, section: str) -> list[CallPrefix]:
        return [
            object_call_prefix(body, 0, ("arguments",))[0] for body in section.split(TOOL_CALL)[1:]
        ]
