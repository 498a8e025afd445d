"""The sampler fails a row alone (issue 42, items 10 and 11): a row whose logits hold no
distribution (NaN, as a penalty float32 could not carry once made) fails its request with a
clear error while the other rows of the same step sample, and the model is never run again
for a sampling error (the step used to fail whole and be retried in halves)."""

import pytest
import torch
from pagefleet_serve import LLM, SamplingParams
from pagefleet_serve.engine import sampler
from pagefleet_serve.engine.sampler import SampleRow, sample

POISON_SEED = 424_242  # the rows the injected fault turns into NaN


@pytest.fixture(scope="module")
def llm():
    return LLM(
        "builtin://smollm2-135m",
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=64 << 20,
    )


def nan_penalties(monkeypatch):
    """The penalties of a poisoned row leave NaN logits (what `repetition_penalty: 1e-300`
    did before floats float32 cannot carry were refused: a model or kernel fault looks the
    same to the sampler)."""
    real = sampler._apply_penalties

    def apply(logits, rows):
        logits = real(logits, rows)
        for i, r in enumerate(rows):
            if r.params.seed == POISON_SEED:
                logits[i] = float("nan")
        return logits

    monkeypatch.setattr(sampler, "_apply_penalties", apply)


def count_forward_passes(monkeypatch, llm) -> list[int]:
    runner, calls = llm.engine.runner, [0]
    real = runner.run

    def run(inputs, *rest):
        calls[0] += 1
        return real(inputs, *rest)

    monkeypatch.setattr(runner, "run", run)
    return calls


def run(llm, requests):
    """Step to completion; returns ({request_id: (token ids, error)}, steps)."""
    for request_id, (prompt, params) in requests.items():
        llm.add_request(request_id, prompt, params)
    results, steps = {}, 0
    while llm.has_unfinished_requests():
        steps += 1
        for out in llm.step():
            ids, error = results.get(out.request_id, ([], None))
            ids = ids + [t for o in out.outputs for t in o.token_ids]
            results[out.request_id] = (ids, out.error or error)
    return results, steps


def normal(i):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=i, repetition_penalty=1.2)
    return (f"Tell me fact {i} about the sea.", params)


def test_a_nan_row_fails_alone_and_the_model_runs_once_a_step(llm, monkeypatch):
    others = {f"normal-{i}": normal(i) for i in range(3)}
    alone, _ = run(llm, others)
    nan_penalties(monkeypatch)
    forward_passes = count_forward_passes(monkeypatch, llm)
    poison = SamplingParams(max_tokens=8, seed=POISON_SEED, repetition_penalty=1.1)
    greedy_poison = SamplingParams(
        max_tokens=8, temperature=0.0, seed=POISON_SEED, frequency_penalty=0.5
    )
    results, steps = run(
        llm,
        others
        | {"poison": ("hi", poison), "greedy-poison": ("hello", greedy_poison)}
        | {
            "poison-n": (
                "hey",
                SamplingParams(n=2, max_tokens=4, seed=POISON_SEED, presence_penalty=1.0),
            )
        },
    )
    for request_id in ("poison", "greedy-poison", "poison-n"):
        tokens, error = results[request_id]
        assert tokens == [] and "hold no distribution" in error, (request_id, error)
    assert {k: results[k] for k in others} == alone  # the same tokens as without the fault
    assert forward_passes[0] == steps  # no step was run twice


def test_a_failing_batch_is_sampled_apart_on_the_same_logits(monkeypatch):
    # A failure that is no NaN (here an injected one for one row's settings) fails the
    # batch's sampling: its rows are sampled apart, and only that row gets an error.
    real = sampler._sample

    def failing(logits, rows, generator):
        if any(r.params.seed == POISON_SEED for r in rows):
            raise OverflowError("Overflow when unpacking long long")
        return real(logits, rows, generator)

    monkeypatch.setattr(sampler, "_sample", failing)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams(temperature=0.0)
    rows = [
        SampleRow(greedy, None, [], []),
        SampleRow(SamplingParams(temperature=0.0, seed=POISON_SEED), None, [], []),
        SampleRow(greedy, None, [], []),
    ]
    first, failed, last = sample(logits, rows)
    assert (first.token_id, last.token_id) == tuple(logits[[0, 2]].argmax(-1).tolist())
    assert failed.token_id == -1 and "OverflowError: Overflow" in failed.error


def test_a_temperature_that_overflows_a_logit_draws_among_the_top_tokens():
    # A huge penalized logit over a small temperature passes float32's range: the row keeps
    # it at float32's largest value (its top token), where +inf made its softmax NaN.
    logits = torch.tensor([[3.0e38, 1.0, 2.0, 3.0e38], [0.0, 1.0, 2.0, 3.0]])
    rows = [
        SampleRow(SamplingParams(temperature=0.5, seed=1), torch.Generator().manual_seed(s), [], [])
        for s in (1, 2)
    ]
    drawn = [sample(logits, rows)[0] for _ in range(20)]
    assert all(t.error is None and t.token_id in (0, 3) for t in drawn)
