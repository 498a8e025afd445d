"""The output pipeline on its own (the real tokenizer, no model): the core's output tracker
(token ids, finish reasons, timestamps) and the frontend's output processor (the one
detokenizer and stop-string pipeline) as a step drives them: incremental text, UTF-8
characters split over tokens, stop strings held back and cut, finish reasons, n > 1,
aborts, logprobs and timestamps, fed token by token as the engine would."""

import pytest
from pagefleet_serve.engine.output_tracker import OutputTracker
from pagefleet_serve.engine.sampler import SampledToken
from pagefleet_serve.engine.sequence import Sequence, SequenceStatus
from pagefleet_serve.frontend.output_processor import OutputProcessor as FrontendOutputs
from pagefleet_serve.frontend.tokenizer import load_tokenizer
from pagefleet_serve.messages import Request
from pagefleet_serve.outputs import TokenLogprob
from pagefleet_serve.sampling_params import SamplingParams


class OutputProcessor:
    """The core's tracker and the frontend's processor joined as the engine and its
    frontend join them: a stop string the frontend finds ends that sample in the core
    (whose output for it the frontend then drops, as it would next step)."""

    def __init__(self, tokenizer) -> None:
        self.core = OutputTracker()
        self.frontend = FrontendOutputs(tokenizer)

    @property
    def requests(self):
        return self.core.requests

    def add_request(self, request_id, prompt, params, arrival):
        self.core.add_request(request_id, prompt, params, arrival)
        self.frontend.add_request(Request(request_id, prompt, params, arrival))

    def mark_scheduled(self, seq, now):
        self.core.mark_scheduled(seq, now)

    def process(self, new_tokens, now):
        """This step's outputs with their text, and the sequences a stop string ended."""
        seqs = {(seq.request_id, seq.sample_index): seq for seq, _ in new_tokens}
        outputs, stopped = [], []
        for output in self.core.process(new_tokens, now):
            output, stopped_samples = self.frontend.process(output)
            for index in stopped_samples:
                stopped.append(seqs[output.request_id, index])
                self.core.finish(output.request_id, "stop", now, sample_index=index)
            if output is not None:
                outputs.append(output)
        return outputs, stopped

    def finish(self, request_id, reason, now, error=None, sample_index=None):
        output = self.core.finish(request_id, reason, now, error, sample_index)
        return None if output is None else self.frontend.process(output)[0]


ANSWER = " The answer is 42. Done"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("builtin://smollm2-135m")


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def start(processor, tokenizer, params, request_id="r", arrival=100.0):
    prompt = encode(tokenizer, "Question:")
    processor.add_request(request_id, prompt, params, arrival)
    return [
        Sequence(request_id, i, list(prompt), len(prompt), params, None, arrival)
        for i in range(params.n)
    ]


def feed(processor, seq, token_ids, first_time=1.0):
    """One step per token; returns each step's RequestOutput."""
    outputs = []
    for step, token_id in enumerate(token_ids):
        seq.token_ids.append(token_id)
        step_outputs, _ = processor.process([(seq, SampledToken(token_id))], first_time + step)
        outputs += step_outputs
    return outputs


def texts(outputs):
    return [o.outputs[0].text for o in outputs]


def test_text_is_released_token_by_token(tokenizer):
    processor = OutputProcessor(tokenizer)
    (seq,) = start(processor, tokenizer, SamplingParams())
    outputs = feed(processor, seq, encode(tokenizer, ANSWER))
    assert texts(outputs) == [" The", " answer", " is", " ", "4", "2", ".", " Done"]
    assert all(not o.finished and o.outputs[0].finish_reason is None for o in outputs)
    assert [o.outputs[0].token_ids for o in outputs] == [[t] for t in encode(tokenizer, ANSWER)]


def test_a_character_split_over_tokens_is_released_whole(tokenizer):
    processor = OutputProcessor(tokenizer)
    (seq,) = start(processor, tokenizer, SamplingParams())
    outputs = feed(processor, seq, encode(tokenizer, " café 日本"))
    # 日 is three byte-level tokens (the first also holds the space before it): only its
    # bytes are held back until its last one.
    assert texts(outputs) == [" café", " ", "", "日", "本"]


def test_stop_string_is_held_back_then_cut(tokenizer):
    processor = OutputProcessor(tokenizer)
    (seq,) = start(processor, tokenizer, SamplingParams(stop=["42."]))
    ids = encode(tokenizer, ANSWER)
    stopped_at = None
    outputs = []
    for step, token_id in enumerate(ids):
        seq.token_ids.append(token_id)
        step_outputs, stopped = processor.process([(seq, SampledToken(token_id))], float(step))
        outputs += step_outputs
        if stopped:
            assert stopped == [seq]
            stopped_at = step
            break
    # The last two characters (len("42.") - 1) are held back until they cannot start "42.".
    assert texts(outputs) == [" T", "he answ", "er ", "i", "s", " ", ""]
    assert "".join(texts(outputs)) == " The answer is "
    assert stopped_at == ids.index(encode(tokenizer, ".")[0])
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "stop"
    assert "r" not in processor.requests


