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
from pagefleet_serve.server.tool_parsers.base import (
    CallPrefix,
    array_call_prefixes,
    json_values,
    make_call,
)
from pagefleet_serve.server.tool_parsers.partial_json import normal_prefix, skip_whitespace
from pagefleet_serve.structured.constraint import StructuredOutputs

_NO_PARAMETERS = {"type": "object", "properties": {}}

# A streamed tool-call section is re-read from its start (its calls' JSON may stop
# anywhere): on every delta while it is short, and once it is longer than this only when it
# has grown by a sixteenth since the last reading, so that a long call costs the event loop
# about 17 readings of its text in all, not one per delta (quadratic: 2,000 array items
# took 36 ms a delta). Its fragments then come in larger pieces, never different ones.
REREAD_EVERY_DELTA_CHARS = 1024
REREAD_GROWTH = 16


class RequiredToolCalls(ToolParser):
    """The grammar-shaped output of `tool_choice: "required"`: all of it is calls."""

    def find_start(self, text: str) -> int | None:
        return 0

    def parse_calls(self, section: str) -> list[ToolCall]:
        [items] = json_values(section)
        return [make_call(item, "parameters") for item in items]

    def call_prefixes(self, section: str) -> list[CallPrefix]:
        return array_call_prefixes(section, skip_whitespace(section, 0), ("parameters",))


@dataclass
class NamedToolCall(ToolParser):
    """The grammar-shaped output of a named `tool_choice`: the function's arguments."""

    name: str

    def find_start(self, text: str) -> int | None:
        return 0

    def parse_calls(self, section: str) -> list[ToolCall]:
        [arguments] = json_values(section)
        return [make_call({"name": self.name, "arguments": arguments})]

    def call_prefixes(self, section: str) -> list[CallPrefix]:
        return [CallPrefix(self.name, normal_prefix(section)[0])]


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
        items = [_call_schema(t.function.name) for t in tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        schema["$defs"] = {t.function.name: _rooted_at(t.function) for t in tools}
        if not parallel:
            schema["maxItems"] = 1
        return ToolPlan(RequiredToolCalls(), _tools_constraint(schema), template_tools, parallel)
    name = choice.function.name
    if name not in names:
        raise bad_request(
            f"tool_choice: function {name!r} is not among tools ({', '.join(names)})",
            param="tool_choice",
        )
    parameters = tools[names.index(name)].function.parameters or _NO_PARAMETERS
    constraint = _tools_constraint(parameters)
    return ToolPlan(NamedToolCall(name), constraint, template_tools, False, "stop")


def _tools_constraint(schema: dict) -> StructuredOutputs:
    """The tools' schema as a constraint; one that is too large is the client's 400."""
    try:
        return StructuredOutputs(json=json.dumps(schema), field="tools")
    except ValueError as exc:
        raise bad_request(str(exc), param="tools") from None


def _call_schema(name: str) -> dict:
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": [name]},
            "parameters": {"$ref": f"#/$defs/{name}"},
        },
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


# Keywords whose values are JSON data, not schemas (a "$ref" there is data), and those
# whose values map names to schemas (a name there is no keyword).
_DATA_KEYWORDS = frozenset({"const", "default", "enum", "examples"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})


def _rooted_at(function) -> dict:
    """A function's parameters schema as it reads when placed at `#/$defs/<name>` of the
    "required" wrapper: its local references ("#/$defs/X", what pydantic writes for nested
    models, or "#" for itself) would resolve against the wrapper's root, so each is
    rewritten to point into the schema's new place (the names are unique, pointer-safe)."""
    base = f"#/$defs/{function.name}"

    def schema(node: object) -> object:
        if isinstance(node, list):
            return [schema(item) for item in node]
        if not isinstance(node, dict):
            return node
        rebased = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and value.startswith("#"):
                value = base + value[1:]
            elif key in _SCHEMA_MAPS and isinstance(value, dict):
                value = {name: schema(sub) for name, sub in value.items()}
            elif key not in _DATA_KEYWORDS:
                value = schema(value)
            rebased[key] = value
        return rebased

    return schema(function.parameters or _NO_PARAMETERS)  # type: ignore[return-value]


