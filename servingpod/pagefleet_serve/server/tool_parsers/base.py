"""What every tool-call parser shares: finding where the model's tool-call section starts
(also in a stream, holding back text that may be the start of a marker), turning the
whole output into (content, tool calls), and reading a section still being generated into
the calls decided so far (`call_prefixes`, for streaming). Output that does not parse
stays plain content: a model's malformed call is its answer, never a server error."""

import abc
import json
import secrets
import string
from dataclasses import dataclass

from pagefleet_serve.server.tool_parsers.partial_json import (
    Incomplete,
    expect,
    normal_prefix,
    read_string,
    skip_whitespace,
)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str

    def as_message(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class CallPrefix:
    """A call as far as a stream has generated it."""

    name: str | None  # None until the whole name has been read
    arguments: str  # the decided start of the arguments as ToolCall.arguments will hold them


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def make_call(item: object, arguments_key: str = "arguments", new_id=call_id) -> ToolCall:
    """{"name": ..., <arguments_key>: {...}} -> ToolCall; ValueError if it is not one."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        raise ValueError("a tool call is an object with a non-empty string name")
    arguments = item.get(arguments_key, {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError("a tool call's arguments are an object")
    return ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False), new_id())


def json_values(text: str, separators: str = "") -> list[object]:
    """Consecutive JSON values in `text`, with whitespace and `separators` between them;
    ValueError if anything else is there."""
    decoder = json.JSONDecoder()
    values, position = [], 0
    while True:
        while position < len(text) and (text[position].isspace() or text[position] in separators):
            position += 1
        if position == len(text):
            return values
        value, position = decoder.raw_decode(text, position)
        values.append(value)


class ToolParser(abc.ABC):
    """Subclasses set `markers` (any of which opens the tool-call section) and define
    `parse_calls` for the section (from its marker on)."""

    markers: tuple[str, ...] = ()
    new_id = staticmethod(call_id)

    def find_start(self, text: str) -> int | None:
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else None

    def holdback(self, text: str) -> int:
        """Length of the longest end of `text` that could grow into a marker."""
        return max(
            (n for m in self.markers for n in range(1, len(m)) if text.endswith(m[:n])), default=0
        )

    @abc.abstractmethod
    def parse_calls(self, section: str) -> list[ToolCall]:
        """The calls in `section`; ValueError (or KeyError, TypeError) if malformed."""

    @abc.abstractmethod
    def call_prefixes(self, section: str) -> list[CallPrefix]:
        """The calls of a section that may stop anywhere, as far as they go; what a longer
        section gives extends this (same names, longer arguments, more calls). ValueError
        once the section cannot be calls."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The whole output -> (content before the calls or None, calls)."""
        start = self.find_start(text)
        if start is None:
            return text, []
        try:
            calls = self.parse_calls(text[start:])
        except (ValueError, KeyError, TypeError):
            return text, []
        if not calls:
            return text, []
        return (text[:start] if text[:start].strip() else None), calls


ALPHANUMERIC = string.ascii_letters + string.digits


def object_call_prefix(
    text: str, position: int, arguments_keys: tuple[str, ...]
) -> tuple[CallPrefix, int | None]:
    """A call written as `{"name": ..., <one of arguments_keys>: {...}}` from `position`,
    as far as it goes, and where it ends (None: not yet). The arguments are normalized as
    `make_call` does, so the finished prefix is the call's `arguments`."""
    name, arguments = None, None
    try:
        position = skip_whitespace(text, expect(text, position, "{"))
        while not text.startswith("}", position):
            key, position = read_string(text, position)
            position = skip_whitespace(text, expect(text, position, ":"))
            if key == "name":
                name, position = read_string(text, position)
            elif key in arguments_keys and arguments is None:
                arguments, position = _arguments_prefix(text, position)
            else:
                _, position = normal_prefix(text, position)
            if position is None:
                raise Incomplete
            position = skip_whitespace(text, position)
            if text.startswith(",", position):
                position = skip_whitespace(text, position + 1)
            elif position < len(text) and text[position] != "}":
                raise ValueError(f"expected ',' or '}}' at {position}")
        if not name:
            raise ValueError("a tool call is an object with a non-empty string name")
        return CallPrefix(name, "{}" if arguments is None else arguments), position + 1
    except Incomplete:
        return CallPrefix(name, arguments or ""), None


def _arguments_prefix(text: str, position: int) -> tuple[str, int | None]:
    """Arguments as an object, or as JSON text in a string (some models write them so;
    that string is normalized once it has ended)."""
    if text.startswith('"', position):
        value, end = read_string(text, position)
        return json.dumps(json.loads(value), ensure_ascii=False), end
    if position < len(text) and text[position] != "{":
        raise ValueError("a tool call's arguments are an object")
    return normal_prefix(text, position)


def array_call_prefixes(
    text: str, position: int, arguments_keys: tuple[str, ...]
) -> list[CallPrefix]:
    """A JSON array of call objects from `position`, as far as it goes."""
    prefixes: list[CallPrefix] = []
    try:
        position = skip_whitespace(text, expect(text, position, "["))
        while not text.startswith("]", position):
            prefix, end = object_call_prefix(text, position, arguments_keys)
            prefixes.append(prefix)
            if end is None:
                break
            position = skip_whitespace(text, end)
            if text.startswith(",", position):
                position = skip_whitespace(text, position + 1)
            elif position < len(text) and text[position] != "]":
                raise ValueError(f"expected ',' or ']' at {position}")
            elif position == len(text):
                break
    except Incomplete:
        pass
    return prefixes
