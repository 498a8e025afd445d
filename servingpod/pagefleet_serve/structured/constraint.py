"""What a request asks its output to match: plain, serializable data that rides on
SamplingParams into the engine core (which compiles it against its tokenizer's vocabulary)."""

import json
from dataclasses import dataclass, field

# A constraint is text the core compiles; bounded like the rest of a request's settings.
MAX_CONSTRAINT_CHARS = 256 * 1024
MAX_CHOICES = 1024

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


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
