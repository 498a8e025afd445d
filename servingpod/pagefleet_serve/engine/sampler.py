"""Logits -> next tokens, for a whole step at once, on the device the logits are on.

Each row is one sample to draw. Penalties, temperature, top-k, top-p and min-p are applied
as batched tensor ops; the draw inverts each row's cumulative distribution at one uniform
number, which a seeded row draws from its own generator (on the logits' device), so a seed
gives the same tokens whatever else shares the batch; the other rows draw, in row order,
from the generator the caller passes (the engine's, seeded by `--seed`, so that a run
repeats), or torch's default one. (vLLM's exponential race, argmax of
p / E with E ~ Exp(1) per token, costs a vocabulary of exponentials per row: 65 ms of a
batch-64 step on a 2-core CPU, where this draw takes about 14.) A batch of greedy rows
only takes an argmax. The rows' settings go to the device in one copy, and only the token ids (with
the logprobs asked for) come back, in one copy.

Whatever goes wrong here depends on the rows' settings or logits, that is on one request,
so it fails that row alone and never the model's step: a row whose logits hold no
distribution (a NaN, an infinity, nothing finite) is found in the batch and gets an error
instead of a token while the others sample; should the batch fail for another reason,
every generator is rewound and the rows are sampled one by one, on the same logits.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagefleet_serve.engine.penalties import TokenCounts
from pagefleet_serve.sampling_params import SamplingParams
from pagefleet_serve.structured.grammar import mask_logits
from pagefleet_serve.structured.thinking_gate import OutputConstraint

# Tokens per block of the two-level inverse CDF (see `_invert_cdf`).
CDF_BLOCK = 256


@dataclass
class SampleRow:
    """One draw. The penalties read `counts` (the sequence's, on the device) plus
    `output_token_ids` on top (the drafts before a verified position); a row without
    `counts` carries its whole output and prompt as lists instead."""

    params: SamplingParams
    generator: torch.Generator | None  # on the logits' device
    output_token_ids: list[int]  # for the penalties
    prompt_token_ids: list[int]  # repetition penalty covers the prompt too; unread with counts
    grammar: OutputConstraint | None = None  # the sequence's structured-output constraint
    counts: TokenCounts | None = None
    # Tokens this draw may not pick: the stop tokens while min_tokens is not reached.
    banned: tuple[int, ...] = ()


class SamplingError(RuntimeError):
    """Sampling failed for settings a client chose; the engine is not at fault."""


@dataclass
class SampledToken:
    token_id: int  # -1 when `error` says why the row could not be sampled
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None  # most likely first
    error: str | None = None


def sample(
    logits: torch.Tensor, rows: list[SampleRow], generator: torch.Generator | None = None
) -> list[SampledToken]:
    """logits: (R, V) float32 on any device, one row per entry of `rows`; `generator` (on
    the logits' device) draws for the rows without one of their own (None: torch's
    default generator). A row that cannot be sampled gets a token whose `error` says why;
    the others their tokens."""
    if len(rows) == 1:
        return [_sample_alone(logits, rows[0], generator)]
    try:
        with _rewound_on_error(rows, generator):
            return _sample(logits, rows, generator)
    except Exception:  # noqa: BLE001 - one row's settings: find it by sampling them apart
        return [_sample_alone(logits[i : i + 1], row, generator) for i, row in enumerate(rows)]


def _sample_alone(
    logits: torch.Tensor, row: SampleRow, generator: torch.Generator | None
) -> SampledToken:
    try:
        with _rewound_on_error([row], generator):
            return _sample(logits, [row], generator)[0]
    except Exception as exc:  # noqa: BLE001 - this row's settings, and nobody else's
        return SampledToken(-1, error=f"sampling failed: {type(exc).__name__}: {exc}")


class _rewound_on_error:
    """Restores the rows' generators (and the shared one) when the block raises, so that
    sampling the rows again draws what a first try would have."""

    def __init__(self, rows: list[SampleRow], generator: torch.Generator | None) -> None:
        self.generators = [g for g in [*(r.generator for r in rows), generator] if g is not None]
        self.states = [g.get_state() for g in self.generators]

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, traceback) -> bool:
        if exc_type is not None:
            for g, state in zip(self.generators, self.states, strict=True):
                g.set_state(state)
        return False


def _sample(
    logits: torch.Tensor, rows: list[SampleRow], generator: torch.Generator | None
) -> list[SampledToken]:
    # Row-wise ops, and xgrammar's in-place mask, need rows that lie contiguous (a few CPU
    # rows of compute_logits come transposed).
    logits = logits.contiguous()
    logprob_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    raw_logprobs = None
    if logprob_rows:  # the model's distribution: before masks, penalties and filters
        raw_logprobs = torch.log_softmax(logits[_on(logits, logprob_rows)], dim=-1)

    biased = any(r.params.logit_bias or r.banned for r in rows)
    if biased:  # the request's own edits of its distribution come first, as in vLLM
        logits = _apply_bias_and_bans(logits.clone(), rows)
    penalized = any(r.params.needs_penalties for r in rows)
    if penalized:
        logits = _apply_penalties(logits if biased else logits.clone(), rows)

    # The mask comes after every logit transform: a transform after it could turn a masked
    # -inf back into a value (a penalty of 0 makes -inf * 0 = NaN, which argmax picks).
    # Only constrained rows are masked; a batch without any pays for this one scan.
    matchers = {
        i: r.grammar for i, r in enumerate(rows) if r.grammar is not None and r.grammar.masks_next
    }
    if matchers:
        if not (penalized or biased):
            logits = logits.clone()  # a retry of the step must find the caller's logits intact
        mask_logits(logits, matchers)

    # A row without a finite maximum (a NaN anywhere, +inf, or nothing but -inf) holds no
    # distribution: it is marked, zeroed so that the batched ops run, and fails alone.
    samplable = torch.isfinite(logits.amax(dim=-1))
    logits = torch.where(samplable[:, None], logits, 0.0)
    greedy = [r.params.greedy for r in rows]
    if all(greedy):
        token_ids = logits.argmax(dim=-1)
    elif any(greedy):
        token_ids = torch.where(
            _on(logits, greedy), logits.argmax(dim=-1), _draw(logits, rows, greedy, generator)
        )
    else:
        token_ids = _draw(logits, rows, greedy, generator)
    token_ids = torch.where(samplable, token_ids, -1)
    return _to_host(token_ids, raw_logprobs, logprob_rows, rows)


def _on(like: torch.Tensor, values: list, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A per-row list as a tensor on `like`'s device (one host-to-device copy)."""
    return torch.tensor(values, dtype=dtype, device=like.device)


def _draw(
    logits: torch.Tensor,
    rows: list[SampleRow],
    greedy: list[bool],
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Each row's draw from its temperature-scaled, filtered distribution (greedy rows draw
    nothing: their noise is never read); rows without a generator draw from `generator`."""
    vocab = logits.shape[1]
    # One copy for every row's settings: temperature, top_k, top_p, min_p.
    settings = _on(
        logits,
        [
            [
                1.0 if g else r.params.temperature,
                min(r.params.top_k, vocab) if r.params.top_k > 0 else vocab,
                r.params.top_p,
                r.params.min_p,
            ]
            for r, g in zip(rows, greedy, strict=True)
        ],
        logits.dtype,
    )
    scaled = logits
    if any(not g and r.params.temperature != 1.0 for r, g in zip(rows, greedy, strict=True)):
        # (Temperature 1, the default, divides nothing.) A logit a small temperature sends
        # past float32 stays at its largest value: the row draws among its top tokens, where
        # +inf would make its softmax NaN.
        scaled = (logits / settings[:, :1]).clamp_(max=torch.finfo(logits.dtype).max)
    if any(0 < r.params.top_k < vocab or r.params.top_p < 1.0 or r.params.min_p for r in rows):
        scaled = _apply_top_k_top_p_min_p(scaled, settings[:, 1], settings[:, 2], settings[:, 3])
    # Zeros, not empty: greedy rows draw nothing, but the inverse CDF runs over every row,
    # and a NaN left in memory sends a row past its last block.
    uniform = torch.zeros(len(rows), 1, dtype=torch.float64, device=logits.device)
    unseeded = [i for i, r in enumerate(rows) if r.generator is None and not greedy[i]]
    if len(unseeded) == len(rows):
        uniform.uniform_(generator=generator)
    elif unseeded:
        drawn = torch.empty_like(uniform[: len(unseeded)]).uniform_(generator=generator)
        uniform[_on(logits, unseeded)] = drawn
    for i, r in enumerate(rows):
        if r.generator is not None and not greedy[i]:
            draw_uniform(uniform[i], r.generator)
    return _invert_cdf(torch.softmax(scaled, dim=-1), uniform)


def _invert_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """probs (R, V), uniform (R, 1) float64 in [0, 1) -> (R,) the first token whose
    cumulative mass passes u times the row's total: always one with mass, never a filtered
    token. In two levels (which block of CDF_BLOCK tokens, then which token in it): a
    running sum over the whole vocabulary costs 3x more. Sums in float64: a float32 one
    near 1 drops increments under 2^-24, and with them the chance of tokens that unlikely."""
    num_rows, vocab = probs.shape
    num_blocks = -(-vocab // CDF_BLOCK)
    if num_blocks * CDF_BLOCK != vocab:  # a copy: only for a vocabulary not in whole blocks
        probs = F.pad(probs, (0, num_blocks * CDF_BLOCK - vocab))
    blocks = probs.view(num_rows, num_blocks, CDF_BLOCK)
    # Each block summed in float32 (its tokens' own precision), the running sum in float64.
    block_cdf = blocks.sum(dim=-1).to(torch.float64).cumsum_(dim=-1)  # (R, blocks)
    target = _below(uniform * block_cdf[:, -1:], block_cdf[:, -1:])  # u * total can round up
    block = torch.searchsorted(block_cdf, target, right=True)  # (R, 1), a block with mass
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_(min=0)), 0.0)
    within = blocks.gather(1, block[:, :, None].expand(-1, -1, CDF_BLOCK))[:, 0]
    cdf = within.to(torch.float64).cumsum_(dim=-1)  # (R, CDF_BLOCK)
    token = torch.searchsorted(cdf, _below(target - before, cdf[:, -1:]), right=True)
    return (block * CDF_BLOCK + token)[:, 0]


def _below(x: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """x, kept strictly below bound (> 0)."""
    return torch.minimum(x, torch.nextafter(bound, torch.zeros_like(bound)))


def draw_uniform(out: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """What one seeded draw takes from its generator: one uniform number."""
    return out.uniform_(generator=generator)


def _to_host(
    token_ids: torch.Tensor,
    raw_logprobs: torch.Tensor | None,
    logprob_rows: list[int],
    rows: list[SampleRow],
) -> list[SampledToken]:
    """The sampled tokens, and the logprobs asked for, in one device-to-host copy (a row
    that could not be sampled comes back as token -1, an error)."""
    if not logprob_rows:
        return [_token(t) for t in token_ids.tolist()]
    num_rows, num_logprob_rows = len(rows), len(logprob_rows)
    k = max(rows[i].params.logprobs for i in logprob_rows)
    chosen_ids = token_ids[_on(token_ids, logprob_rows)].clamp(min=0)
    chosen = raw_logprobs.gather(1, chosen_ids[:, None])
    values, indices = raw_logprobs.topk(k, dim=-1)
    # float64 holds every token id and float32 logprob exactly: one copy brings all back.
    packed = torch.cat(
        [t.flatten().double() for t in (token_ids, chosen, values, indices)]
    ).tolist()
    ids = [int(t) for t in packed[:num_rows]]
    chosen_values = packed[num_rows : num_rows + num_logprob_rows]
    top_start = num_rows + num_logprob_rows
    top_values = packed[top_start : top_start + num_logprob_rows * k]
    top_ids = packed[top_start + num_logprob_rows * k :]
    results = [_token(t) for t in ids]
    for j, i in enumerate(logprob_rows):
        if results[i].error is not None:
            continue
        want = rows[i].params.logprobs
        row = slice(j * k, j * k + want)
        top = [(int(t), v) for t, v in zip(top_ids[row], top_values[row], strict=True)]
        results[i] = SampledToken(ids[i], chosen_values[j], top)
    return results


def _token(token_id: int) -> SampledToken:
    if token_id >= 0:
        return SampledToken(token_id)
    return SampledToken(
        -1,
        error="sampling failed: the row's logits hold no distribution (NaN, infinite, or "
        "nothing finite once its penalties and constraint were applied)",
    )


def _apply_bias_and_bans(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Each row's logit_bias added and its banned tokens set to -inf, in place, with one
    host-to-device copy per kind (token ids past the vocabulary were refused upstream)."""
    vocab = logits.shape[1]
    bias = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias if t < vocab]
    if bias:
        at, token_ids, values = zip(*bias, strict=True)
        index = (_on(logits, list(at)), _on(logits, list(token_ids)))
        logits.index_put_(index, _on(logits, list(values), logits.dtype), accumulate=True)
    bans = [(i, t) for i, r in enumerate(rows) for t in r.banned if 0 <= t < vocab]
    if bans:
        at, token_ids = zip(*bans, strict=True)
        logits[_on(logits, list(at)), _on(logits, list(token_ids))] = float("-inf")
    return logits


