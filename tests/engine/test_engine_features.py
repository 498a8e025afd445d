"""Engine behaviour on the built-in model: prefix caching, chunked prefill, seeds, n > 1,
stop strings, logprobs, UTF-8 streaming, aborts and bad input."""

import pytest
import torch
from pagefleet_serve import LLM, SamplingParams
from pagefleet_serve.sampling_params import sample_seed

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def shared_llm():
    # float32: a seeded or greedy request gives the same tokens in any batch.
    return LLM(
        "builtin://smollm2-135m",
        dtype="float32",
        max_model_len=2048,
        kv_cache_memory_bytes=512 << 20,
    )


@pytest.fixture
def llm(shared_llm):
    yield shared_llm
    assert not shared_llm.engine.has_unfinished_requests()
    shared_llm.engine.block_manager.check_no_leaks()


def ask(llm, question):
    return llm.chat_prompt([{"role": "user", "content": question}])


def run_steps(engine):
    """Step to completion; returns {request_id: [delta outputs per step]}."""
    deltas = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.setdefault(out.request_id, []).append(out)
    return deltas


def test_prefix_cache_reuses_a_512_token_prefix(llm, make_llm):
    tokenizer = llm.tokenizer
    text = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(80))
    prefix = tokenizer.encode(text, add_special_tokens=False)[:512]
    first = prefix + tokenizer.encode(" Which item number came first?", add_special_tokens=False)
    second = prefix + tokenizer.encode(
        " Summarize the list in five words.", add_special_tokens=False
    )
    llm.generate(first, GREEDY)
    stats = llm.engine.stats()
    warm = llm.generate(second, GREEDY)[0]
    after = llm.engine.stats()
    # Only the uncached suffix was computed: every one of the 32 prefix blocks was a hit.
    assert after.prefix_cache_queries - stats.prefix_cache_queries == len(second)
    assert after.prefix_cache_hits - stats.prefix_cache_hits == 512
    assert warm.num_cached_tokens == 512
    cold = make_llm(
        max_model_len=2048, kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False
    )
    cold_out = cold.generate(second, GREEDY)[0]
    assert cold_out.num_cached_tokens == 0
    assert warm.outputs[0].token_ids == cold_out.outputs[0].token_ids


def test_chunked_prefill_never_starves_a_running_decode(make_llm):
    llm = make_llm(max_model_len=2048, kv_cache_memory_bytes=256 << 20, max_num_batched_tokens=64)
    engine = llm  # the offline LLM: requests in, text out, one step at a time
    engine.add_request(
        "running",
        ask(llm, "Tell me a long story."),
        SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True),
    )
    engine.step()  # its prefill
    long_prompt = list(range(1000, 2000))  # 1,000 tokens
    engine.add_request("long", long_prompt, SamplingParams(max_tokens=1, temperature=0.0))
    prefill_steps = 0
    while True:
        outputs = {o.request_id: o for o in engine.step()}
        prefill_steps += 1
        assert len(outputs["running"].outputs[0].token_ids) == 1  # a token in every step
        if "long" in outputs:
            break
    assert prefill_steps >= 16  # 1,000 tokens / (64 - 1 decode) per step
    engine.abort_request("running")
    run_steps(engine)


def test_seeded_sampling_is_independent_of_the_batch(llm):
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    prompt = ask(llm, "Write a sentence about the ocean.")
    alone = llm.generate(prompt, seeded)[0].outputs[0].token_ids
    busy = [ask(llm, f"Give me fact number {i} about space.") for i in range(8)]
    others = [
        SamplingParams(max_tokens=30, temperature=1.0, seed=i if i % 2 else None) for i in range(8)
    ]
    results = llm.generate([*busy[:4], prompt, *busy[4:]], [*others[:4], seeded, *others[4:]])
    assert results[4].outputs[0].token_ids == alone
    other_seed = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=4321)
    assert llm.generate(prompt, other_seed)[0].outputs[0].token_ids != alone


def test_n_samples_share_the_prompt_and_copy_its_last_block_on_write(llm):
    prompt = ask(llm, "Name a color and explain why you like it.")  # not a multiple of 16
    assert len(llm.tokenizer.encode(prompt, add_special_tokens=False)) % 16
    greedy = llm.generate(prompt, GREEDY)[0].outputs[0].token_ids
    three = llm.generate(prompt, SamplingParams(n=3, max_tokens=24, temperature=0.0))[0]
    assert [o.token_ids for o in three.outputs] == [greedy] * 3
    # Sample i of a seeded n-request draws like a single request seeded with
    # sample_seed(seed, i): so every sample saw the right KV after the copy-on-write.
    sampled = SamplingParams(n=3, max_tokens=24, temperature=1.0, seed=7)
    many = llm.generate(prompt, sampled)[0].outputs
    singles = [
        llm.generate(
            prompt, SamplingParams(max_tokens=24, temperature=1.0, seed=sample_seed(7, i))
        )[0]
        for i in range(3)
    ]
    assert [o.token_ids for o in many] == [s.outputs[0].token_ids for s in singles]
    assert len({tuple(o.token_ids) for o in many}) > 1


def test_stop_strings_are_cut_and_never_streamed(llm):
    prompt = ask(llm, "What is the capital of France?")
    full = llm.generate(prompt, GREEDY)[0].outputs[0]
    assert "is Paris" in full.text
    engine = llm  # the offline LLM: requests in, text out, one step at a time
    engine.add_request(
        "stop",
        prompt,
        SamplingParams(max_tokens=24, temperature=0.0, stop=["is Paris", "never appears"]),
    )
    deltas = run_steps(engine)["stop"]
    streamed = "".join(o.text for d in deltas for o in d.outputs)
    assert streamed == full.text[: full.text.index("is Paris")]
    assert deltas[-1].outputs[0].finish_reason == "stop"


