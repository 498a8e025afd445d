"""The frontend's output processor where the text pipeline has a choice to make: two stop
strings completed by one token (the cut is at the earlier one, whatever their order in
the request), and a tokenizer whose pieces decode differently alone than after the prompt
(a SentencePiece-style vocabulary, where a word's leading space is the "▁" of its piece
and a piece decoded alone loses it)."""

import json

import pytest
from pagefleet_serve.frontend.output_processor import OutputProcessor
from pagefleet_serve.frontend.tokenizer import load_tokenizer
from pagefleet_serve.messages import Request
from pagefleet_serve.outputs import CompletionOutput, RequestOutput, TokenLogprob
from pagefleet_serve.sampling_params import SamplingParams
from tokenizers import Tokenizer, decoders, models, pre_tokenizers


def run(tokenizer, prompt: str, answer: str, params: SamplingParams) -> list[CompletionOutput]:
    """Feed `answer`'s tokens one step each, as the core sends them; the samples' deltas."""
    processor = OutputProcessor(tokenizer)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    processor.add_request(Request("r", prompt_ids, params, 0.0))
    deltas = []
    for token_id in tokenizer.encode(answer, add_special_tokens=False):
        output = RequestOutput("r", [], [CompletionOutput(0, token_ids=[token_id])], False)
        processed, _ = processor.process(output)
        if processed is None:
            break
        deltas += processed.outputs
    return deltas


@pytest.mark.parametrize("stop", [["swer", "answ"], ["answ", "swer"]])
def test_two_stop_strings_completed_by_one_token_cut_at_the_earlier(smollm_tokenizer, stop):
    # " answer" is one token: it completes "answ" (at 5 in " The answer") and "swer" (at 7).
    assert len(smollm_tokenizer.encode(" answer", add_special_tokens=False)) == 1
    deltas = run(smollm_tokenizer, "Question:", " The answer is 42.", SamplingParams(stop=stop))
    assert "".join(d.text for d in deltas) == " The "
    assert deltas[-1].finish_reason == "stop" and len(deltas) == 2


@pytest.fixture(scope="module")
def sentencepiece_tokenizer(tmp_path_factory):
    """A real `tokenizers` tokenizer with SentencePiece's Metaspace pieces, saved and
    loaded through the product's loader as a model directory would be."""
    words = ["<unk>", "▁Question:", "▁The", "▁answer", "▁is", "▁42."]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    directory = tmp_path_factory.mktemp("sentencepiece")
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(f"file://{directory}")


def test_the_first_output_piece_keeps_its_leading_space_after_the_prompt(
    sentencepiece_tokenizer,
):
    # Alone, "▁The" decodes to "The": the space exists only after something.
    the = sentencepiece_tokenizer.encode(" The", add_special_tokens=False)
    assert sentencepiece_tokenizer.decode(the) == "The"
    deltas = run(sentencepiece_tokenizer, "Question:", " The answer is 42.", SamplingParams())
    assert [d.text for d in deltas] == [" The", " answer", " is", " 42."]


def core_output(index, token_ids, finish_reason=None, logprobs=None):
    sample = CompletionOutput(index, token_ids=list(token_ids), finish_reason=finish_reason)
    sample.logprobs = logprobs
    return RequestOutput("r", [], [sample], False)


def test_decode_abort_and_a_reused_request_id(smollm_tokenizer):
    """`decode` is the tokenizer's text of the ids; a request id in use is refused, naming
    it; an aborted request's later outputs are dropped, and aborting an unknown (or
    already forgotten) id is no error."""
    processor = OutputProcessor(smollm_tokenizer)
    ids = smollm_tokenizer.encode(" The answer", add_special_tokens=False)
    assert processor.decode(ids) == " The answer"
    processor.add_request(Request("r", [1], SamplingParams(), 0.0))
    with pytest.raises(ValueError, match="'r' is already in use"):
        processor.add_request(Request("r", [1], SamplingParams(), 0.0))
    processor.abort("r")
    assert processor.process(core_output(0, ids)) == (None, [])
    processor.abort("r")
    processor.abort("never-added")


def test_samples_a_stop_string_ended_finish_the_request_here(smollm_tokenizer):
    """n=2, both samples ended by a stop string in the frontend while the core still runs
    them: a later delta of an ended sample is dropped (its sibling's, after it in the same
    output, is kept), and once both have ended the output is final and the request
    forgotten, though the core never said finished."""
    processor = OutputProcessor(smollm_tokenizer)
    processor.add_request(Request("r", [1], SamplingParams(n=2, stop=[" answer"]), 0.0))
    the, answer, is_ = smollm_tokenizer.encode(" The answer is", add_special_tokens=False)
    output, stopped = processor.process(core_output(0, [the, answer]))
    assert stopped == [0] and output.outputs[0].finish_reason == "stop"
    assert not output.finished
    later = RequestOutput(
        "r",
        [],
        [CompletionOutput(0, token_ids=[is_]), CompletionOutput(1, token_ids=[the])],
        False,
    )
    output, stopped = processor.process(later)
    assert [(c.index, c.token_ids) for c in output.outputs] == [(1, [the])]
    assert not output.finished and "r" in processor.requests
    output, stopped = processor.process(core_output(1, [answer]))
    assert stopped == [1] and output.finished
    assert "r" not in processor.requests
    assert processor.process(core_output(1, [is_])) == (None, [])


def test_a_stop_string_cuts_the_delta_token_ids_and_logprobs_after_its_token(
    smollm_tokenizer,
):
    """A draft run whose second token completes the stop string: the delta keeps the token
    ids (and logprobs) up to and including that token, none after it."""
    processor = OutputProcessor(smollm_tokenizer)
    processor.add_request(Request("r", [1], SamplingParams(stop=[" answer"], logprobs=0), 0.0))
    ids = smollm_tokenizer.encode(" The answer is 42", add_special_tokens=False)
    logprobs = [TokenLogprob(t, -1.0, []) for t in ids]
    output, stopped = processor.process(core_output(0, ids, logprobs=list(logprobs)))
    (sample,) = output.outputs
    assert stopped == [0] and sample.token_ids == ids[:2]
    assert sample.logprobs == logprobs[:2]
