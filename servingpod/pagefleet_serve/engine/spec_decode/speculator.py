"""Per step, before scheduling: propose draft tokens for the running decodes, or none when
the batch is too large for verification to pay; and count what the verification accepted
(vLLM's spec_decode counters). The proposer is a strategy behind one interface: n-gram
prompt lookup (`ngram.py`) or a draft model (`draft_model.py`).

A sequence whose drafts keep being rejected outright backs off: after m such
verifications in a row it proposes nothing for min(2 ** (m - 1), MAX_BACKOFF_STEPS)
steps, so text that does not repeat its input costs (almost) no verification.
"""

import weakref
from typing import Protocol

from pagefleet_serve.config import SpeculativeConfig
from pagefleet_serve.engine.sequence import Sequence
from pagefleet_serve.engine.spec_decode.ngram import NgramProposer
from pagefleet_serve.messages import SpecDecodeStats

MAX_BACKOFF_STEPS = 16


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], num_tokens: int) -> list[list[int]]:
        """Up to `num_tokens` draft tokens for each decoding sequence, in order."""


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        """`proposer`: the draft model's; None: n-gram prompt lookup."""
        self.config = config
        self.proposer = proposer or NgramProposer(
            config.prompt_lookup_min, config.prompt_lookup_max
        )
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * config.num_speculative_tokens
        # Per sequence: rejected-outright verifications in a row, steps left to skip.
        self._misses: weakref.WeakKeyDictionary[Sequence, list[int]] = weakref.WeakKeyDictionary()

    def propose(self, running: list[Sequence]) -> None:
        """Set every running sequence's `spec_token_ids` for the coming step: proposals for
        those decoding without a grammar, none for the others or when the batch exceeds
        disable_by_batch_size."""
        limit = self.config.disable_by_batch_size
        enabled = limit is None or len(running) <= limit
        proposing = []
        for seq in running:
            seq.spec_token_ids = []
            decoding = seq.num_computed_tokens == seq.num_tokens - 1 and not seq.sibling_generators
            # A structured-output mask is known for the next position only, so a
            # constrained sequence decodes one token at a time.
            decoding = decoding and seq.grammar is None
            if enabled and decoding and not self._backing_off(seq):
                proposing.append(seq)
        if not proposing:
            return
        drafts = self.proposer.propose(proposing, self.config.num_speculative_tokens)
        for seq, spec_token_ids in zip(proposing, drafts, strict=True):
            seq.spec_token_ids = spec_token_ids

    def _backing_off(self, seq: Sequence) -> bool:
        misses = self._misses.get(seq)
        if misses is None or misses[1] == 0:
            return False
        misses[1] -= 1
        return True

    def record(self, seq: Sequence, num_draft_tokens: int, num_accepted: int) -> None:
        """One sequence's verification: `num_accepted` leading drafts matched."""
        misses = self._misses.setdefault(seq, [0, 0])
        misses[0] = 0 if num_accepted else misses[0] + 1
        misses[1] = min(2 ** (misses[0] - 1), MAX_BACKOFF_STEPS) if misses[0] else 0
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def stats(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            tuple(self.accepted_per_position),
        )
