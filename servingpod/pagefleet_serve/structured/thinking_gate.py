"""A sequence's output constraint when its model thinks first: the thinking runs free,
then the grammar (if any) constrains the answer from the token after the end of the
thinking; and a thinking budget, once spent, forces the end of the thinking token by
token. It stands in for the sequence's `GrammarMatcher` (the sampler masks the rows
whose constraint `masks_next`, the scheduler ends a sequence whose constraint
`is_terminated`), and like it advances with output tokens only, so it stays right
through recompute, prefix hits and chunked prefill.
"""

import enum

import torch

from pagefleet_serve.structured.grammar import GrammarMatcher
from pagefleet_serve.structured.thinking import ThinkingSpec


class _State(enum.Enum):
    OPENING = "opening"  # the first token decides: the start token, or the answer
    THINKING = "thinking"
    ANSWER = "answer"


class ThinkingGate:
    def __init__(self, spec: ThinkingSpec, matcher: GrammarMatcher | None) -> None:
        """`matcher`: the answer's grammar (None: the answer is free, only the budget
        binds)."""
        self.spec = spec
        self.matcher = matcher
        self.state = _State.THINKING if spec.start_token is None else _State.OPENING
        self.num_thinking_tokens = 0  # the thinking's own, the forced end not counted
        self.num_forced = 0  # tokens of forced_end written so far
        self._tail: list[int] = []  # the last len(end) thinking tokens

    @property
    def forcing(self) -> bool:
        budget = self.spec.budget
        return (
            self.state is _State.THINKING
            and budget is not None
            and (self.num_forced > 0 or self.num_thinking_tokens >= budget)
        )

    @property
    def masks_next(self) -> bool:
        """Whether the next token is constrained at all (a free row is not masked)."""
        if self.state is _State.THINKING:
            return self.forcing
        return self.matcher is not None and not self.matcher.is_terminated

    @property
    def is_terminated(self) -> bool:
        return (
            self.state is _State.ANSWER
            and self.matcher is not None
            and (self.matcher.is_terminated)
        )

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the row's allowed tokens (xgrammar's bit layout: bit t % 32 of word t // 32)."""
        if self.state is _State.THINKING:  # forcing: one token only
            bitmask[row] = 0
            _allow(bitmask, row, self.spec.forced_end[self.num_forced])
            return
        assert self.matcher is not None  # masks_next said so
        self.matcher.fill_bitmask(bitmask, row)
        if self.state is _State.OPENING:
            _allow(bitmask, row, self.spec.start_token)

    def accept(self, token_id: int) -> bool:
        if self.state is _State.OPENING:
            if token_id == self.spec.start_token:
                self.state = _State.THINKING
                self.num_thinking_tokens += 1
                self._think(token_id)
                return True
            self.state = _State.ANSWER
        if self.state is _State.ANSWER:
            return self.matcher is None or self.matcher.accept(token_id)
        if self.forcing:
            self.num_forced += 1
        else:
            self.num_thinking_tokens += 1
        self._think(token_id)
        return True

    def fork(self, output_token_ids: list[int]) -> "ThinkingGate":
        """A gate of the same spec and grammar at the point these output tokens lead to."""
        sibling = ThinkingGate(self.spec, None if self.matcher is None else self.matcher.fork([]))
        for token_id in output_token_ids:
            sibling.accept(token_id)
        return sibling

    def _think(self, token_id: int) -> None:
        end = self.spec.end
        self._tail = (self._tail + [token_id])[-len(end) :]
        if tuple(self._tail) == end:
            self.state = _State.ANSWER


def _allow(bitmask: torch.Tensor, row: int, token_id: int | None) -> None:
    assert token_id is not None
    word, bit = divmod(token_id, 32)
    value = 1 << bit
    if value >= 2**31:  # the int32 word's sign bit
        value -= 2**32
    bitmask[row, word] |= value


OutputConstraint = GrammarMatcher | ThinkingGate


def output_constraint(
    spec: ThinkingSpec | None, matcher: GrammarMatcher | None
) -> OutputConstraint | None:
    """What constrains a sequence's output: its grammar alone for a model that does not
    think; for one that does, a gate when there is a grammar or a budget (else nothing)."""
    if spec is None:
        return matcher
    if matcher is None and spec.budget is None:
        return None
    return ThinkingGate(spec, matcher)