def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    vocab, dtype, device = logits.shape[1], logits.dtype, logits.device
    nothing_seen = torch.zeros(vocab, dtype=torch.bool, device=device)
    no_output = torch.zeros(vocab, dtype=torch.float32, device=device)
    prompt_rows, output_rows = [], []
    for r in rows:
        if not r.params.needs_penalties:
            prompt_rows.append(nothing_seen)
            output_rows.append(no_output)
            continue
        counts = r.counts
        if counts is None:  # lists: counted here, for this step only
            repetition = r.params.repetition_penalty != 1.0
            counts = TokenCounts.build(r.prompt_token_ids, vocab, device, repetition)
        prompt_rows.append(nothing_seen if counts.prompt_seen is None else counts.prompt_seen)
        output_rows.append(counts.plus(r.output_token_ids))
    in_prompt = torch.stack(prompt_rows)
    output_counts = torch.stack(output_rows).to(dtype)
    penalties = _on(
        logits,
        [
            [r.params.repetition_penalty, r.params.presence_penalty, r.params.frequency_penalty]
            for r in rows
        ],
        dtype,
    )
    repetition, presence, frequency = (penalties[:, j : j + 1] for j in range(3))
    # Repetition (CTRL-style, as in Hugging Face and vLLM): seen tokens' logits are divided
    # by the penalty when positive and multiplied when negative.
    seen = in_prompt | (output_counts > 0)
    penalty = repetition.expand_as(logits)
    logits = torch.where(seen & (logits > 0), logits / penalty, logits)
    logits = torch.where(seen & (logits <= 0), logits * penalty, logits)
    # OpenAI's presence and frequency penalties count output tokens only.
    logits -= frequency * output_counts
    logits -= presence * (output_counts > 0).to(dtype)
    # A tiny or huge repetition penalty can push a logit to +-inf (then softmax gives NaN).
    finite = torch.finfo(dtype)
    return logits.clamp_(finite.min, finite.max)


def _apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Per-row (R,) top_k (the vocabulary size when off; above it keeps every token, as
    vLLM does), top_p and min_p, all on the logits' device."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    remove = ranks >= top_k[:, None]
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (always at least one token). A row
    # with top_p 1 keeps every token: its running sum can round up to 1 before the tail.
    mass_before = probs.cumsum(dim=-1) - probs
    remove |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    remove |= probs < (min_p[:, None] * probs[:, :1])
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
