"""What a request asks its output to match: plain, serializable data that rides on
SamplingParams into the engine core (which compiles it against its tokenizer's vocabulary)."""

import itertools
import json
import re
from dataclasses import dataclass, field

# A constraint is text the core compiles; bounded like the rest of a request's settings.
MAX_CONSTRAINT_CHARS = 256 * 1024
MAX_CHOICES = 1024
# Compile time and memory grow faster than linearly with nesting (a schema of arrays of
# arrays...), so a constraint is bounded by its structure too, checked on the text before
# any compiler sees it: nesting depth (JSON objects and arrays; regex and grammar groups)
# and, for JSON, the number of objects and arrays in all. Real schemas stay far below.
MAX_CONSTRAINT_DEPTH = 64
MAX_CONSTRAINT_NODES = 16384

# What cannot open or close a level, by kind: JSON strings; a regex's escapes and
# character classes (a "(" there is a character, not a group); a grammar's too, and its
# quoted strings.
_JSON_STRING = r'"(?:[^"\\]|\\.)*"'
_REGEX_LITERAL = r"\\.|\[(?:[^\]\\]|\\.)*\]"
_LITERALS = {
    "json": re.compile(_JSON_STRING),
    "structural_tag": re.compile(_JSON_STRING),
    "regex": re.compile(_REGEX_LITERAL),
    "grammar": re.compile(f"{_REGEX_LITERAL}|{_JSON_STRING}"),
}
_JSON_LEVELS = {"{": 1, "[": 1, "}": -1, "]": -1}
_PATTERN_LEVELS = {"(": 1, ")": -1}

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


class CompileQueueFull(Exception):
    """A client's compile is refused for now: the queue, or the client's budget, is full
    (raised by the core's compiler, and again by the frontend that asked it to compile)."""


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of: `json` (a JSON Schema, as JSON text), `json_object` (any JSON
    object), `regex`, `choice` (one of these strings), `grammar` (EBNF, as xgrammar reads
    it), `structural_tag` (xgrammar's structural tag, as JSON text: see
    `structural_tag_text`). `field` names the request field it came from, for error messages; it is not
    part of the constraint's identity (the compile cache keys on the rest)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    field: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"{self.field}: give exactly one of {', '.join(KINDS)}, got "
                f"{', '.join(given) or 'none'}"
            )
        for kind in ("json", "regex", "grammar", "structural_tag"):
            text = getattr(self, kind)
            if text is not None and not (
                isinstance(text, str) and 0 < len(text) <= MAX_CONSTRAINT_CHARS
            ):
                raise ValueError(
                    f"{self.field}: {kind} must be a non-empty string of at most "
                    f"{MAX_CONSTRAINT_CHARS} characters"
                )
            if text is not None:
                _check_structure(self.field, kind, text)
        if self.choice is not None and not (
            0 < len(self.choice) <= MAX_CHOICES
            and all(isinstance(c, str) and c for c in self.choice)
            and sum(map(len, self.choice)) <= MAX_CONSTRAINT_CHARS
        ):
            raise ValueError(
                f"{self.field}: choice must be 1 to {MAX_CHOICES} non-empty strings of at most "
                f"{MAX_CONSTRAINT_CHARS} characters in all"
            )

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))


def _check_structure(where: str, kind: str, text: str) -> None:
    """ValueError naming `where` when the constraint nests deeper, or (JSON) holds more
    objects and arrays, than a compile can be trusted with."""
    is_json = kind in ("json", "structural_tag")
    stripped = _LITERALS[kind].sub("", text)
    levels = _JSON_LEVELS if is_json else _PATTERN_LEVELS
    steps = [levels[c] for c in stripped if c in levels]
    depth = max(itertools.accumulate(steps), default=0)
    if depth > MAX_CONSTRAINT_DEPTH:
        what = "objects and arrays" if is_json else "groups"
        raise ValueError(
            f"{where}: the {kind} constraint nests {what} {depth} levels deep; at most "
            f"{MAX_CONSTRAINT_DEPTH} are allowed"
        )
    nodes = steps.count(1)
    if is_json and nodes > MAX_CONSTRAINT_NODES:
        raise ValueError(
            f"{where}: the {kind} constraint has {nodes} objects and arrays; at most "
            f"{MAX_CONSTRAINT_NODES} are allowed"
        )


def structural_tag_text(spec: dict) -> str:
    """A structural tag in either of vLLM's forms -> the JSON text xgrammar compiles.
    The current form, `{"type": "structural_tag", "format": {...}}`, is xgrammar's own; the
    older one, `{"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}`
    (free text in which each trigger opens a tagged JSON value), becomes the same thing in
    the current form: triggered tags whose content is the structure's schema."""
    if "structures" not in spec:
        return json.dumps({"type": "structural_tag", "format": spec.get("format")})
    tags = [
        {
            "type": "tag",
            "begin": structure["begin"],
            "content": {"type": "json_schema", "json_schema": structure.get("schema") or {}},
            "end": structure["end"],
        }
        for structure in spec["structures"]
    ]
    return json.dumps(
        {
            "type": "structural_tag",
            "format": {"type": "triggered_tags", "triggers": spec["triggers"], "tags": tags},
        }
    )
