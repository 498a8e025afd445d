"""What a request does to its own distribution beyond temperature and the filters, on a
tiny random Llama that transformers wrote (`save_pretrained`), against transformers'
logits: prompt logprobs (every prompt token scored, in chunks of a chunked prefill, with
the prefix cache warm), `logit_bias` and `min_tokens` (EOS and stop tokens held off, stop
strings not matched before it)."""

import pytest
import torch
from pagefleet_serve import LLM, SamplingParams
from pagefleet_serve.frontend.detokenizer import SampleText
from pagefleet_serve.frontend.tokenizer import load_tokenizer

EOS = 2
PROMPT = [(7 * i + 3) % 300 + 10 for i in range(37)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    import transformers

    path = tmp_path_factory.mktemp("tiny-llama")
    config = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,  # far from uniform logits: no greedy near-ties
        bos_token_id=1,
        eos_token_id=EOS,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT])).logits[0].float()
    return path, torch.log_softmax(logits, dim=-1)


@pytest.fixture(scope="module")
def llm(reference):
    # 8-token chunks over 4-token blocks: a 37-token prompt is prefilled in five chunks.
    return LLM(
        str(reference[0]),
        dtype="float32",
        max_model_len=128,
        kv_cache_memory_bytes=4 << 20,
        block_size=4,
        max_num_batched_tokens=8,
    )


def test_prompt_logprobs_score_every_prompt_token_as_transformers_does(llm, reference):
    _, expected = reference
    llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0))  # a warm prefix cache
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3, ignore_eos=True)
    [out] = llm.generate([PROMPT], params)
    entries = out.prompt_logprobs
    assert len(entries) == len(PROMPT) and entries[0] is None
    for position, entry in enumerate(entries[1:]):
        row = expected[position]  # the logits before prompt token position + 1
        assert entry.token_id == PROMPT[position + 1]
        assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=1e-4)
        assert [t for t, _ in entry.top_logprobs] == row.topk(3).indices.tolist()
        for token_id, logprob in entry.top_logprobs:
            assert logprob == pytest.approx(float(row[token_id]), abs=1e-4)
    # The first output token is the last prompt position's draw, not a prompt entry.
    assert out.outputs[0].token_ids[0] == int(expected[-1].argmax())
    none = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0))[0]
    assert none.prompt_logprobs is None


def test_prompt_logprobs_0_give_each_prompt_token_alone(llm, reference):
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    [out] = llm.generate([PROMPT[:5]], params)
    assert [e.top_logprobs for e in out.prompt_logprobs[1:]] == [[]] * 4


def test_logit_bias_forces_and_bans_tokens(llm, reference):
    _, expected = reference
    greedy = int(expected[-1].argmax())
    second = int(expected[-1].topk(2).indices[1])
    banned = SamplingParams(max_tokens=1, temperature=0, logit_bias=((greedy, -100),))
    assert llm.generate([PROMPT], banned)[0].outputs[0].token_ids == [second]
    forced = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logit_bias={77: 100})
    assert forced.logit_bias == ((77, 100),)  # vLLM's dict form, as pairs
    assert llm.generate([PROMPT], forced)[0].outputs[0].token_ids == [77] * 4
    # The logprobs are the model's, before the bias (as vLLM returns them).
    biased = SamplingParams(max_tokens=1, temperature=0, logprobs=0, logit_bias=((77, 100),))
    [token] = llm.generate([PROMPT], biased)[0].outputs[0].logprobs
    assert token.logprob == pytest.approx(float(expected[-1][77]), abs=1e-4)


def test_min_tokens_hold_off_eos_and_stop_tokens(llm, reference):
    _, expected = reference
    greedy = int(expected[-1].argmax())
    stop_at_once = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[greedy])
    first = llm.generate([PROMPT], stop_at_once)[0].outputs[0]
    assert first.token_ids == [greedy] and first.finish_reason == "stop"
    held = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[greedy], min_tokens=5)
    out = llm.generate([PROMPT], held)[0].outputs[0]
    assert len(out.token_ids) >= 5 and greedy not in out.token_ids[:5]
    assert EOS not in out.token_ids[:5]
    assert out.token_ids[0] == int(expected[-1].topk(2).indices[1])


def test_min_tokens_is_bounded_by_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens must be in \[0, 4\]"):
        SamplingParams(max_tokens=4, min_tokens=5)


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        (((-1, 1.0),), "token ids"),
        (((3, 101.0),), r"\[-100, 100\]"),
        (((3, float("nan")),), r"\[-100, 100\]"),
        (tuple((i, 1.0) for i in range(1025)), "at most 1024"),
    ],
)
def test_bad_logit_bias_is_refused_naming_it(bias, message):
    with pytest.raises(ValueError, match=f"logit_bias.*{message}"):
        SamplingParams(logit_bias=bias)


def test_a_logit_bias_token_past_the_vocabulary_is_refused(llm):
    with pytest.raises(ValueError, match=r"logit_bias: token ids must be in \[0, 320\)"):
        llm.generate([PROMPT], SamplingParams(logit_bias=((320, 1.0),)))


def test_stop_strings_do_not_match_before_min_tokens():
    tokenizer = load_tokenizer("builtin://smollm2-135m")
    ids = tokenizer.encode(" stop here and stop again", add_special_tokens=False)
    held = SampleText(tokenizer, [], SamplingParams(stop=["stop"], min_tokens=2), None)
    stopped_at = next(i for i, t in enumerate(ids) if held.add(t))
    assert held.release(True) == " stop here and "
    assert stopped_at > 1 and held.matcher.matched == "stop"
    at_once = SampleText(tokenizer, [], SamplingParams(stop=["stop"]), None)
    assert next(i for i, t in enumerate(ids) if at_once.add(t)) == 0
