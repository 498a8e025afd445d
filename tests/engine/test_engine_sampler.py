"""The sampler on hand-made logits (no model): which tokens top-k, top-p and min-p leave
drawable, the exact logits the repetition, presence and frequency penalties produce, and
exact logprobs."""

import math
import re

import pytest
import torch
import xgrammar as xgr
from pagefleet_serve import LLM
from pagefleet_serve.engine import sampler as sampler_module
from pagefleet_serve.engine.sampler import (
    CDF_BLOCK,
    SampledToken,
    SampleRow,
    _apply_penalties,
    _apply_top_k_top_p_min_p,
    _sample,
    sample,
)
from pagefleet_serve.sampling_params import SamplingParams
from pagefleet_serve.structured.grammar import GrammarMatcher

# Probabilities 0.4, 0.3, 0.2, 0.1 at token ids 2, 0, 3, 1 (shuffled so that survivors must
# be mapped back from sorted order to token ids).
PROBS = [0.3, 0.1, 0.4, 0.2]
LOGITS = [math.log(p) for p in PROBS]
NUM_DRAWS = 300  # P(a token of probability >= 0.1 is never drawn) < 1e-13


def row(params, seed=None, output=(), prompt=()):
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return SampleRow(params, generator, list(output), list(prompt))


def drawn(logits, params) -> set[int]:
    """The tokens drawn in NUM_DRAWS seeded draws of one distribution (one batched call)."""
    batch = torch.tensor([logits] * NUM_DRAWS, dtype=torch.float32)
    return {t.token_id for t in sample(batch, [row(params, seed) for seed in range(NUM_DRAWS)])}


@pytest.mark.parametrize(
    ("params", "survivors"),
    [
        (SamplingParams(), {0, 1, 2, 3}),
        (SamplingParams(top_k=1), {2}),
        (SamplingParams(top_k=2), {2, 0}),
        (SamplingParams(top_k=3), {2, 0, 3}),
        (SamplingParams(top_k=-1), {0, 1, 2, 3}),
        # top-p keeps the smallest prefix (by probability) whose mass reaches top_p.
        (SamplingParams(top_p=0.35), {2}),
        (SamplingParams(top_p=0.65), {2, 0}),
        (SamplingParams(top_p=0.85), {2, 0, 3}),
        (SamplingParams(top_p=0.95), {0, 1, 2, 3}),
        # min-p keeps tokens with at least min_p x the top probability (0.4).
        (SamplingParams(min_p=0.3), {2, 0, 3}),  # threshold 0.12 drops 0.1
        (SamplingParams(min_p=0.6), {2, 0}),  # threshold 0.24
        (SamplingParams(min_p=0.9), {2}),  # threshold 0.36
        # Combined: each filter removes what it would alone.
        (SamplingParams(top_k=3, top_p=0.65), {2, 0}),
        (SamplingParams(top_k=2, min_p=0.9), {2}),
    ],
)
def test_filters_leave_exactly_these_tokens_drawable(params, survivors):
    assert drawn(LOGITS, params) == survivors


def test_unseeded_rows_draw_independently_from_the_filtered_distribution():
    batch = torch.tensor([LOGITS] * NUM_DRAWS, dtype=torch.float32)
    rows = [row(SamplingParams(top_k=3)) for _ in range(NUM_DRAWS)]
    assert {t.token_id for t in sample(batch, rows)} == {2, 0, 3}


# Chi-square with 3 degrees of freedom: P(statistic > 30) < 1e-6 for a correct sampler.
CHI_SQUARE_BOUND = 30.0


def chi_square(tokens: list[int], probs: list[float]) -> float:
    expected = [p * len(tokens) for p in probs]
    return sum((tokens.count(i) - e) ** 2 / e for i, e in enumerate(expected))


def test_draws_follow_the_distribution_unseeded_and_seeded():
    torch.manual_seed(0)
    n = 20_000
    batch = torch.tensor([LOGITS] * n)
    unseeded = [t.token_id for t in sample(batch, [row(SamplingParams())] * n)]
    assert chi_square(unseeded, PROBS) < CHI_SQUARE_BOUND
    seeded = row(SamplingParams(), 7)  # one generator, a draw per step
    steps = [sample(torch.tensor([LOGITS]), [seeded])[0].token_id for _ in range(2_000)]
    assert chi_square(steps, PROBS) < CHI_SQUARE_BOUND


