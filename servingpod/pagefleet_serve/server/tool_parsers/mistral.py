"""Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or in newer
tokenizers `[TOOL_CALLS]name[ARGS]{...}` once per call (vLLM's `mistral`). Mistral's
templates expect call ids of nine letters and digits."""

import secrets

from pagefleet_serve.server.tool_parsers.base import (
    ALPHANUMERIC,
    CallPrefix,
    ToolCall,
    ToolParser,
    array_call_prefixes,
    json_values,
    make_call,
)
from pagefleet_serve.server.tool_parsers.partial_json import normal_prefix, skip_whitespace

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"


def mistral_call_id() -> str:
    return "".join(secrets.choice(ALPHANUMERIC) for _ in range(9))


class MistralToolParser(ToolParser):
    markers = (TOOL_CALLS,)
    new_id = staticmethod(mistral_call_id)

    def parse_calls(self, section: str) -> list[ToolCall]:
        calls = []
        for part in section.split(TOOL_CALLS)[1:]:
            if ARGS in part:
                name, _, arguments = part.partition(ARGS)
                [value] = json_values(arguments)
                calls.append(
                    make_call({"name": name.strip(), "arguments": value}, new_id=self.new_id)
                )
                continue
            values = json_values(part)
            if len(values) != 1 or not isinstance(values[0], list):
                raise ValueError("[TOOL_CALLS] is followed by one JSON array of calls")
            calls.extend(make_call(item, new_id=self.new_id) for item in values[0])
        return calls

    def call_prefixes(self, section: str) -> list[CallPrefix]:
        prefixes = []
        for part in section.split(TOOL_CALLS)[1:]:
            if ARGS in part:
                name, _, arguments = part.partition(ARGS)
                start = skip_whitespace(arguments, 0)
                if arguments[start : start + 1] not in ("", "{"):
                    raise ValueError("[ARGS] is followed by an arguments object")
                prefixes.append(CallPrefix(name.strip(), normal_prefix(arguments, start)[0]))
            elif part.lstrip().startswith("["):
                prefixes.extend(array_call_prefixes(part, skip_whitespace(part, 0), ("arguments",)))
        return prefixes
