"""Tool calling for /v1/chat/completions: what a request's `tools` and `tool_choice` ask
for (`plan_tools`), and turning each choice's text into content and `tool_calls`, whole or
as stream deltas (`ToolCallStream`).

As in vLLM: `auto` needs `--enable-auto-tool-choice` and a `--tool-call-parser`, and the
model decides (its text is parsed); `required` and a named function are enforced with the
grammar engine, so the output is always calls whose arguments match the parameters
schema: `required` writes a JSON array of `{"name", "parameters"}` (one item when
`parallel_tool_calls` is false), a named function writes its arguments object.
"""

import json
from dataclasses import dataclass, field

from pagefleet_serve.server.errors import bad_request
from pagefleet_serve.server.settings import ServerSettings
from pagefleet_serve.server.tool_parsers import TOOL_CALL_PARSERS, ToolCall, ToolParser
from pagefleet_serve.server.tool_parsers.base import json_values, make_call
from pagefleet_serve.structured.constraint import StructuredOutputs

_NO_PARAMETERS = {"type": "object", "properties": {}}


class RequiredToolCalls(ToolParser):
    """The grammar-shaped output of `tool_choice: "required"`: all of it is calls."""

    def find_start(self, text: str) -> int | None:
        return 0

    def parse_calls(self, section: str) -> list[ToolCall]:
        [items] = json_values(section)
        return [make_call(item, "parameters") for item in items]


@dataclass
class NamedToolCall(ToolParser):
    """The grammar-shaped output of a named `tool_choice`: the function's arguments."""

    name: str

    def find_start(self, text: str) -> int | None:
        return 0

    def parse_calls(self, section: str) -> list[ToolCall]:
        [arguments] = json_values(section)
        return [make_call({"name": self.name, "arguments": arguments})]


@dataclass(frozen=True)
class ToolPlan:
    parser: ToolParser | None  # None: the output is plain content
    constraint: StructuredOutputs | None  # the grammar of required / named choices
    template_tools: list[dict] | None  # what the chat template gets as `tools`
    parallel: bool = True
    finish_reason: str = "tool_calls"  # OpenAI says "stop" after a named function


def plan_tools(request, settings: ServerSettings) -> ToolPlan:
    """The request's tools and tool_choice -> how to prompt, constrain and parse; 400s."""
    tools = request.tools or []
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools:
        if choice != "none":
            raise bad_request("tool_choice: needs tools", param="tool_choice")
        return ToolPlan(None, None, None)
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique", param="tools")
    template_tools = [t.model_dump(exclude_none=True, by_alias=True) for t in tools]
    parallel = request.parallel_tool_calls is not False
    if choice == "none":
        return ToolPlan(None, None, None)
    if choice == "auto":
        if not (settings.enable_auto_tool_choice and settings.tool_call_parser):
            raise bad_request(
                'tool_choice: "auto" needs the server started with --enable-auto-tool-choice '
                'and --tool-call-parser; use "required" or a named function instead',
                param="tool_choice",
            )
        parser = TOOL_CALL_PARSERS[settings.tool_call_parser]()
        return ToolPlan(parser, None, template_tools, parallel)
    if choice == "required":
        items = [_call_schema(t.function.name, t.function.parameters) for t in tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not parallel:
            schema["maxItems"] = 1
        constraint = StructuredOutputs(json=json.dumps(schema), field="tools")
        return ToolPlan(RequiredToolCalls(), constraint, template_tools, parallel)
    name = choice.function.name
    if name not in names:
        raise bad_request(
            f"tool_choice: function {name!r} is not among tools ({', '.join(names)})",
            param="tool_choice",
        )
    parameters = tools[names.index(name)].function.parameters or _NO_PARAMETERS
    constraint = StructuredOutputs(json=json.dumps(parameters), field="tools")
    return ToolPlan(NamedToolCall(name), constraint, template_tools, False, "stop")


def _call_schema(name: str, parameters: dict | None) -> dict:
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": [name]},
            "parameters": parameters or _NO_PARAMETERS,
        },
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


def split_output(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole choice's text -> (content, tool calls)."""
    if plan.parser is None:
        return text, []
    content, calls = plan.parser.parse(text)
    return content, calls if plan.parallel else calls[:1]


@dataclass
class ToolCallStream:
    """One streamed choice: content goes out as it comes, up to where a tool-call section
    starts (or might start: the end of a marker is held back); at the end the section
    becomes `tool_calls` deltas (a header with id and name, then the arguments in
    pieces), or plain content when it does not parse."""

    plan: ToolPlan
    text: str = ""
    sent: int = 0  # characters of `text` already sent as content
    start: int | None = None  # where the tool-call section begins
    calls: list[ToolCall] = field(default_factory=list)

    def feed(self, text: str, finished: bool) -> list[dict]:
        """New text of this choice -> the `delta` objects to send (possibly none)."""
        parser = self.plan.parser
        self.text += text
        if self.start is None:
            self.start = parser.find_start(self.text)
        if self.start is not None:
            safe = self.start
        else:
            safe = len(self.text) - (0 if finished else parser.holdback(self.text))
        deltas = []
        if safe > self.sent:
            deltas.append({"content": self.text[self.sent : safe]})
            self.sent = safe
        if finished and self.start is not None:
            _, self.calls = split_output(self.plan, self.text)
            if self.calls:
                deltas.extend(_call_deltas(self.calls))
            elif len(self.text) > self.sent:
                deltas.append({"content": self.text[self.sent :]})
        return deltas


def _call_deltas(calls: list[ToolCall]) -> list[dict]:
    deltas = []
    for index, call in enumerate(calls):
        header = call.as_message() | {"index": index}
        header["function"] = {"name": call.name, "arguments": ""}
        deltas.append({"tool_calls": [header]})
        half = len(call.arguments) // 2
        for piece in (call.arguments[:half], call.arguments[half:]):
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
    return deltas