def test_draws_across_blocks_of_a_vocabulary_not_in_whole_blocks():
    # The draw finds a block of CDF_BLOCK tokens, then a token in it: these four sit in
    # different blocks (the last one partial), every other token is masked out.
    torch.manual_seed(1)
    vocab, tokens = 3 * CDF_BLOCK + 100, [5, CDF_BLOCK + 44, 2 * CDF_BLOCK, 3 * CDF_BLOCK + 99]
    logits = torch.full((20_000, vocab), float("-inf"))
    logits[:, tokens] = torch.tensor(LOGITS)
    drawn_tokens = [t.token_id for t in sample(logits, [row(SamplingParams())] * len(logits))]
    assert set(drawn_tokens) == set(tokens)
    assert chi_square([tokens.index(t) for t in drawn_tokens], PROBS) < CHI_SQUARE_BOUND


def test_top_p_of_one_keeps_a_tail_the_running_sum_rounds_away():
    # In float32, 1 - 1e-9 + 1e-9 is 1 before the last token: a mass-before test alone
    # would drop that token from a row that asked for no top_p.
    logits = torch.tensor([[0.0, math.log(1e-9)]])
    everything = torch.tensor([2]), torch.tensor([1.0]), torch.tensor([0.0])
    assert torch.isfinite(_apply_top_k_top_p_min_p(logits, *everything)).all()


def test_temperature_applies_before_top_p():
    # At temperature 1 the masses before each rank are 0, 0.4, 0.7, 0.9: top_p=0.8 keeps
    # three. At temperature 0.5 the probabilities go as p^2 (16, 9, 4, 1 over 30), the masses
    # before are 0, 0.53, 0.83: it keeps two.
    assert drawn(LOGITS, SamplingParams(top_p=0.8)) == {2, 0, 3}
    assert drawn(LOGITS, SamplingParams(top_p=0.8, temperature=0.5)) == {2, 0}


def test_each_row_uses_its_own_filters():
    reversed_logits = list(reversed(LOGITS))  # 0.2, 0.4, 0.1, 0.3: the most likely is 1
    logits = torch.tensor([LOGITS, reversed_logits, reversed_logits, LOGITS])
    rows = [
        row(SamplingParams(top_k=1), 0),
        row(SamplingParams(top_p=0.35), 1),
        row(SamplingParams(min_p=0.9), 2),
        row(SamplingParams(temperature=0.0), 3),
    ]
    assert [t.token_id for t in sample(logits, rows)] == [2, 1, 1, 2]


def test_seeded_draw_is_the_same_whatever_shares_the_batch():
    alone = sample(torch.tensor([LOGITS]), [row(SamplingParams(), 1234)])[0].token_id
    others = [row(SamplingParams(), None), row(SamplingParams(top_k=1), 5)]
    # The seeded row's logits between other rows' (other logits, an unseeded draw, a
    # filter that sends the whole batch through the filtering path).
    batch = torch.tensor([list(reversed(LOGITS)), LOGITS, list(reversed(LOGITS))])
    rows = [others[0], row(SamplingParams(), 1234), others[1]]
    assert sample(batch, rows)[1].token_id == alone


# -- penalties ------------------------------------------------------------------------------
PENALTY_LOGITS = [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]
PROMPT = [0, 5]
OUTPUT = [1, 3, 3]


def penalized(**penalties) -> list[float]:
    params = SamplingParams(**penalties)
    logits = torch.tensor([PENALTY_LOGITS])
    return _apply_penalties(logits.clone(), [row(params, output=OUTPUT, prompt=PROMPT)])[0].tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    # Seen: the prompt's 0 and 5 and the output's 1 and 3. Positive logits are divided by
    # 2, negative (and zero) ones multiplied; unseen 2 and 4 are untouched.
    assert penalized(repetition_penalty=2.0) == [1.0, -2.0, 0.5, 1.5, -2.0, 0.0]


def test_repetition_penalty_divides_a_seen_logit_below_one():
    logits = torch.tensor([[0.5, 0.5, -0.5]])
    params = SamplingParams(repetition_penalty=2.0)
    out = _apply_penalties(logits.clone(), [row(params, output=[0], prompt=[2])])
    assert out.tolist() == [[0.25, 0.5, -1.0]]


def test_frequency_penalty_counts_output_tokens_only():
    # Token 1 appeared once, 3 twice in the output; the prompt's tokens are not counted.
    assert penalized(frequency_penalty=0.5) == [2.0, -1.5, 0.5, 2.0, -2.0, 0.0]