def test_stop_token_ids_and_length(llm):
    prompt = ask(llm, "What is the capital of France?")
    full = llm.generate(prompt, GREEDY)[0].outputs[0]
    stop_id = full.token_ids[2]
    out = llm.generate(
        prompt, SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop_id])
    )[0].outputs[0]
    assert out.token_ids == full.token_ids[:3] and out.finish_reason == "stop"
    out = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0))[0].outputs[0]
    assert out.token_ids == full.token_ids[:2] and out.finish_reason == "length"


def test_logprobs_of_sampled_tokens_and_alternatives(llm):
    out = llm.generate(
        ask(llm, "Say hello."), SamplingParams(max_tokens=8, temperature=0.0, logprobs=3)
    )[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert entry.token_id == token and entry.logprob <= 0
        ids = [t for t, _ in entry.top_logprobs]
        values = [v for _, v in entry.top_logprobs]
        assert len(ids) == 3 and ids[0] == token and values == sorted(values, reverse=True)
        assert entry.logprob == pytest.approx(values[0])


def test_streamed_text_is_valid_utf8(llm):
    engine = llm  # the offline LLM: requests in, text out, one step at a time
    engine.add_request(
        "zh",
        ask(llm, "Translate to Chinese: I love my family."),
        SamplingParams(max_tokens=40, temperature=0.0),
    )
    deltas = run_steps(engine)["zh"]
    pieces = [o.text for d in deltas for o in d.outputs]
    tokens = [t for d in deltas for o in d.outputs for t in o.token_ids]
    assert not any("\ufffd" in p for p in pieces)
    assert any(ord(c) > 0x2E80 for c in "".join(pieces))  # it did write CJK characters
    # The same text as decoding all tokens at once, less a character that max_tokens cut.
    assert "".join(pieces) == llm.tokenizer.decode(tokens, skip_special_tokens=True).rstrip(
        "\ufffd"
    )
    # Some character spanned several tokens, so some step released no text.
    assert len([p for p in pieces if p]) < len(tokens)


def test_abort_running_and_waiting_frees_everything(make_llm):
    llm = make_llm(max_model_len=512, kv_cache_memory_bytes=64 << 20, max_num_seqs=2)
    engine = llm  # the offline LLM: requests in, text out, one step at a time
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for name in ("a", "b", "c"):
        engine.add_request(name, ask(llm, f"Story {name}"), params)
    for _ in range(3):
        engine.step()
    assert engine.stats().num_waiting == 1 and engine.stats().num_used_blocks > 0
    engine.abort_request("a")  # running
    engine.abort_request("c")  # waiting
    finals = {o.request_id: o for o in engine.step() if o.finished}
    assert finals["a"].outputs[0].finish_reason == "abort"
    assert finals["c"].outputs[0].finish_reason == "abort"
    deltas = run_steps(engine)
    assert deltas["b"][-1].outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("field", "make"),
    [
        ("prompt", lambda llm: llm.make_request("x", "", SamplingParams())),
        ("prompt", lambda llm: llm.make_request("x", [], SamplingParams())),
        (
            "prompt",
            lambda llm: llm.make_request("x", [1] * 2040, SamplingParams(max_tokens=16)),
        ),
        ("max_tokens", lambda llm: SamplingParams(max_tokens=0)),
        ("top_p", lambda llm: SamplingParams(top_p=0.0)),
        ("top_p", lambda llm: SamplingParams(top_p=1.5)),
        ("temperature", lambda llm: SamplingParams(temperature=-0.5)),
        ("n", lambda llm: SamplingParams(n=0)),
    ],
)
def test_bad_input_names_the_field_and_others_keep_running(llm, field, make):
    engine = llm  # the offline LLM: requests in, text out, one step at a time
    prompt = ask(llm, "What is the capital of France?")
    engine.add_request("good", prompt, GREEDY)
    engine.step()
    with pytest.raises(ValueError, match=field):
        make(llm)
    out = run_steps(engine)["good"]
    assert "Paris" in "".join(o.outputs[0].text for o in out)


def test_context_length_error_names_both_numbers(llm):
    with pytest.raises(ValueError, match=r"2048 tokens.*2056"):
        llm.make_request("x", [1] * 2040, SamplingParams(max_tokens=16))


# bfloat16 keeps 8 bits of mantissa: measured on the built-in model, greedy logprobs differ
# from float32 by at most ~0.11 nats over these prompts; 0.3 leaves room for other CPUs.
BF16_LOGPROB_TOLERANCE = 0.3


def test_bfloat16_path_matches_float32_within_tolerance(llm, make_llm):
    """The bfloat16 path runs on every CPU (forced, not left to `auto`), against float32."""
    bf16 = make_llm(dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=32 << 20)
    assert next(bf16.engine.runner.model.parameters()).dtype == torch.bfloat16
    prompts = [ask(llm, q) for q in ("What is the capital of France?", "Name a prime number.")]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5)
    reference = [r.outputs[0] for r in llm.generate(prompts, params)]
    for ours, ref in zip(
        [r.outputs[0] for r in bf16.generate(prompts, params)], reference, strict=True
    ):
        for got, want in zip(ours.logprobs, ref.logprobs, strict=True):
            if got.token_id != want.token_id:
                # Only a near-tie in float32 may flip the greedy choice; after it the two
                # texts differ and are not compared further.
                alternatives = dict(want.top_logprobs)
                assert got.token_id in alternatives
                assert want.logprob - alternatives[got.token_id] < BF16_LOGPROB_TOLERANCE
                break
            assert got.logprob == pytest.approx(want.logprob, abs=BF16_LOGPROB_TOLERANCE)