def split_output(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole choice's text -> (content, tool calls). A forced call (a grammar's) that
    does not parse was cut short (max_tokens): its calls as far as they go, as a stream
    sends them, and no content."""
    if plan.parser is None:
        return text, []
    content, calls = plan.parser.parse(text)
    if not calls and plan.constraint is not None:
        content, calls = None, _partial_calls(plan.parser, text)
    return content, calls if plan.parallel else calls[:1]


def _partial_calls(parser: ToolParser, text: str) -> list[ToolCall]:
    try:
        prefixes = parser.call_prefixes(text)
    except (ValueError, KeyError, TypeError):
        return []
    return [ToolCall(p.name, p.arguments, parser.new_id()) for p in prefixes if p.name]


@dataclass
class _SentCall:
    id: str
    name: str
    arguments: str = ""  # the arguments sent so far


@dataclass
class ToolCallStream:
    """One streamed choice: content goes out as it comes, up to where a tool-call section
    starts (or might start: the end of a marker is held back); from there each call goes
    out as it is generated: a first delta with its id and name, once the name is whole,
    then its arguments in fragments as they are decided (normalized as in the whole
    response, so the fragments join into the same `arguments`). A section that turns out
    not to be calls ends as plain content when no call had begun; a call already begun
    cannot be taken back (text cut by max_tokens ends with what was sent, and
    finish_reason "length")."""

    plan: ToolPlan
    text: str = ""
    sent: int = 0  # characters of `text` already sent as content
    start: int | None = None  # where the tool-call section begins
    sent_calls: list[_SentCall] = field(default_factory=list)
    broken: bool = False  # the section stopped reading as calls: no more fragments
    read_at: int = 0  # len(text) when the section was last read
    calls: list[ToolCall] = field(default_factory=list)  # the whole output's calls, at the end

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
        if self.start is None:
            return deltas
        if finished or self._worth_reading():
            deltas.extend(self._fragments(self._prefixes()))
        if finished:
            _, self.calls = split_output(self.plan, self.text)
            if self.calls:
                deltas.extend(
                    self._fragments([CallPrefix(c.name, c.arguments) for c in self.calls])
                )
            elif not self.sent_calls and len(self.text) > self.sent:
                deltas.append({"content": self.text[self.sent :]})
        return deltas

    def _worth_reading(self) -> bool:
        section = len(self.text) - self.start
        grown = len(self.text) - self.read_at
        return section <= REREAD_EVERY_DELTA_CHARS or grown * REREAD_GROWTH >= section

    def _prefixes(self) -> list[CallPrefix]:
        if self.broken:
            return []
        self.read_at = len(self.text)
        try:
            return self.plan.parser.call_prefixes(self.text[self.start :])
        except (ValueError, KeyError, TypeError):
            self.broken = True
            return []

    def _fragments(self, prefixes: list[CallPrefix]) -> list[dict]:
        """The deltas that bring the calls sent so far up to `prefixes`."""
        deltas = []
        for index, prefix in enumerate(prefixes[: None if self.plan.parallel else 1]):
            if not prefix.name:
                break
            if index == len(self.sent_calls):
                call = _SentCall(self.plan.parser.new_id(), prefix.name)
                self.sent_calls.append(call)
                header = ToolCall(call.name, "", call.id).as_message() | {"index": index}
                deltas.append({"tool_calls": [header]})
            call = self.sent_calls[index]
            if call.name != prefix.name or not prefix.arguments.startswith(call.arguments):
                break  # not the call that was begun: what was sent stands
            if len(prefix.arguments) > len(call.arguments):
                piece = prefix.arguments[len(call.arguments) :]
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
                call.arguments = prefix.arguments
        return deltas


def answer_stream(plan: ToolPlan | None) -> ToolCallStream | None:
    """A streamed choice's tool-call reader where its calls are parsed; None: its answer
    is all content."""
    return ToolCallStream(plan) if plan is not None and plan.parser is not None else None


def answer_deltas(calls: ToolCallStream | None, text: str, finished: bool) -> list[dict]:
    """New answer text -> its `delta` objects (content, tool-call fragments)."""
    if calls is None:
        return [{"content": text}] if text else []
    return calls.feed(text, finished)