def test_presence_penalty_is_once_per_output_token():
    assert penalized(presence_penalty=0.25) == [2.0, -1.25, 0.5, 2.75, -2.0, 0.0]


def test_negative_penalties_reward_repeats():
    assert penalized(presence_penalty=-1.0, frequency_penalty=-0.5) == [
        2.0,
        0.5,
        0.5,
        5.0,
        -2.0,
        0.0,
    ]


def test_penalties_combine_repetition_first():
    # 1: -1 x 2 = -2, then -0.5 x 1 - 0.25 = -2.75; 3: 3 / 2 = 1.5, then -0.5 x 2 - 0.25.
    combined = penalized(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    assert combined == [1.0, -2.75, 0.5, 0.25, -2.0, 0.0]


def test_penalties_apply_to_their_own_row_only():
    logits = torch.tensor([PENALTY_LOGITS, PENALTY_LOGITS])
    rows = [
        row(SamplingParams(), output=OUTPUT, prompt=PROMPT),
        row(SamplingParams(presence_penalty=1.0), output=[0], prompt=PROMPT),
    ]
    out = _apply_penalties(logits.clone(), rows).tolist()
    assert out == [PENALTY_LOGITS, [1.0, -1.0, 0.5, 3.0, -2.0, 0.0]]


def test_a_penalty_changes_the_greedy_choice_and_logprobs_stay_unpenalized():
    params = SamplingParams(temperature=0.0, repetition_penalty=4.0, logprobs=1)
    logits = torch.tensor([PENALTY_LOGITS])
    # 3 (logit 3.0) was generated: 3 / 4 = 0.75 < 2.0, so token 0 wins. With 0 in the
    # prompt as well (2 / 4 = 0.5), 3's 0.75 is the largest again.
    assert sample(logits, [row(params, output=[3])])[0].token_id == 0
    out = sample(logits, [row(params, output=[3], prompt=[0])])[0]
    assert out.token_id == 3
    # Logprobs describe the model's distribution, before penalties.
    expected = torch.log_softmax(logits[0], dim=-1)
    assert out.logprob == pytest.approx(float(expected[3]), abs=1e-6)
    assert out.top_logprobs == [(3, pytest.approx(float(expected[3]), abs=1e-6))]


# -- logprobs -------------------------------------------------------------------------------
def test_logprobs_are_exact_and_ranked():
    # Probabilities 1/8, 2/8, 5/8: logprobs ln(1/8), ln(1/4), ln(5/8).
    logits = torch.tensor([[math.log(1), math.log(2), math.log(5)]])
    out = sample(logits, [row(SamplingParams(temperature=0.0, logprobs=2))])[0]
    assert out.token_id == 2
    assert out.logprob == pytest.approx(math.log(5 / 8), abs=1e-6)
    assert [t for t, _ in out.top_logprobs] == [2, 1]
    assert [v for _, v in out.top_logprobs] == pytest.approx(
        [math.log(5 / 8), math.log(1 / 4)], abs=1e-6
    )
    # logprobs=0: the sampled token's logprob, no alternatives; None: nothing.
    zero = sample(logits, [row(SamplingParams(temperature=0.0, logprobs=0))])[0]
    assert zero.logprob == pytest.approx(math.log(5 / 8), abs=1e-6) and zero.top_logprobs == []
    off = sample(logits, [row(SamplingParams(temperature=0.0))])[0]
    assert off.logprob is None and off.top_logprobs is None


# -- the batched path against the same rows sampled one at a time -----------------------------
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
BATCH_VOCAB = 257
BATCH_CASES = {
    "greedy": [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=2)],
    "temperature": [SamplingParams(temperature=0.7), SamplingParams(temperature=1.6)],
    "top_k": [SamplingParams(top_k=5), SamplingParams(top_k=40, temperature=0.8)],
    "top_p": [SamplingParams(top_p=0.8), SamplingParams(top_p=0.5, temperature=1.3)],
    "min_p": [SamplingParams(min_p=0.2), SamplingParams(min_p=0.05, temperature=1.2)],
    "penalties": [
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(presence_penalty=0.8, frequency_penalty=0.4, temperature=0.0),
        SamplingParams(repetition_penalty=0.7, frequency_penalty=-0.3, top_k=30),
    ],
    "mixed": [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=20, top_p=0.9, min_p=0.05, temperature=0.9, logprobs=3),
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, logprobs=0),
        SamplingParams(temperature=1.1),
    ],
}


