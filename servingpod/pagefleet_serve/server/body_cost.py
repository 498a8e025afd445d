"""What parsing a JSON body will cost, bounded before it is parsed.

Parsing holds the interpreter lock for the whole body (pydantic's JSON parser is one call
that builds every Python object), so a body's cost on the event loop is its number of
objects, arrays and strings, not its bytes: 4 MB of 270,000 tiny `metadata` pairs stalled
every other request, while 4 MB in one string costs little. Counting them first is cheap:
the counts of quote and bracket bytes bound them from above, and the quotes that no
backslash precedes (each one opens or closes a string) from below, each a C scan of the
bytes; only a body between the two bounds is counted exactly, stopping at the limit.
"""

import re

from pagefleet_serve.server.errors import bad_request

# Far above what a request needs (a JSON-schema constraint may have 16,384 objects and
# arrays, with their keys), far below what stalls the loop for long.
MAX_BODY_VALUES = 1 << 16

# A JSON string (escapes included), or the opening of an object or array.
_STRING_OR_CONTAINER = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[{]', re.DOTALL)


def count_values(body: bytes, limit: int = MAX_BODY_VALUES) -> int:
    """The strings, objects and arrays in `body` (keys are strings), exact up to `limit`
    and `limit + 1` past it."""
    quotes = body.count(b'"')
    upper = quotes // 2 + body.count(b"[") + body.count(b"{")
    if upper <= limit:
        return upper
    if (quotes - body.count(b'\\"')) // 2 > limit:
        return limit + 1
    found = 0
    # One Python step per value: the scan lets the event loop run between them.
    for found, _ in enumerate(_STRING_OR_CONTAINER.finditer(body), 1):
        if found > limit:
            break
    return found


def check_body_cost(body: bytes) -> None:
    """400 for a body with more strings, objects and arrays than any request needs."""
    if count_values(body) > MAX_BODY_VALUES:
        raise bad_request(
            f"the request body holds more than {MAX_BODY_VALUES} JSON strings, objects and "
            "arrays (keys included); no request needs that many: look for a runaway map or "
            "list (metadata, messages, a schema)",
            code="request_too_complex",
        )