def test_a_stop_string_on_an_already_finished_sequence_is_not_reported_again(tokenizer):
    processor = OutputProcessor(tokenizer)
    (seq,) = start(processor, tokenizer, SamplingParams(stop=[" is"]))
    ids = encode(tokenizer, " The answer is")
    for token_id in ids[:-1]:
        seq.token_ids.append(token_id)
        processor.process([(seq, SampledToken(token_id))], 1.0)
    seq.token_ids.append(ids[-1])
    seq.status, seq.finish_reason = SequenceStatus.FINISHED, "length"  # the scheduler ended it
    outputs, stopped = processor.process([(seq, SampledToken(ids[-1]))], 2.0)
    assert stopped == [] and outputs[0].outputs[0].finish_reason == "stop"


def test_length_finish_flushes_the_held_back_text(tokenizer):
    processor = OutputProcessor(tokenizer)
    (seq,) = start(processor, tokenizer, SamplingParams(stop=["never seen"]))
    ids = encode(tokenizer, " The answer")
    outputs = feed(processor, seq, ids[:-1])
    seq.token_ids.append(ids[-1])
    seq.status, seq.finish_reason = SequenceStatus.FINISHED, "length"
    last, stopped = processor.process([(seq, SampledToken(ids[-1]))], 9.0)
    assert texts(outputs) == [""] and stopped == []
    assert last[0].outputs[0].text == " The answer" and last[0].outputs[0].finish_reason == "length"
    assert last[0].finished and last[0].metrics.finished_time == 9.0


def test_n_samples_finish_the_request_only_together(tokenizer):
    processor = OutputProcessor(tokenizer)
    first, second = start(processor, tokenizer, SamplingParams(n=2))
    hello, world = encode(tokenizer, "Hello")[0], encode(tokenizer, " world")[0]
    first.token_ids.append(hello)
    second.token_ids.append(world)
    first.status, first.finish_reason = SequenceStatus.FINISHED, "length"
    (out,), _ = processor.process([(first, SampledToken(hello)), (second, SampledToken(world))], 1)
    assert [(c.index, c.text, c.finish_reason) for c in out.outputs] == [
        (0, "Hello", "length"),
        (1, " world", None),
    ]
    assert not out.finished and "r" in processor.requests
    second.token_ids.append(hello)
    second.status, second.finish_reason = SequenceStatus.FINISHED, "stop"
    (out,), _ = processor.process([(second, SampledToken(hello))], 2)
    assert [(c.index, c.finish_reason) for c in out.outputs] == [(1, "stop")]
    assert out.finished and "r" not in processor.requests


def test_finish_ends_only_the_unfinished_samples(tokenizer):
    processor = OutputProcessor(tokenizer)
    first, _second, _third = start(processor, tokenizer, SamplingParams(n=3))
    first.status, first.finish_reason = SequenceStatus.FINISHED, "stop"
    feed(processor, first, encode(tokenizer, "Hello"))
    out = processor.finish("r", "abort", 5.0, error="client went away")
    # Sample 0 had finished; 1 had not started; 2 neither: both end with the reason.
    assert [(c.index, c.finish_reason) for c in out.outputs] == [(1, "abort"), (2, "abort")]
    assert out.finished and out.error == "client went away" and out.metrics.finished_time == 5.0
    assert processor.finish("r", "abort", 6.0) is None  # already gone


def test_finish_of_one_sample_leaves_its_siblings_running(tokenizer):
    processor = OutputProcessor(tokenizer)
    start(processor, tokenizer, SamplingParams(n=3))
    # A stop string ended sample 1 only: the request goes on with 0 and 2.
    out = processor.finish("r", "stop", 4.0, sample_index=1)
    assert [(c.index, c.finish_reason) for c in out.outputs] == [(1, "stop")]
    assert not out.finished and "r" in processor.requests
    out = processor.finish("r", "abort", 5.0)
    assert [(c.index, c.finish_reason) for c in out.outputs] == [(0, "abort"), (2, "abort")]
    assert out.finished


def test_finish_ends_a_running_sample(tokenizer):
    processor = OutputProcessor(tokenizer)
    (seq,) = start(processor, tokenizer, SamplingParams())
    (running,) = feed(processor, seq, encode(tokenizer, "Hello"))
    assert (running.request_id, running.prompt_token_ids) == ("r", seq.token_ids[:-1])
    out = processor.finish("r", "error", 3.0, error="device fell over")
    assert [(c.index, c.text, c.finish_reason) for c in out.outputs] == [(0, "", "error")]
    assert out.finished and out.request_id == "r" and "r" not in processor.requests