def batch_rows(params_list, device, repeats=4):
    """`repeats` rows of each setting, each with its own seed, output and prompt."""
    rng = torch.Generator().manual_seed(7)
    rows = []
    for r in range(repeats):
        for j, params in enumerate(params_list):
            seed = 1000 * r + j
            generator = None if params.greedy else torch.Generator(device).manual_seed(seed)
            output = torch.randint(BATCH_VOCAB, (3 + r,), generator=rng).tolist()
            prompt = torch.randint(BATCH_VOCAB, (5 + j,), generator=rng).tolist()
            rows.append(SampleRow(params, generator, output, prompt))
    logits = torch.randn(len(rows), BATCH_VOCAB, generator=rng) * 3
    return logits.to(device), rows


def one_at_a_time(logits, rows):
    return [sample(logits[i : i + 1], [r])[0] for i, r in enumerate(rows)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(BATCH_CASES))
def test_batched_sampling_equals_sampling_each_row_alone(case, device):
    logits, rows = batch_rows(BATCH_CASES[case], device)
    _, alone_rows = batch_rows(BATCH_CASES[case], device)  # the same seeds, fresh generators
    for _ in range(2):  # a second step: the generators advanced alike
        batched = sample(logits, rows)
        alone = one_at_a_time(logits, alone_rows)
        assert [t.token_id for t in batched] == [t.token_id for t in alone]
        assert [(t.logprob, t.top_logprobs) for t in batched] == [
            (pytest.approx(t.logprob, abs=1e-5) if t.logprob is not None else None, t.top_logprobs)
            for t in alone
        ]
    # The comparison tells rows apart: the same rows over each other's logits differ.
    shifted = one_at_a_time(logits.roll(1, dims=0), batch_rows(BATCH_CASES[case], device)[1])
    assert [t.token_id for t in shifted] != [t.token_id for t in batched]


NO_DISTRIBUTION = (
    "sampling failed: the row's logits hold no distribution (NaN, infinite, or nothing "
    "finite once its penalties and constraint were applied)"
)


@pytest.mark.parametrize("case", sorted(BATCH_CASES))
def test_the_batched_path_itself_samples_every_case_without_falling_back(case):
    """`sample` retries a batch that raises row by row, which draws the same tokens: a
    batched path broken for some setting would go unseen but for its cost (every step
    sampled row by row). `_sample`, the batched path alone, must give each case's tokens
    itself, with unseeded rows (drawn from the generator passed) among seeded and greedy
    ones, and a row with no distribution (a NaN) failing alone with its reason."""
    logits, rows = batch_rows(BATCH_CASES[case], "cpu")
    _, again = batch_rows(BATCH_CASES[case], "cpu")
    for r in (rows[1], again[1]):  # one row draws from the shared generator
        r.generator = None
    logits[2, 5] = float("nan")
    batched = _sample(logits, rows, torch.Generator().manual_seed(3))
    expected = sample(logits, again, torch.Generator().manual_seed(3))
    assert [t.token_id for t in batched] == [t.token_id for t in expected]
    assert [(t.logprob, t.top_logprobs) for t in batched] == [
        (t.logprob, t.top_logprobs) for t in expected
    ]
    assert batched[2] == SampledToken(-1, error=NO_DISTRIBUTION)
    assert all(t.error is None and t.token_id >= 0 for i, t in enumerate(batched) if i != 2)
    # Every other row that asked for logprobs has them, those after the failed row too.
    assert all(
        (t.logprob is not None) == (r.params.logprobs is not None)
        for i, (t, r) in enumerate(zip(batched, rows, strict=True))
        if i != 2
    )


@pytest.mark.parametrize("case", sorted(BATCH_CASES))
def test_a_batch_that_samples_is_sampled_once_not_row_by_row(case, monkeypatch):
    """`sample` goes row by row only after the batched path raised: a good batch (seeded,
    unseeded and greedy rows) is one batched call with the generator passed, its tokens
    the batched path's."""
    logits, rows = batch_rows(BATCH_CASES[case], "cpu")
    _, again = batch_rows(BATCH_CASES[case], "cpu")
    for r in (rows[1], again[1]):  # one row draws from the shared generator
        r.generator = None
    alone_calls = []
    sample_alone = sampler_module._sample_alone
    monkeypatch.setattr(
        sampler_module,
        "_sample_alone",
        lambda *args: alone_calls.append(args) or sample_alone(*args),
    )
    drawn = sample(logits, rows, torch.Generator().manual_seed(3))
    assert alone_calls == []
    expected = _sample(logits, again, torch.Generator().manual_seed(3))
    assert [(t.token_id, t.logprob, t.top_logprobs) for t in drawn] == [
        (t.token_id, t.logprob, t.top_logprobs) for t in expected
    ]


