"""What every tool-call parser shares: finding where the model's tool-call section starts
(also in a stream, holding back text that may be the start of a marker), and turning the
whole output into (content, tool calls). Output that does not parse stays plain content:
a model's malformed call is its answer, never a server error."""

import abc
import json
import secrets
import string
from dataclasses import dataclass


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
