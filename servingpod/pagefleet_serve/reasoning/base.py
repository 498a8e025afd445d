"""What every reasoning parser shares.

A parser knows one model family's way of thinking before it answers. On the way in it
reads the rendered prompt (`thinking`: does the output open thinking, closed by the
template, or may it begin by opening it?) and says, in token ids, where the thinking
ends (`ThinkingSpec`, which the engine core uses to start a grammar after it and to force
the end when a budget is spent). On the way out, one `ReasoningStream` per sample sits in
the output pipeline right after the incremental detokenizer: it gets each token with the
text the detokenizer made of it and routes that text to the reasoning or the content,
dropping the markers themselves; a marker is one token (the parsers whose markers are
tokens look them up in the vocabulary at start, so a tag can never be split across two
deltas) or, for a family whose markers are phrases, text held back until it is settled.
"""

import abc
from collections.abc import Callable, Mapping
from typing import ClassVar

from pagefleet_serve.frontend.tokenizer import Tokenizer
from pagefleet_serve.structured.thinking import ThinkingSpec

REASONING = "reasoning"
CONTENT = "content"
Piece = tuple[str, str]  # (REASONING or CONTENT, text)
PromptRenderer = Callable[[list[dict], list[dict] | None, Mapping[str, object]], str]


class ReasoningStream(abc.ABC):
    """One sample's output, split as its tokens arrive."""

    def __init__(self) -> None:
        self.num_reasoning_tokens = 0  # the thinking's tokens, its markers included

    @abc.abstractmethod
    def feed(self, token_id: int, text: str) -> list[Piece]:
        """One output token and the text the detokenizer made of it -> what to send."""

    def finish(self) -> list[Piece]:
        """The sample has ended: whatever was held back."""
        return []


class ReasoningParser(abc.ABC):
    name: ClassVar[str]
    # The chat template variable that switches the family's thinking on (True) and off
    # (False): what a Messages request's `thinking.type` sets.
    switch: ClassVar[str]

    def __init__(self, tokenizer: Tokenizer) -> None:
        """ValueError naming the parser when the tokenizer lacks what it needs."""
        self.tokenizer = tokenizer
        self.vocab = tokenizer.get_vocab()
        # The family's own prompt format in place of the model's chat template (messages,
        # tools, template kwargs -> text; ValueError naming a field); None: the template.
        self.prompt_renderer: PromptRenderer | None = None

    @abc.abstractmethod
    def thinking(
        self,
        prompt_token_ids: list[int],
        template_kwargs: Mapping[str, object],
        budget: int | None,
    ) -> ThinkingSpec | None:
        """Where this request's thinking ends; None: its output does not think (the
        template switched thinking off)."""

    @abc.abstractmethod
    def stream(self, spec: ThinkingSpec) -> ReasoningStream:
        """A fresh split of one sample's output."""

    def token_id(self, text: str) -> int:
        """The id of a marker that must be one token of the vocabulary."""
        token_id = self.vocab.get(text)
        if token_id is None:
            raise ValueError(
                f"--reasoning-parser {self.name}: the model's tokenizer has no {text!r} token; "
                "it is not a model this parser reads (choose another, or none)"
            )
        return token_id

    def encode(self, text: str) -> tuple[int, ...]:
        """A marker's token ids as the model writes it (special tokens recognised)."""
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))


def strip_marker(text: str, marker: str) -> str:
    """The text the detokenizer made of a marker token, less the marker's own text (what is
    left is text an earlier token completed)."""
    return text[: -len(marker)] if marker and text.endswith(marker) else text
