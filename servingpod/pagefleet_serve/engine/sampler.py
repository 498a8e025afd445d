"""Logits -> next tokens, for a whole step at once.

Each row is one sample to draw. Penalties, temperature, top-k, top-p and min-p are applied
as batched tensor ops; the draw is an exponential race (argmax of p / E with E ~ Exp(1)),
which lets a seeded row draw its noise from its own generator, so a seed gives the same
tokens whatever else shares the batch.

Whatever goes wrong here depends on the rows' settings, that is on what clients sent, so it
is raised as `SamplingError` (with every generator rewound): the engine then retries the
step's rows apart and fails only the request that cannot be sampled.
"""

from dataclasses import dataclass

import torch

from pagefleet_serve.sampling_params import SamplingParams
from pagefleet_serve.structured.grammar import GrammarMatcher, mask_logits


@dataclass
class SampleRow:
    params: SamplingParams
    generator: torch.Generator | None
    output_token_ids: list[int]  # for the penalties
    prompt_token_ids: list[int]  # repetition penalty covers the prompt too
    grammar: GrammarMatcher | None = None  # the sequence's structured-output constraint


class SamplingError(RuntimeError):
    """Sampling failed for settings a client chose; the engine is not at fault."""


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None  # most likely first


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> list[SampledToken]:
    """logits: (R, V) float32, one row per entry of `rows`. Raises SamplingError, after
    rewinding every generator, so that a retry draws the same noise."""
    states = [r.generator.get_state() if r.generator is not None else None for r in rows]
    try:
        return _sample(logits, rows)
    except Exception as exc:  # noqa: BLE001 - any failure here is the rows' settings
        for row, state in zip(rows, states, strict=True):
            if state is not None:
                row.generator.set_state(state)
        raise SamplingError(f"sampling failed: {type(exc).__name__}: {exc}") from exc


def _sample(logits: torch.Tensor, rows: list[SampleRow]) -> list[SampledToken]:
    num_rows, vocab = logits.shape
    want_logprobs = [r.params.logprobs is not None for r in rows]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

    # Only constrained rows are masked; a batch without any pays for this one scan.
    matchers = {
        i: r.grammar
        for i, r in enumerate(rows)
        if r.grammar is not None and not r.grammar.is_terminated
    }
    if matchers:
        logits = logits.clone()  # a retry of the step must find the caller's logits intact
        mask_logits(logits, matchers)

    if any(r.params.needs_penalties for r in rows):
        logits = _apply_penalties(logits.clone(), rows)

    greedy = torch.tensor([r.params.greedy for r in rows])
    temperature = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype)
    token_ids = logits.argmax(dim=-1)
    if not bool(greedy.all()):
        scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
        scaled = _apply_top_k_top_p_min_p(scaled, rows)
        probs = torch.softmax(scaled, dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), vocab).exponential_()
        for i, r in enumerate(rows):
            if r.generator is not None and not greedy[i]:
                noise[i].exponential_(generator=r.generator)
        drawn = (probs / noise).argmax(dim=-1)
        token_ids = torch.where(greedy, token_ids, drawn)

    ids = token_ids.tolist()
    results = []
    for i, token in enumerate(ids):
        if not want_logprobs[i]:
            results.append(SampledToken(token))
            continue
        row_logprobs = raw_logprobs[i]
        k = rows[i].params.logprobs
        top = []
        if k:
            values, indices = row_logprobs.topk(k)
            top = list(zip(indices.tolist(), values.tolist(), strict=True))
        results.append(SampledToken(token, float(row_logprobs[token]), top))
    return results


def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    num_rows, vocab = logits.shape
    output_counts = torch.zeros(num_rows, vocab, dtype=logits.dtype)
    in_prompt = torch.zeros(num_rows, vocab, dtype=torch.bool)
    for i, r in enumerate(rows):
        if not r.params.needs_penalties:
            continue
        if r.output_token_ids:
            ids = torch.tensor(r.output_token_ids)
            output_counts[i].index_add_(0, ids, torch.ones(len(ids), dtype=logits.dtype))
        if r.params.repetition_penalty != 1.0 and r.prompt_token_ids:
            in_prompt[i, torch.tensor(r.prompt_token_ids)] = True
    repetition = torch.tensor([r.params.repetition_penalty for r in rows], dtype=logits.dtype)
    presence = torch.tensor([r.params.presence_penalty for r in rows], dtype=logits.dtype)
    frequency = torch.tensor([r.params.frequency_penalty for r in rows], dtype=logits.dtype)
    # Repetition (CTRL-style, as in Hugging Face and vLLM): seen tokens' logits are divided
    # by the penalty when positive and multiplied when negative.
    seen = in_prompt | (output_counts > 0)
    penalty = repetition[:, None].expand_as(logits)
    logits = torch.where(seen & (logits > 0), logits / penalty, logits)
    logits = torch.where(seen & (logits <= 0), logits * penalty, logits)
    # OpenAI's presence and frequency penalties count output tokens only.
    logits -= frequency[:, None] * output_counts
    logits -= presence[:, None] * (output_counts > 0).to(logits.dtype)
    # A tiny or huge repetition penalty can push a logit to +-inf (then softmax gives NaN).
    finite = torch.finfo(logits.dtype)
    return logits.clamp_(finite.min, finite.max)


def _apply_top_k_top_p_min_p(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    vocab = logits.shape[1]
    # top_k above the vocabulary keeps every token (as vLLM does), and never reaches a tensor.
    top_k = [min(r.params.top_k, vocab) if r.params.top_k > 0 else vocab for r in rows]
    top_p = [r.params.top_p for r in rows]
    min_p = [r.params.min_p for r in rows]
    if all(k >= vocab for k in top_k) and all(p >= 1.0 for p in top_p) and not any(min_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab)[None, :]
    remove = ranks >= torch.tensor(top_k)[:, None]
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (always at least one token).
    mass_before = probs.cumsum(dim=-1) - probs
    remove |= mass_before >= torch.tensor(top_p, dtype=probs.dtype)[:, None]
    remove |= probs < (torch.tensor(min_p, dtype=probs.dtype)[:, None] * probs[:, :1])
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
