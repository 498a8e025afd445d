"""Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or in newer
tokenizers `[TOOL_CALLS]name[ARGS]{...}` once per call (vLLM's `mistral`). Mistral's
templates expect call ids of nine letters and digits."""

import secrets

from pagefleet_serve.server.tool_parsers.base import (
    ALPHANUMERIC,
    ToolCall,
    ToolParser,
    json_values,
    make_call,
)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"


def mistral_call_id() -> str:
    return "".join(secrets.choice(ALPHANUMERIC) for _ in range(9))


class MistralToolParser(ToolParser):
    markers = (TOOL_CALLS,)

    def parse_calls(self, section: str) -> list[ToolCall]:
        calls = []
        for part in section.split(TOOL_CALLS)[1:]:
            if ARGS in part:
                name, _, arguments = part.partition(ARGS)
                [value] = json_values(arguments)
                calls.append(
                    make_call({"name": name.strip(), "arguments": value}, new_id=mistral_call_id)
                )
                continue
            values = json_values(part)
            if len(values) != 1 or not isinstance(values[0], list):
                raise ValueError("[TOOL_CALLS] is followed by one JSON array of calls")
            calls.extend(make_call(item, new_id=mistral_call_id) for item in values[0])
        return calls
