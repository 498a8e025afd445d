"""What the sampler's draws are, not only which tokens they may be: unseeded rows in a
batch mixed with seeded and greedy rows, the inverse CDF at hand-set uniform numbers
across its blocks and at their last slot, a temperature above 1, and a tail of mass that a
float32 running sum would drop. Every random number comes from a seeded generator, so
each statistic is fixed and the bounds hold far from it."""

import math

import pytest
import torch
from pagefleet_serve.engine.sampler import CDF_BLOCK, SampleRow, _invert_cdf, sample
from pagefleet_serve.sampling_params import SamplingParams

PROBS = [0.3, 0.1, 0.4, 0.2]
LOGITS = [math.log(p) for p in PROBS]
# Chi-square with 3 degrees of freedom: P(statistic > 30) < 1e-6 for a correct sampler.
CHI_SQUARE_BOUND = 30.0


def chi_square(tokens: list[int], probs: list[float]) -> float:
    expected = [p * len(tokens) for p in probs]
    return sum((tokens.count(i) - e) ** 2 / e for i, e in enumerate(expected))


def row(params, seed=None):
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return SampleRow(params, generator, [], [])


@pytest.mark.parametrize(
    "others",
    [
        pytest.param([row(SamplingParams(), 11)], id="beside-a-seeded-row"),
        pytest.param([row(SamplingParams(temperature=0.0))], id="beside-a-greedy-row"),
        pytest.param(
            [row(SamplingParams(), 11), row(SamplingParams(temperature=0.0))], id="beside-both"
        ),
    ],
)
def test_unseeded_rows_of_a_mixed_batch_each_draw_their_own_number(others):
    """The unseeded rows of a batch that also holds seeded or greedy rows take their
    numbers apart from the others' (the engine's generator draws only for them): each must
    be a draw of its own, so that 399 rows of one distribution follow it, instead of all
    repeating one token."""
    num_unseeded = 399
    rows = [*others, *(row(SamplingParams()) for _ in range(num_unseeded))]
    logits = torch.tensor([LOGITS] * len(rows))
    tokens = sample(logits, rows, torch.Generator().manual_seed(3))
    unseeded = [t.token_id for t in tokens[len(others) :]]
    assert chi_square(unseeded, PROBS) < CHI_SQUARE_BOUND


def test_temperature_two_flattens_the_distribution_as_p_to_the_half():
    """Temperature 2 divides the logits by 2: the probabilities go as sqrt(p). A draw that
    skipped the scaling would follow p itself, which the statistic tells apart by far."""
    n = 8_000
    flattened = [math.sqrt(p) for p in PROBS]
    flattened = [p / sum(flattened) for p in flattened]
    logits = torch.tensor([LOGITS] * n)
    rows = [row(SamplingParams(temperature=2.0)) for _ in range(n)]
    tokens = [t.token_id for t in sample(logits, rows, torch.Generator().manual_seed(4))]
    assert chi_square(tokens, flattened) < CHI_SQUARE_BOUND
    assert chi_square(tokens, PROBS) > 10 * CHI_SQUARE_BOUND  # the test can tell them apart


# -- the inverse CDF at hand-set uniform numbers ------------------------------------------
# A vocabulary of three blocks and a partial fourth, mass only on these tokens: the first
# and last slot of block 0, slots 3 and 255 of block 1, two tokens of block 2, the very
# last token of the partial block.
VOCAB = 3 * CDF_BLOCK + 60
LIKELY = {
    0: 0.05,
    CDF_BLOCK - 1: 0.15,
    CDF_BLOCK + 3: 0.2,
    2 * CDF_BLOCK - 1: 0.25,
    2 * CDF_BLOCK + 7: 0.1,
    2 * CDF_BLOCK + 200: 0.15,
    VOCAB - 1: 0.1,
}


def likely_probs() -> torch.Tensor:
    probs = torch.zeros(1, VOCAB)
    for token, p in LIKELY.items():
        probs[0, token] = p
    return probs


def invert(probs: torch.Tensor, uniforms: list[float]) -> list[int]:
    """The token drawn at each uniform number, all in one batch of the same row."""
    batch = probs.expand(len(uniforms), -1).contiguous()
    uniform = torch.tensor(uniforms, dtype=torch.float64)[:, None]
    return _invert_cdf(batch, uniform).tolist()


def test_each_likely_token_is_drawn_exactly_over_its_own_share_of_the_unit_interval():
    """u in [mass before a token, mass before it + its own) draws that token: the start,
    middle and end of every interval, across blocks and at each block's last slot (an
    offset of one block, or a last slot that cannot be reached, moves a boundary)."""
    uniforms, expected = [], []
    start = 0.0
    for token, p in LIKELY.items():
        for u in (start + 1e-6, start + p / 2, start + p - 1e-6):
            uniforms.append(u)
            expected.append(token)
        start += p
    assert invert(likely_probs(), uniforms) == expected


