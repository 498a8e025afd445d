"""Where a reasoning model's thinking ends, in token ids: what the engine core needs to
start a structured output's grammar after the thinking (a JSON schema constrains the
answer, not the thoughts, as vLLM's reasoning-aware structured outputs do) and to end the
thinking when a request's budget of thinking tokens is spent.

The frontend's reasoning parser (`pagefleet_serve.reasoning`) writes it from the model's
tokenizer and the rendered prompt; it rides on SamplingParams into the core, which never
sees text. Torch-free, like the rest of a request's settings.
"""

from dataclasses import dataclass

MAX_MARKER_TOKENS = 32  # a marker is a tag or a short phrase, never more


@dataclass(frozen=True)
class ThinkingSpec:
    """`parser`: the reasoning parser's name (the frontend splits the text with it; the
    core ignores it). `end`: the token ids whose appearance ends the thinking (`</think>`,
    harmony's `<|channel|>final<|message|>`). `forced_end`: what the core writes, token by
    token, once the thinking has used `budget` tokens (None: no budget); it ends with
    `end`. `start_token`: the output thinks only if it opens with this token (a template
    that leaves the model to write `<think>` itself), else its first token is already the
    answer; None: the output thinks from its first token."""

    parser: str
    end: tuple[int, ...]
    forced_end: tuple[int, ...]
    start_token: int | None = None
    budget: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "end", tuple(self.end))
        object.__setattr__(self, "forced_end", tuple(self.forced_end))
        for name in ("end", "forced_end"):
            ids = getattr(self, name)
            if not 0 < len(ids) <= MAX_MARKER_TOKENS or not all(_token_id(t) for t in ids):
                raise ValueError(
                    f"thinking.{name} must be 1 to {MAX_MARKER_TOKENS} token ids, got {ids!r}"
                )
        if self.forced_end[-len(self.end) :] != self.end:
            raise ValueError(
                f"thinking.forced_end must end with thinking.end {self.end!r}, "
                f"got {self.forced_end!r}"
            )
        if self.start_token is not None and not _token_id(self.start_token):
            raise ValueError(f"thinking.start_token must be a token id, got {self.start_token!r}")
        if self.budget is not None and not (_token_id(self.budget) and self.budget < 2**31):
            raise ValueError(
                f"thinking_token_budget must be an integer in [0, {2**31 - 1}], got {self.budget!r}"
            )

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Every token id it names (the frontend checks them against the vocabulary)."""
        start = () if self.start_token is None else (self.start_token,)
        return (*self.end, *self.forced_end, *start)


def _token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