def test_the_logprob_of_a_sampled_token_zero_is_token_zeros():
    """Token id 0 is a token like any other: its logprob is read at index 0 (a failed
    row's -1 is clamped to 0 for the gather, and nothing else)."""
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 2.0]])
    rows = [row(SamplingParams(temperature=0.0, logprobs=1)) for _ in range(2)]
    tokens = sample(logits, rows)
    expected = torch.log_softmax(logits, dim=-1)
    assert [t.token_id for t in tokens] == [0, 2]
    assert tokens[0].logprob == pytest.approx(expected[0, 0].item(), abs=1e-6)
    assert tokens[1].logprob == pytest.approx(expected[1, 2].item(), abs=1e-6)


def test_greedy_rows_in_a_sampled_batch_never_read_uninitialized_noise():
    """A greedy row beside sampled ones takes no uniform number, and its slot of the draw's
    noise must not be whatever memory held before: a NaN there sent the inverse CDF past
    the last block (`index 2 is out of bounds`), failing the whole step at random. The
    freed memory is filled with NaN first, where the draw's allocation is likely to land."""
    logits, rows = batch_rows(BATCH_CASES["mixed"], "cpu")
    for _ in range(50):
        poison = torch.full((len(rows), 1), float("nan"), dtype=torch.float64)
        del poison
        tokens = sample(logits, rows)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        assert [tokens[i].token_id for i in greedy] == logits[greedy].argmax(-1).tolist()


def test_the_engine_hands_the_repetition_penalty_the_prompt_and_the_output():
    llm = LLM("builtin://tiny-random", dtype="float32")
    prompt = list(range(100, 140))

    def greedy(repetition_penalty):
        params = SamplingParams(max_tokens=16, temperature=0, repetition_penalty=repetition_penalty)
        return llm.generate([prompt], params)[0].outputs[0].token_ids

    plain = greedy(1.0)  # this random model repeats itself and echoes the prompt
    assert len(set(plain)) < len(plain) and set(plain) & set(prompt)
    penalized = greedy(100.0)
    assert len(set(penalized)) == len(penalized) and not set(penalized) & set(prompt)


def test_unseeded_rows_draw_from_the_generator_passed_and_leave_torchs_alone():
    """The engine's generator (its --seed) draws for the rows without one of their own, in
    row order; torch's default generator is neither read nor advanced."""
    batch = torch.tensor([LOGITS] * 65)
    rows = [row(SamplingParams())] * 64

    def tokens(seed):
        drawn = sample(batch[:64], rows, torch.Generator().manual_seed(seed))
        return [t.token_id for t in drawn]

    before = torch.random.get_rng_state()
    assert tokens(5) == tokens(5) != tokens(6)
    # Beside a greedy row, which draws nothing, the others draw the same numbers in order.
    greedy = row(SamplingParams(temperature=0.0))
    beside = sample(batch, [greedy, *rows], torch.Generator().manual_seed(5))
    assert [t.token_id for t in beside[1:]] == tokens(5)
    assert torch.equal(torch.random.get_rng_state(), before)


def test_the_engine_seed_makes_unseeded_sampling_repeat():
    """--seed (EngineConfig.seed), vLLM's meaning: two engines with the same seed sample
    the same tokens for requests without a seed of their own, whatever torch's default
    generator holds; another seed, other tokens."""
    prompts = [list(range(100 + 7 * i, 120 + 7 * i)) for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=1.0, n=2)

    def run(seed: int, torch_seed: int) -> list[list[list[int]]]:
        llm = LLM(
            "builtin://tiny-random",
            dtype="float32",
            seed=seed,
            max_model_len=64,
            kv_cache_memory_bytes=1 << 22,
        )
        torch.manual_seed(torch_seed)  # not what the engine draws from
        return [[s.token_ids for s in out.outputs] for out in llm.generate(prompts, params)]

    first = run(1234, 0)
    assert run(1234, 1) == first
    assert run(4321, 0) != first


