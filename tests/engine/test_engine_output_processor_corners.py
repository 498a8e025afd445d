"""The frontend's output processor where the text pipeline has a choice to make: two stop
strings completed by one token (the cut is at the earlier one, whatever their order in
the request), and a tokenizer whose pieces decode differently alone than after the prompt
(a SentencePiece-style vocabulary, where a word's leading space is the "▁" of its piece
and a piece decoded alone loses it)."""

import json

import pytest
from pagefleet_serve.frontend.output_processor import OutputProcessor
from pagefleet_serve.messages import Request
from pagefleet_serve.model.loader import load_tokenizer
from pagefleet_serve.outputs import CompletionOutput, RequestOutput
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


@pytest.fixture(scope="module")
def smollm_tokenizer():
    return load_tokenizer("builtin://smollm2-135m")


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
