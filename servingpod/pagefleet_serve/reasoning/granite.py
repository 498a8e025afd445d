"""IBM Granite 3.2 and 3.3 (vLLM's `granite`): asked to think (`chat_template_kwargs:
{"thinking": true}`), the model writes "Here is my thought process:", its thoughts,
"Here is my response:" and its answer; phrases, not tokens, so the split is made on the
text, holding back what may be the start of a phrase until it is settled. An output that
does not open with the first phrase is all answer, as in vLLM."""

from collections.abc import Mapping

from pagefleet_serve.reasoning.base import (
    CONTENT,
    REASONING,
    Piece,
    ReasoningParser,
    ReasoningStream,
)
from pagefleet_serve.structured.thinking import ThinkingSpec

THOUGHT_STARTS = ("Here is my thought process:", "Here's my thought process:")
RESPONSE_STARTS = ("Here is my response:", "Here's my response:")


class GraniteReasoningParser(ReasoningParser):
    name = "granite"
    switch = "thinking"

    def thinking(
        self,
        prompt_token_ids: list[int],
        template_kwargs: Mapping[str, object],
        budget: int | None,
    ) -> ThinkingSpec | None:
        if template_kwargs.get("thinking") is not True:
            return None
        # The grammar waits for the response phrase as the model writes it after a line
        # break (the other spelling ends the thinking of the text, not of the grammar).
        end = self.encode(RESPONSE_STARTS[0])
        return ThinkingSpec(self.name, end=end, forced_end=self.encode("\n\n") + end, budget=budget)

    def stream(self, spec: ThinkingSpec) -> ReasoningStream:
        return GraniteStream()


class GraniteStream(ReasoningStream):
    def __init__(self) -> None:
        super().__init__()
        self.state: str | None = None  # None: not yet known whether it opens thinking
        self.held = ""

    def feed(self, token_id: int, text: str) -> list[Piece]:
        if self.state != CONTENT:
            self.num_reasoning_tokens += 1
        self.held += text
        return self._advance(finished=False)

    def finish(self) -> list[Piece]:
        return self._advance(finished=True)

    def _advance(self, finished: bool) -> list[Piece]:
        pieces: list[Piece] = []
        if self.state is None:
            start = next((s for s in THOUGHT_STARTS if self.held.startswith(s)), None)
            if start is not None:
                self.state, self.held = REASONING, self.held[len(start) :]
            elif not finished and any(s.startswith(self.held) for s in THOUGHT_STARTS):
                return []
            else:
                self.state = CONTENT
                self.num_reasoning_tokens = 0
        if self.state == REASONING:
            found = [(i, s) for s in RESPONSE_STARTS if (i := self.held.find(s)) >= 0]
            if found:
                at, phrase = min(found)
                pieces.append((REASONING, self.held[:at]))
                self.state, self.held = CONTENT, self.held[at + len(phrase) :]
            else:
                keep = 0 if finished else _partial_suffix(self.held, RESPONSE_STARTS)
                pieces.append((REASONING, self.held[: len(self.held) - keep]))
                self.held = self.held[len(self.held) - keep :]
        if self.state == CONTENT:
            pieces.append((CONTENT, self.held))
            self.held = ""
        return [(channel, text) for channel, text in pieces if text]


def _partial_suffix(text: str, phrases: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that begins one of `phrases`."""
    longest = max(len(p) for p in phrases)
    for size in range(min(len(text), longest - 1), 0, -1):
        if any(p.startswith(text[-size:]) for p in phrases):
            return size
    return 0