# -- filter boundaries ----------------------------------------------------------------------
EQUAL = [0.0, 0.0, 0.0, 0.0]  # probabilities exactly 0.25 each; masses before 0, .25, .5, .75


def test_top_p_stops_at_the_token_whose_mass_reaches_it_exactly():
    # 0.25 + 0.25 reaches 0.5: two tokens, not the third (whose mass before is 0.5).
    assert len(drawn(EQUAL, SamplingParams(top_p=0.5))) == 2
    assert len(drawn(EQUAL, SamplingParams(top_p=0.5000001))) == 3


def test_min_p_keeps_a_token_exactly_at_the_threshold():
    # min_p 1: the threshold is the top probability itself, which every token has here.
    assert drawn(EQUAL, SamplingParams(min_p=1.0)) == {0, 1, 2, 3}


def test_a_penalty_that_overflows_is_clamped_to_the_finite_range():
    # A seen logit of -3e38 times 2 and one of 3e38 divided by 0.5 leave float32's range;
    # +-inf would turn the softmax into NaN, so they are clamped to its ends.
    big = 3e38
    for penalty, logit, bound in ((2.0, -big, "min"), (0.5, big, "max")):
        logits = torch.tensor([[logit, 1.0]])
        params = SamplingParams(repetition_penalty=penalty)
        out = _apply_penalties(logits.clone(), [row(params, output=[0])])[0].tolist()
        assert out == [getattr(torch.finfo(torch.float32), bound), 1.0]


# -- failures -------------------------------------------------------------------------------
def test_a_row_that_fails_fails_alone_and_says_why():
    # 10 alternatives asked of a 4-token vocabulary: the batch fails after the draw, which
    # advanced both generators; the rows are then sampled apart, on the same logits.
    rows = [row(SamplingParams(logprobs=10), 1), row(SamplingParams(), 2)]
    batch = torch.tensor([LOGITS] * 2)
    failed, drawn = sample(batch, rows)
    assert failed.token_id == -1
    assert re.match(r"^sampling failed: RuntimeError: .*out of range", failed.error)
    # The generators were rewound: the other row draws what a first try would have.
    assert drawn.error is None
    assert drawn.token_id == sample(batch[:1], [row(SamplingParams(), 2)])[0].token_id


def test_a_failed_batch_rewinds_the_unseeded_rows_generator_too():
    rows = [row(SamplingParams(logprobs=10)), row(SamplingParams())]
    failed, drawn = sample(torch.tensor([LOGITS] * 2), rows, torch.Generator().manual_seed(3))
    assert failed.error is not None
    alone = sample(
        torch.tensor([LOGITS]), [row(SamplingParams())], torch.Generator().manual_seed(3)
    )
    assert drawn.token_id == alone[0].token_id


# -- structured output ----------------------------------------------------------------------
def ab_matcher(accepted=()) -> GrammarMatcher:
    """The regex `ab` over the vocabulary a, b, c, </s>: `a` is the only first token."""
    info = xgr.TokenizerInfo(["a", "b", "c", "</s>"], stop_token_ids=[3])
    matcher = GrammarMatcher(xgr.GrammarCompiler(info).compile_regex("ab"))
    for token_id in accepted:
        assert matcher.accept(token_id)
    return matcher


def test_a_grammar_masks_its_own_row_and_leaves_the_callers_logits_intact():
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0]] * 3)  # c is the most likely
    original = logits.clone()
    rows = [
        SampleRow(SamplingParams(temperature=0.0), None, [], [], ab_matcher()),
        SampleRow(SamplingParams(temperature=0.0), None, [], []),
        # A grammar that is done (a, b, </s> accepted) no longer constrains its row.
        SampleRow(SamplingParams(temperature=0.0), None, [0, 1, 3], [], ab_matcher([0, 1, 3])),
    ]
    assert rows[2].grammar.is_terminated
    assert [t.token_id for t in sample(logits, rows)] == [0, 2, 2]
    assert torch.equal(logits, original)  # a retry of the step starts from the same logits


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 1e300),
        ("repetition_penalty", 1e300),
        ("repetition_penalty", 1e-300),
        ("top_p", 1e-300),
        ("min_p", 1e-300),
    ],
)
def test_a_value_float32_cannot_carry_is_refused_naming_its_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} .*float32"):
        SamplingParams(**{field: value})