def test_logprobs_and_timestamps(tokenizer):
    processor = OutputProcessor(tokenizer)
    (seq,) = start(processor, tokenizer, SamplingParams(logprobs=1), arrival=10.0)
    seq.num_prefix_hit_tokens = 16
    processor.mark_scheduled(seq, 11.0)
    seq.num_prefix_hit_tokens = 32  # a later admission (after preemption) does not count
    processor.mark_scheduled(seq, 12.0)
    token = encode(tokenizer, "Hello")[0]
    seq.token_ids.append(token)
    seq.num_preemptions = 2
    sampled = SampledToken(token, -0.25, [(token, -0.25), (7, -1.5)])
    (first,), _ = processor.process([(seq, sampled)], 13.0)
    (second,), _ = processor.process([(seq, SampledToken(token, -0.5))], 14.0)
    assert first.outputs[0].logprobs == [TokenLogprob(token, -0.25, [(token, -0.25), (7, -1.5)])]
    assert second.outputs[0].logprobs == [TokenLogprob(token, -0.5, [])]
    assert first.num_cached_tokens == 16
    metrics = second.metrics
    assert (metrics.arrival_time, metrics.first_scheduled_time) == (10.0, 11.0)
    assert (metrics.first_token_time, metrics.last_token_time) == (13.0, 14.0)
    assert metrics.num_preemptions == 2 and metrics.finished_time is None
    # Each output holds a copy of the metrics as they were at its step.
    assert first.metrics.last_token_time == 13.0


def test_without_a_tokenizer_there_is_no_text():
    processor = OutputProcessor(None)
    params = SamplingParams(stop=["x"])
    processor.add_request("ids", [1, 2], params, 0.0)
    seq = Sequence("ids", 0, [1, 2], 2, params, None, 0.0)
    seq.token_ids.append(5)
    (out,), stopped = processor.process([(seq, SampledToken(5))], 1.0)
    assert out.outputs[0].text == "" and out.outputs[0].token_ids == [5] and stopped == []


def test_an_accepted_draft_run_is_one_delta_with_every_tokens_text(tokenizer):
    processor = OutputProcessor(tokenizer)
    (seq,) = start(processor, tokenizer, SamplingParams(max_tokens=3))
    ids = encode(tokenizer, " The answer is")
    assert len(ids) == 3
    # One step appends the whole run; the scheduler ended the sequence at its last token.
    seq.token_ids += ids
    seq.status, seq.finish_reason = SequenceStatus.FINISHED, "length"
    (out,), _ = processor.process([(seq, SampledToken(t)) for t in ids], 1.0)
    assert [(c.text, c.finish_reason) for c in out.outputs] == [(" The answer is", "length")]
    assert out.finished


def test_a_stop_string_inside_a_draft_run_drops_the_rest_of_that_run_only(tokenizer):
    processor = OutputProcessor(tokenizer)
    (seq,) = start(processor, tokenizer, SamplingParams(stop=[" answer"]))
    (other,) = start(processor, tokenizer, SamplingParams(), request_id="other")
    ids = encode(tokenizer, " The answer is")
    hello = encode(tokenizer, "Hello")[0]
    seq.token_ids += ids
    other.token_ids.append(hello)
    step = [(seq, SampledToken(t)) for t in ids] + [(other, SampledToken(hello))]
    outputs, stopped = processor.process(step, 1.0)
    assert stopped == [seq]
    assert [(o.request_id, o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs] == [
        ("r", " The", "stop"),
        ("other", "Hello", None),
    ]


def test_the_core_output_carries_the_prompt_and_a_finished_sample_drops_only_its_token():
    """The tracker on its own: its output names the prompt's token ids and says
    `finished is False` while a sample runs; a token for a sample that ended since it was
    scheduled (a stop string the frontend found) is dropped, and the tokens after it in the
    same step, another request's, are not."""
    tracker = OutputTracker()
    two = SamplingParams(n=2)
    tracker.add_request("a", [5, 6], two, 0.0)
    tracker.add_request("b", [7], SamplingParams(), 0.0)
    ended = Sequence("a", 0, [5, 6, 9], 2, two, None, 0.0)
    other = Sequence("b", 0, [7, 9], 1, SamplingParams(), None, 0.0)
    out = tracker.finish("a", "stop", 1.0, sample_index=0)
    assert (out.request_id, out.prompt_token_ids, out.finished) == ("a", [5, 6], False)
    (out,) = tracker.process([(ended, SampledToken(9)), (other, SampledToken(9))], 2.0)
    assert (out.request_id, out.prompt_token_ids, out.finished) == ("b", [7], False)
    assert [(c.index, c.token_ids) for c in out.outputs] == [(0, [9])]
