"""The `<think>...</think>` families: the thinking is the text between the tags, each tag
one token of the vocabulary (Qwen3, DeepSeek-R1 and the models trained like them). What
the families differ in is where the thinking starts when the output carries no opening
tag (`ThinkTagParser.opens_unmarked`).

The prompt says where the output starts: a template that ends its generation prompt with
`<think>` (Qwen3.5, DeepSeek-R1-0528) has opened the thinking, one that ends it with an
empty `<think>\\n\\n</think>` (thinking switched off) has closed it; only whitespace may
follow the tag. With neither tag at the prompt's end, the family decides.
"""

from collections.abc import Mapping

from pagefleet_serve.reasoning.base import (
    CONTENT,
    REASONING,
    Piece,
    ReasoningParser,
    ReasoningStream,
    strip_marker,
)
from pagefleet_serve.structured.thinking import ThinkingSpec

START, END = "<think>", "</think>"
# How far back from the prompt's end a tag is looked for (a template ends with the tag
# and a newline or two).
_TAIL_TOKENS = 8


class ThinkTagParser(ReasoningParser):
    # True: an output with no tag in the prompt's tail thinks from its first token (the
    # model may leave out `<think>`); False: it thinks only if it opens with `<think>`.
    opens_unmarked: bool

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.start_id = self.token_id(START)
        self.end_id = self.token_id(END)

    def thinking(
        self,
        prompt_token_ids: list[int],
        template_kwargs: Mapping[str, object],
        budget: int | None,
    ) -> ThinkingSpec | None:
        tag = self._prompt_tag(prompt_token_ids)
        if tag == self.end_id:
            return None
        opened = tag == self.start_id or self.opens_unmarked
        return ThinkingSpec(
            self.name,
            end=(self.end_id,),
            forced_end=(self.end_id,),
            start_token=None if opened else self.start_id,
            budget=budget,
        )

    def stream(self, spec: ThinkingSpec) -> ReasoningStream:
        return ThinkTagStream(self.start_id, self.end_id, opened=spec.start_token is None)

    def _prompt_tag(self, prompt_token_ids: list[int]) -> int | None:
        """The think tag the prompt ends with (whitespace after it allowed), or None."""
        tail = prompt_token_ids[-_TAIL_TOKENS:]
        for position in range(len(tail) - 1, -1, -1):
            token_id = tail[position]
            if token_id in (self.start_id, self.end_id):
                return token_id
            if self.tokenizer.decode([token_id]).strip():
                return None
        return None


class ThinkTagStream(ReasoningStream):
    """Before the first token: thinking if the prompt opened it, else the first token
    decides (`<think>` opens it, anything else is the answer). The thinking ends at
    `</think>`; there is one thinking section, and tags after it are the answer's text."""

    def __init__(self, start_id: int, end_id: int, opened: bool) -> None:
        super().__init__()
        self.start_id = start_id
        self.end_id = end_id
        self.state = REASONING if opened else None  # None: the first token decides

    def feed(self, token_id: int, text: str) -> list[Piece]:
        if self.state is None:
            self.state = REASONING if token_id == self.start_id else CONTENT
        if self.state == CONTENT:
            return [(CONTENT, text)] if text else []
        self.num_reasoning_tokens += 1
        if token_id == self.start_id:
            text = strip_marker(text, START)
        elif token_id == self.end_id:
            text = strip_marker(text, END)
            self.state = CONTENT
        return [(REASONING, text)] if text else []
