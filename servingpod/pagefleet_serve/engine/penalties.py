"""A sequence's token counts for the repetition, presence and frequency penalties, kept on
the device the logits are on.

The prompt's tokens (which only the repetition penalty reads) become a (V,) mask once, when
the sequence first samples, and the samples of one prompt share it; the output tokens are a
(V,) count that each step brings up to date with the tokens appended since (one, or a few
accepted drafts). A step then stacks its rows' tensors instead of scattering every row's
prompt and output again: the work per step no longer grows with the prompt.
"""

import torch


class TokenCounts:
    def __init__(self, prompt_seen: torch.Tensor | None, output_counts: torch.Tensor) -> None:
        self.prompt_seen = prompt_seen  # (V,) bool, or None: the prompt is not penalized
        self.output_counts = output_counts  # (V,) float32
        self.num_counted = 0  # output tokens counted in output_counts

    @classmethod
    def build(
        cls, prompt_token_ids: list[int], vocab: int, device: torch.device, with_prompt: bool
    ) -> "TokenCounts":
        """Counts of no output yet; the prompt's mask only `with_prompt` (the repetition
        penalty)."""
        prompt_seen = None
        if with_prompt:
            prompt_seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            prompt_seen[_ids(prompt_token_ids, device)] = True
        return cls(prompt_seen, torch.zeros(vocab, dtype=torch.float32, device=device))

    def catch_up(self, token_ids: list[int], num_prompt_tokens: int) -> None:
        """Count the output tokens appended since the last call: `token_ids` is the whole
        sequence, of which only the tail past what was counted is read."""
        new = token_ids[num_prompt_tokens + self.num_counted :]
        if new:
            ones = torch.ones((), dtype=self.output_counts.dtype, device=self.output_counts.device)
            self.output_counts.index_put_((_ids(new, ones.device),), ones, accumulate=True)
            self.num_counted += len(new)

    def plus(self, token_ids: list[int]) -> torch.Tensor:
        """The output counts with `token_ids` counted on top (a copy; this one unchanged)."""
        if not token_ids:
            return self.output_counts
        counts = self.output_counts.clone()
        ones = torch.ones((), dtype=counts.dtype, device=counts.device)
        return counts.index_put_((_ids(token_ids, counts.device),), ones, accumulate=True)

    def fork(self) -> "TokenCounts":
        """A sibling sample's counts: the same prompt mask (shared, never written), its own
        copy of the output counts."""
        fork = TokenCounts(self.prompt_seen, self.output_counts.clone())
        fork.num_counted = self.num_counted
        return fork


def _ids(token_ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(token_ids, dtype=torch.int64, device=device)
