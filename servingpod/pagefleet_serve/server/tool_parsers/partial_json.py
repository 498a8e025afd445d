"""JSON text that is still being generated -> the part of its normal form already decided.

Tool-call arguments go out as `json.dumps(value, ensure_ascii=False)` of what the model
wrote. To stream them as tokens arrive, `normal_prefix` reads a JSON value that may stop
anywhere and returns the beginning of that same normal form: everything it can no longer
change. Each character of a string is written as `json.dumps` writes it on its own, so a
string streams piece by piece; a number or a literal is written once it has ended (`1.50`
becomes `1.5` only when no digit can follow). The prefix for more text always extends the
prefix for less, which is what lets a stream send only the new part each time.
"""

import json
import re

_WHITESPACE = " \t\n\r"
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_NUMBER_CHARS = re.compile(r"[-+0-9.eE]+")
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")
_PLAIN = re.compile(r'[^"\\\x00-\x1f]+')
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_LITERALS = ("true", "false", "null")


class Incomplete(Exception):
    """The text stops before the value ends."""


def normal_prefix(text: str, start: int = 0) -> tuple[str, int | None]:
    """(the decided part of the value's normal form, where the value ends or None if it has
    not ended yet). ValueError if the text cannot be the start of a JSON value."""
    out: list[str] = []
    try:
        end = _value(text, skip_whitespace(text, start), out)
    except Incomplete:
        return "".join(out), None
    return "".join(out), end


def read_string(text: str, start: int) -> tuple[str, int]:
    """The whole JSON string at `start` -> (its value, where it ends); Incomplete while it
    has not ended, ValueError if it is not a string."""
    out: list[str] = []
    end = _string(text, start, out)
    return json.loads("".join(out)), end


def skip_whitespace(text: str, position: int) -> int:
    while position < len(text) and text[position] in _WHITESPACE:
        position += 1
    return position


def expect(text: str, position: int, char: str) -> int:
    """The position after `char` at `position` (whitespace skipped before it)."""
    position = skip_whitespace(text, position)
    if position == len(text):
        raise Incomplete
    if text[position] != char:
        raise ValueError(f"expected {char!r} at {position}, got {text[position]!r}")
    return position + 1


def _value(text: str, position: int, out: list[str]) -> int:
    if position == len(text):
        raise Incomplete
    char = text[position]
    if char == "{":
        return _container(text, position, out, "}", key=True)
    if char == "[":
        return _container(text, position, out, "]", key=False)
    if char == '"':
        return _string(text, position, out)
    number = _NUMBER_CHARS.match(text, position)
    if number:
        if number.end() == len(text):  # more digits may follow
            raise Incomplete
        if not _NUMBER.fullmatch(number.group()):
            raise ValueError(f"an invalid number at {position}: {number.group()[:20]!r}")
        out.append(json.dumps(json.loads(number.group())))
        return number.end()
    for literal in _LITERALS:
        rest = text[position : position + len(literal)]
        if rest == literal:
            out.append(literal)
            return position + len(literal)
        if position + len(rest) == len(text) and literal.startswith(rest):
            raise Incomplete
    raise ValueError(f"no JSON value at {position}: {text[position : position + 10]!r}")


def _container(text: str, position: int, out: list[str], close: str, key: bool) -> int:
    out.append(text[position])
    position = skip_whitespace(text, position + 1)
    if position == len(text):
        raise Incomplete
    if text[position] == close:
        out.append(close)
        return position + 1
    while True:
        if key:
            position = _string(text, skip_whitespace(text, position), out)
            position = expect(text, position, ":")
            out.append(": ")
        position = _value(text, skip_whitespace(text, position), out)
        position = skip_whitespace(text, position)
        if position == len(text):
            raise Incomplete
        if text[position] == close:
            out.append(close)
            return position + 1
        if text[position] != ",":
            raise ValueError(f"expected ',' or {close!r} at {position}")
        out.append(", ")
        position += 1


def _string(text: str, position: int, out: list[str]) -> int:
    if position == len(text):
        raise Incomplete
    if text[position] != '"':
        raise ValueError(f"expected a string at {position}")
    out.append('"')
    position += 1
    while True:
        plain = _PLAIN.match(text, position)
        if plain:
            out.append(plain.group())
            position = plain.end()
        if position == len(text):
            raise Incomplete
        char = text[position]
        if char == '"':
            out.append('"')
            return position + 1
        if char != "\\":
            raise ValueError(f"a control character in a string at {position}")
        decoded, position = _escape(text, position)
        out.append(json.dumps(decoded, ensure_ascii=False)[1:-1])


def _escape(text: str, position: int) -> tuple[str, int]:
    """The character an escape at `position` stands for, and where the escape ends (a
    surrogate pair written as two escapes is one character, as json.loads reads it)."""
    if position + 1 == len(text):
        raise Incomplete
    kind = text[position + 1]
    if kind in _ESCAPES:
        return _ESCAPES[kind], position + 2
    if kind != "u":
        raise ValueError(f"an invalid escape at {position}")
    code = _hex4(text, position + 2)
    end = position + 6
    if 0xD800 <= code <= 0xDBFF:  # a low surrogate may follow and make one character
        follow = text[end : end + 2]
        if follow == "\\u":
            low = _hex4(text, end + 2)
            if 0xDC00 <= low <= 0xDFFF:
                return chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)), end + 6
        elif "\\u".startswith(follow) and end + len(follow) == len(text):
            raise Incomplete
    return chr(code), end


def _hex4(text: str, position: int) -> int:
    digits = text[position : position + 4]
    if _HEX4.fullmatch(digits):
        return int(digits, 16)
    if position + len(digits) == len(text) and _HEX4.fullmatch(digits.ljust(4, "0")):
        raise Incomplete
    raise ValueError(f"an invalid \\u escape at {position}")
