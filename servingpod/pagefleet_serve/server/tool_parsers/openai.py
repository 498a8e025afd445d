"""gpt-oss (vLLM's `openai`): a harmony message to `functions.NAME` is a call, its body the
arguments (JSON), ended by `<|call|>`. The `gpt_oss` reasoning parser writes each such
message into the content as `<|channel|>commentary to=functions.NAME<|message|>{...}<|call|>`
(the header normalized, whatever order the model wrote it in); a header with the
recipient before the channel (`to=functions.NAME<|channel|>commentary json<|message|>`),
as the model's own text has it when special tokens are kept, reads the same."""

import re

from pagefleet_serve.server.tool_parsers.base import (
    CallPrefix,
    ToolCall,
    ToolParser,
    json_values,
    make_call,
)
from pagefleet_serve.server.tool_parsers.partial_json import normal_prefix

CALL_END = "<|call|>"
# Where a call's message begins, up to its recipient's name.
_SECTION_START = re.compile(
    r"(?:<\|start\|>)?(?:assistant)?\s*(?:<\|channel\|>\w+\s*)?to=functions\."
)
# The rest of its header: the name, then a channel and a content type in either order.
_HEADER_REST = r"([\w.-]+)[^<]*(?:<\|channel\|>[^<]*)?(?:<\|constrain\|>\w*)?<\|message\|>"
_CALL = re.compile(_SECTION_START.pattern + _HEADER_REST + r"(.*?)(?:<\|call\|>|$)", re.DOTALL)


class OpenAIToolParser(ToolParser):
    markers = ("<|channel|>commentary to=functions.", " to=functions.")

    def find_start(self, text: str) -> int | None:
        found = _SECTION_START.search(text)
        return found.start() if found else None

    def parse_calls(self, section: str) -> list[ToolCall]:
        calls = []
        for name, body in _CALL.findall(section):
            [arguments] = json_values(body)
            calls.append(make_call({"name": name, "arguments": arguments}))
        if _CALL.sub("", section).strip():
            raise ValueError("text between or after the tool-call messages")
        return calls

    def call_prefixes(self, section: str) -> list[CallPrefix]:
        prefixes = []
        for header in _SECTION_START.split(section)[1:]:
            found = re.match(_HEADER_REST, header)
            if found is None:
                prefixes.append(CallPrefix(None, ""))
                break
            body = header[found.end() :].split(CALL_END, 1)[0]
            prefixes.append(CallPrefix(found.group(1), normal_prefix(body)[0]))
        return prefixes
