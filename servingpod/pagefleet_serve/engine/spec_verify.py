"""Verification of draft tokens against the target model's distributions.

Every proposal here is deterministic (the draft distribution q is one-hot at the draft
token d), so the standard rejection-sampling rule reads: accept d with probability p(d);
on rejection draw from p with d removed, renormalized; after k accepted drafts draw a
bonus token from p. We realise it by coupling: draw x ~ p at each position exactly as
plain decoding would (same processing, same noise), accept while x equals the draft, and
emit the first x that differs. P(accept) = p(d), and a rejected x is distributed as p
without d, so the output distribution is the target's for any temperature, top-k, top-p
or min-p; greedy is the case where x is the argmax. A seeded request even gets the same
tokens as without speculation, provided its generator advances once per emitted token
(`rewind`).
"""

import torch

from pagefleet_serve.engine.sampler import SampledToken, SampleRow, draw_uniform
from pagefleet_serve.engine.sequence import Sequence


def draft_rows(seq: Sequence, draft_token_ids: list[int]) -> list[SampleRow]:
    """One sample row per scored position: before each draft token, then the bonus; the
    penalties of position j see the drafts before it as output."""
    output, prompt = seq.penalty_token_ids()
    return [
        SampleRow(
            seq.params,
            seq.generator,
            output + draft_token_ids[:j],
            prompt,
            banned=seq.banned_token_ids(j),
        )
        for j in range(len(draft_token_ids) + 1)
    ]


def accepted_run(sampled: list[SampledToken], draft_token_ids: list[int]) -> list[SampledToken]:
    """The sampled tokens up to and including the first that differs from its draft (all
    of them, the bonus included, when every draft matched)."""
    for j, draft in enumerate(draft_token_ids):
        if sampled[j].token_id != draft:
            return sampled[: j + 1]
    return sampled


def rewind(generator: torch.Generator, state: torch.Tensor, num_draws: int) -> None:
    """Put a seeded generator where plain decoding of `num_draws` tokens would leave it:
    the positions after a rejection drew noise that no emitted token used."""
    generator.set_state(state)
    for _ in range(num_draws):
        draw_uniform(torch.empty((), dtype=torch.float64, device=generator.device), generator)
