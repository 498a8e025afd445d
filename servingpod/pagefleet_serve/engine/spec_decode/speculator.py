"""Per step, before scheduling: propose draft tokens for the running decodes, or none when
the batch is too large for verification to pay; and count what the verification accepted
(vLLM's spec_decode counters)."""

from dataclasses import dataclass

from pagefleet_serve.engine.sequence import Sequence
from pagefleet_serve.engine.spec_decode.config import SpeculativeConfig
from pagefleet_serve.engine.spec_decode.ngram import NgramProposer


@dataclass(frozen=True)
class SpecDecodeStats:
    num_drafts: int = 0  # sequence-steps that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()  # [i]: drafts whose token i was accepted


class Speculator:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * config.num_speculative_tokens

    def propose(self, running: list[Sequence]) -> None:
        """Set every running sequence's `spec_token_ids` for the coming step: proposals for
        those decoding, none for the others or when the batch exceeds disable_by_batch_size."""
        limit = self.config.disable_by_batch_size
        enabled = limit is None or len(running) <= limit
        for seq in running:
            decoding = seq.num_computed_tokens == seq.num_tokens - 1 and not seq.sibling_generators
            seq.spec_token_ids = (
                self.proposer.propose(seq.token_ids, self.config.num_speculative_tokens)
                if enabled and decoding
                else []
            )

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One sequence's verification: `num_accepted` leading drafts matched."""
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
