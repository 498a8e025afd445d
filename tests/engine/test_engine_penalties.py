"""The penalties' token counts live on the device (issue 42, item 7): built once per
sequence, brought up to date with each step's new tokens, the prompt's mask shared by the
samples of one prompt; a step no longer sends every row's prompt to the device again."""

import pytest
import torch
from pagefleet_serve import LLM, SamplingParams
from pagefleet_serve.engine.penalties import TokenCounts
from pagefleet_serve.engine.sampler import SampleRow, _apply_penalties, sample

VOCAB = 50
PENALTIES = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4)


@pytest.fixture(scope="module")
def llm():
    return LLM(
        "builtin://smollm2-135m",
        dtype="float32",
        max_model_len=2048,
        kv_cache_memory_bytes=128 << 20,
    )


def test_counts_kept_up_to_date_penalize_as_the_lists_do():
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (30,), generator=gen).tolist()
    tokens = list(prompt)
    counts = TokenCounts.build(prompt, VOCAB, torch.device("cpu"), with_prompt=True)
    for step in range(6):
        counts.catch_up(tokens, len(prompt))
        logits = torch.randn(2, VOCAB, generator=gen) * 5
        output = tokens[len(prompt) :]
        by_counts = SampleRow(PENALTIES, None, [], [], counts=counts)
        drafts = [3, 3, 7]  # counted on top of the counts, as a verified position's drafts
        with_drafts = SampleRow(PENALTIES, None, drafts, [], counts=counts)
        by_lists = [SampleRow(PENALTIES, None, out, prompt) for out in (output, output + drafts)]
        assert torch.equal(
            _apply_penalties(logits.clone(), [by_counts, with_drafts]),
            _apply_penalties(logits.clone(), by_lists),
        )
        tokens += [step % 4, 11 + step]
    assert counts.num_counted == 10  # the last two tokens are not counted yet
    fork = counts.fork()
    assert fork.prompt_seen is counts.prompt_seen  # shared, never written
    fork.catch_up([*tokens, 5], len(prompt))
    assert counts.output_counts[5] == 0 and fork.output_counts[5] == 1


def test_a_sequence_builds_its_counts_once_and_its_samples_share_the_prompt(llm):
    prompt = llm.chat_prompt([{"role": "user", "content": "Describe a storm at sea. " * 20}])
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=3, repetition_penalty=1.2)
    llm.add_request("n3", prompt, params)
    prompt_ids = None
    while llm.has_unfinished_requests():
        llm.step()
        family = [s for s in llm.engine.scheduler.running if s.request_id == "n3"]
        if not family or family[0].token_counts is None:
            continue
        first = family[0]
        if prompt_ids is None:
            prompt_ids = first.token_ids[: first.num_prompt_tokens]
            expected_seen = torch.zeros(first.token_counts.prompt_seen.shape, dtype=torch.bool)
            expected_seen[prompt_ids] = True
            assert torch.equal(first.token_counts.prompt_seen, expected_seen)
        for seq in family:
            counts = seq.token_counts
            assert counts.prompt_seen is first.token_counts.prompt_seen
            counted = seq.output_token_ids[: counts.num_counted]
            assert counts.num_counted >= seq.num_output_tokens - 1
            vocab = counts.output_counts.numel()
            expected = torch.bincount(torch.tensor(counted, dtype=torch.int64), minlength=vocab)
            assert torch.equal(counts.output_counts, expected.float())
    assert prompt_ids is not None


def test_a_step_sends_no_prompt_to_the_device_again(llm, monkeypatch):
    # 8 samples of a ~1,000-token prompt with a repetition penalty: the prompt goes to the
    # device once; then each step sends a few ids per row (the old sampler sent 8 rows x the
    # prompt every step).
    prompt = llm.chat_prompt([{"role": "user", "content": "Tell me about rivers. " * 200}])
    num_prompt = len(llm.tokenizer.encode(prompt, add_special_tokens=False))
    assert num_prompt > 900
    params = SamplingParams(n=8, max_tokens=8, temperature=1.0, seed=1, repetition_penalty=1.1)
    llm.add_request("long", prompt, params)
    while len(llm.engine.scheduler.running) < 8:
        llm.step()  # the prefill, and the first sampling (the counts are built there)
    real, sent = torch.tensor, [0]

    def tensor(data, *args, **kwargs):
        out = real(data, *args, **kwargs)
        sent[0] += out.numel()
        return out

    monkeypatch.setattr(torch, "tensor", tensor)
    while llm.has_unfinished_requests():
        llm.step()
    assert sent[0] < num_prompt  # 7 decode steps


def test_penalties_still_penalize(llm):
    # The counts reach the sampler: a strong repetition penalty changes greedy output.
    prompt = llm.chat_prompt([{"role": "user", "content": "Repeat: the the the the"}])
    plain = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0))[0]
    penalized = SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=5.0)
    assert llm.generate(prompt, penalized)[0].outputs[0].token_ids != plain.outputs[0].token_ids
    drawn = sample(
        torch.tensor([[5.0, 4.0, 0.0]]),
        [SampleRow(SamplingParams(temperature=0.0, frequency_penalty=2.0), None, [0, 0], [])],
    )
    assert drawn[0].token_id == 1
