"""The start of a JSON document, parsed without recursion and without reading it whole.

The router needs only a body's leading prompt text to route it; the pod parses the body
for real. So the router reads the first bytes of a body (json.loads of a 4 MiB body would
stall every stream the event loop relays), and a document cut there is returned as far as
it goes: open strings, arrays and objects are closed where the text ends. Nesting is
bounded because the prefix code serializes nested prompt parts again."""

from __future__ import annotations

import json
import re
from typing import Any

_WHITESPACE = re.compile(r"[ \t\n\r]*")
# A string's body up to its closing quote: JSON's escapes, no raw control characters.
_STRING_BODY = re.compile(r'[^"\\\x00-\x1f]*(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*)*')
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_LITERALS = {"true": True, "false": False, "null": None}


def _match(pattern: re.Pattern[str], text: str, pos: int) -> re.Match[str]:
    """A match of a pattern that matches everywhere (it may match nothing)."""
    found = pattern.match(text, pos)
    assert found is not None
    return found


_LONGEST_ESCAPE = len("\\u0000")

# What the parser expects next.
_VALUE, _VALUE_OR_CLOSE, _KEY, _KEY_OR_CLOSE, _COLON, _COMMA_OR_CLOSE, _END = range(7)


class _Cut(Exception):
    """The text ended inside the document."""


class _Open:
    """An array or object being filled, and for an object the key whose value is next."""

    __slots__ = ("key", "value")

    def __init__(self, value: list | dict) -> None:
        self.value = value
        self.key: str | None = None

    def add(self, item: Any) -> None:
        if isinstance(self.value, list):
            self.value.append(item)
        else:
            self.value[self.key] = item


def parse_prefix(text: str, *, cut: bool, max_depth: int) -> Any:
    """The JSON value `text` holds. With `cut` (text is the start of a longer document),
    a value the text ends inside is returned as far as it goes (a number cut short is
    left out). Raises ValueError for text that is not JSON, or nests deeper than
    `max_depth` arrays and objects."""
    root: list[Any] = []  # the top-level value, once there is one
    stack: list[_Open] = []

    def add(item: Any) -> None:
        (stack[-1].add if stack else root.append)(item)

    expect, pos, end = _VALUE, 0, len(text)
    try:
        while True:
            pos = _match(_WHITESPACE, text, pos).end()
            if pos == end:
                if expect == _END:
                    return root[0]
                raise _Cut
            if expect == _END:
                raise ValueError(f"extra data at character {pos}")
            char = text[pos]
            if expect in (_KEY, _KEY_OR_CLOSE) and not (char == "}" and expect == _KEY_OR_CLOSE):
                if char != '"':
                    raise ValueError(f"expected a key at character {pos}")
                try:
                    stack[-1].key, pos = _string(text, pos, cut)
                except _PartialString:
                    raise _Cut from None  # a key without its value adds nothing
                expect = _COLON
            elif expect == _COLON:
                if char != ":":
                    raise ValueError(f"expected ':' at character {pos}")
                pos, expect = pos + 1, _VALUE
            elif expect in (_COMMA_OR_CLOSE, _VALUE_OR_CLOSE, _KEY_OR_CLOSE) and char in "]}":
                closer = "]" if isinstance(stack[-1].value, list) else "}"
                if char != closer:
                    raise ValueError(f"expected {closer!r} at character {pos}")
                stack.pop()
                pos, expect = pos + 1, _COMMA_OR_CLOSE if stack else _END
            elif expect == _COMMA_OR_CLOSE:
                if char != ",":
                    raise ValueError(f"expected ',' at character {pos}")
                pos, expect = pos + 1, _VALUE if isinstance(stack[-1].value, list) else _KEY
            elif char in "[{":
                if len(stack) == max_depth:
                    raise ValueError(f"nested deeper than {max_depth} levels")
                container: _Open = _Open([] if char == "[" else {})
                add(container.value)
                stack.append(container)
                pos, expect = pos + 1, _VALUE_OR_CLOSE if char == "[" else _KEY_OR_CLOSE
            else:
                item, pos = _string(text, pos, cut) if char == '"' else _scalar(text, pos, cut)
                add(item)
                expect = _COMMA_OR_CLOSE if stack else _END
    except _Cut:
        if not cut:
            raise ValueError("the document ends early") from None
        if not root:
            raise ValueError("no value before the cut") from None
        return root[0]
    except _PartialString as partial:
        add(partial.value)
        return root[0]


class _PartialString(Exception):
    """A string the cut text ends inside: its value so far."""

    def __init__(self, value: str) -> None:
        self.value = value


def _string(text: str, pos: int, cut: bool) -> tuple[str, int]:
    """The string starting at the quote at `pos`, and the position after it."""
    body = _match(_STRING_BODY, text, pos + 1)
    after = body.end()
    if after < len(text) and text[after] == '"':
        return json.loads(f'"{body.group()}"'), after + 1
    ends_in_escape = text[after : after + 1] == "\\" and len(text) - after < _LONGEST_ESCAPE
    if cut and (after == len(text) or ends_in_escape):
        raise _PartialString(json.loads(f'"{body.group()}"'))
    raise ValueError(f"bad string at character {pos}")


def _scalar(text: str, pos: int, cut: bool) -> tuple[Any, int]:
    number = _NUMBER.match(text, pos)
    if number:
        if cut and number.end() == len(text):
            raise _Cut  # more digits may follow
        value = number.group()
        is_int = not any(c in value for c in ".eE")
        return (int(value) if is_int else float(value)), number.end()
    for word, literal in _LITERALS.items():
        if text.startswith(word, pos):
            return literal, pos + len(word)
        if cut and word.startswith(text[pos:]):
            raise _Cut
    raise ValueError(f"unexpected {text[pos]!r} at character {pos}")
