"""Speculation inside `make test`: seeded sampled requests on a speculating engine get the
tokens of plain decoding (drafts both accepted and rejected, so the seeded generator is
rewound), and a regex constraint holds on a speculating engine (a constrained sequence
decodes one masked token at a time, never an unmasked draft). The long statistical runs
are in test_engine_spec_decode.py, marked slow."""

import re

from pagefleet_serve import SamplingParams
from pagefleet_serve.frontend.tokenizer import load_tokenizer
from pagefleet_serve.structured.constraint import StructuredOutputs

COPY_PROMPT = (
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the "
    "river bank, and the dog does not move."
)


def token_ids(results):
    return [sample.token_ids for result in results for sample in result.outputs]


def test_seeded_samples_on_a_speculating_engine_are_those_of_plain_decoding(make_llm):
    """builtin://tiny-random drafting for itself: its greedy drafts are accepted where the
    seeded draw picks the argmax and rejected elsewhere. Each seed's tokens must be plain
    decoding's: after a rejection the generator is put back where plain decoding leaves
    it, or every later token of that sequence differs."""
    prompts = [[(7 * i + 3 * j) % 500 for j in range(12 + i)] for i in range(4)]
    params = [SamplingParams(max_tokens=24, temperature=0.3, seed=seed) for seed in range(4)]
    config = dict(model="builtin://tiny-random", max_model_len=128)
    plain = make_llm(**config).generate(prompts, params)
    draft = {"model": "builtin://tiny-random", "disable_by_batch_size": None}
    llm = make_llm(**config, speculative_config=draft)
    assert token_ids(llm.generate(prompts, params)) == token_ids(plain)
    spec = llm.engine.stats().spec_decode
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens, spec  # both happened


def test_a_regex_holds_on_a_speculating_engine(make_llm):
    """The built-in model copies the end of the prompt ("The dog does not move."), which
    n-gram lookup drafts and the free request beside accepts. The constrained request must
    write digits where the copy says "not": its greedy tokens are a plain engine's and its
    text matches the regex."""
    tokenizer = load_tokenizer("builtin://smollm2-135m")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": COPY_PROMPT}], tokenize=False, add_generation_prompt=True
    )
    regex = r"The dog does [0-9]{1,3}\."
    constrained = SamplingParams(
        max_tokens=16, temperature=0.0, structured_outputs=StructuredOutputs(regex=regex)
    )
    free = SamplingParams(max_tokens=16, temperature=0.0)
    prompts, params = [prompt, prompt], [constrained, free]
    plain = make_llm().generate(prompts, params)
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None}
    llm = make_llm(speculative_config=ngram)
    results = llm.generate(prompts, params)
    assert re.fullmatch(regex, results[0].outputs[0].text), results[0].outputs[0].text
    assert results[1].outputs[0].text.startswith("The dog does not")
    assert token_ids(results) == token_ids(plain)
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0  # drafts were in play