def test_the_ends_of_the_unit_interval_draw_the_first_and_last_token_with_mass():
    """u = 0 must not draw a token of zero mass before the first likely one (token 0 is
    likely here; a zero-mass token 0 is checked on a shifted row), and u just below 1 draws
    the last likely token, never one past the vocabulary."""
    assert invert(likely_probs(), [0.0, 1.0 - 1e-12]) == [0, VOCAB - 1]
    shifted = likely_probs().roll(5, dims=1)  # the last token's mass wraps to token 4
    assert invert(shifted, [0.0, 1.0 - 1e-12]) == [4, 2 * CDF_BLOCK + 205]


def test_an_unnormalized_row_is_drawn_in_proportion_to_its_total():
    """The target is u times the row's total: a row that sums to 0.5 is the same draw."""
    uniforms = [0.01, 0.1, 0.3, 0.55, 0.8, 0.9, 0.99]
    assert invert(likely_probs() / 2, uniforms) == invert(likely_probs(), uniforms)


def test_the_inverse_cdf_equals_a_float64_reference_on_random_rows():
    """Random rows over a vocabulary not in whole blocks against the first token whose
    float64 running sum passes u times the total (the generator is seeded: the uniform
    numbers are never within float32 rounding of a boundary)."""
    generator = torch.Generator().manual_seed(5)
    vocab = 5 * CDF_BLOCK + 17
    probs = torch.softmax(3 * torch.randn(64, vocab, generator=generator), dim=-1)
    uniform = torch.rand(64, 1, dtype=torch.float64, generator=generator)
    cdf = probs.double().cumsum(dim=-1)
    reference = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True)[:, 0]
    assert _invert_cdf(probs, uniform).tolist() == reference.tolist()


def test_a_tail_below_float32_resolution_near_one_stays_drawable():
    """A block of mass 2^-26 after a block of mass 1 - 2^-24: a float32 running sum over
    the blocks rounds that increment away near 1, so u close to 1 would never reach it.
    The running sum is float64: the tail is drawn for u above the mass before it, and not
    below."""
    head, tail = 1.0 - 2.0**-24, 2.0**-26
    probs = torch.zeros(1, 2 * CDF_BLOCK)
    probs[0, 0], probs[0, CDF_BLOCK + 2] = head, tail
    below, above = head / (head + tail) - 1e-9, 1.0 - 1e-10
    assert invert(probs, [below, above]) == [0, CDF_BLOCK + 2]


def test_a_token_the_float32_running_sum_within_a_block_drops_stays_drawable():
    """Inside one block: 1/2, then 2^-26, then 3 x 2^-26. Their total, 1/2 + 2^-24, is the
    same in float32 whatever the order of the sum, but the running sum after the second
    token, 1/2 + 2^-26, is not a float32 number: rounded, it is 1/2 and the second token
    could never be drawn. In float64 it takes its own sliver of u."""
    probs = torch.zeros(1, CDF_BLOCK)
    probs[0, 0], probs[0, 1], probs[0, 2] = 0.5, 2.0**-26, 3 * 2.0**-26
    total = 0.5 + 2.0**-24
    targets = [0.25, 0.5 + 2.0**-27, 0.5 + 2.0**-25]
    assert invert(probs, [t / total for t in targets]) == [0, 1, 2]


def test_u_zero_skips_whole_blocks_without_mass():
    """u = 0 (the generator can draw it) takes the first token with mass even when the
    blocks before it have none: a block whose running sum equals the target is not the
    block the target falls in."""
    probs = torch.zeros(1, 3 * CDF_BLOCK)
    probs[0, 2 * CDF_BLOCK + 40], probs[0, 2 * CDF_BLOCK + 90] = 0.5, 0.5
    assert invert(probs, [0.0, 0.25, 0.75]) == [2 * CDF_BLOCK + 40] * 2 + [2 * CDF_BLOCK + 90]


def test_a_seeded_row_draws_one_float64_uniform_from_its_generator():
    """A seeded row's token is the inverse CDF at one float64 uniform number drawn from its
    own generator, and the draw leaves the generator exactly one such number on (so a
    seed's tokens are the same on every engine, and the next step draws the next number)."""
    logits = torch.tensor([LOGITS] * 3) + torch.arange(12.0).reshape(3, 4) / 7
    rows = [row(SamplingParams(), seed) for seed in (5, 6, 7)]
    tokens = sample(logits, rows)
    for i, seed in enumerate((5, 6, 7)):
        reference = torch.Generator().manual_seed(seed)
        u = torch.empty(1, 1, dtype=torch.float64).uniform_(generator=reference)
        expected = _invert_cdf(torch.softmax(logits[i : i + 1], dim=-1), u)
        assert tokens[i].token_id == expected.item()
        assert torch.equal(rows[i].generator.get_state(), reference.get_state())
