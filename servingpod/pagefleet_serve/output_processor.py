"""Turns the engine core's new token ids into per-request outputs: incremental text, stop
strings, logprobs, finish reasons, timestamps. The core never sees text; this is where
text happens."""

from dataclasses import dataclass, field, replace

from pagefleet_serve.detokenizer import SampleText
from pagefleet_serve.engine.sampler import SampledToken
from pagefleet_serve.engine.sequence import Sequence
from pagefleet_serve.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from pagefleet_serve.sampling_params import SamplingParams


@dataclass
class _Sample:
    text: SampleText | None  # None: no tokenizer here (a core whose frontend makes text)
    finished: bool = False


@dataclass
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    samples: dict[int, _Sample] = field(default_factory=dict)
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        done = sum(s.finished for s in self.samples.values())
        return done == self.params.n


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _Request] = {}

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
    ) -> None:
        self.requests[request_id] = _Request(
            request_id, prompt_token_ids, params, RequestMetrics(arrival_time)
        )

    def mark_scheduled(self, seq: Sequence, now: float) -> None:
        request = self.requests.get(seq.request_id)
        if request is not None and request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = now
            request.num_cached_tokens = seq.num_prefix_hit_tokens

    def process(
        self, new_tokens: list[tuple[Sequence, SampledToken]], now: float
    ) -> tuple[list[RequestOutput], list[Sequence]]:
        """Returns this step's outputs and the sequences a stop string has ended."""
        deltas: dict[str, dict[int, CompletionOutput]] = {}
        stopped: list[Sequence] = []
        # A sequence may get several tokens in a step (accepted drafts): its finish reason
        # belongs to the last of them.
        last = {seq: i for i, (seq, _) in enumerate(new_tokens)}
        for i, (seq, token) in enumerate(new_tokens):
            request = self.requests[seq.request_id]
            sample = request.samples.get(seq.sample_index) or self._new_sample(request, seq)
            if sample.finished:
                continue  # the rest of an accepted draft run after a stop string
            delta = deltas.setdefault(seq.request_id, {}).setdefault(
                seq.sample_index, CompletionOutput(seq.sample_index)
            )
            delta.token_ids.append(token.token_id)
            if token.logprob is not None:
                entry = TokenLogprob(token.token_id, token.logprob, token.top_logprobs or [])
                delta.logprobs = (delta.logprobs or []) + [entry]
            finish_reason = seq.finish_reason if i == last[seq] else None
            if sample.text is not None and sample.text.add(token.token_id):
                finish_reason = "stop"
                if not seq.is_finished:
                    stopped.append(seq)
            sample.finished = finish_reason is not None
            if sample.text is not None:
                delta.text += sample.text.release(sample.finished)
            delta.finish_reason = finish_reason
            request.metrics.first_token_time = request.metrics.first_token_time or now
            request.metrics.last_token_time = now
            request.metrics.num_preemptions = max(
                request.metrics.num_preemptions, seq.num_preemptions
            )
        outputs = [
            self._output(rid, list(samples.values()), now) for rid, samples in deltas.items()
        ]
        return outputs, stopped

    def finish(
        self,
        request_id: str,
        reason: str,
        now: float,
        error: str | None = None,
        sample_index: int | None = None,
    ) -> RequestOutput | None:
        """End every unfinished sample of a request, or the one at `sample_index` (abort,
        engine error, a stop string the frontend found)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        outputs = []
        indices = range(request.params.n) if sample_index is None else [sample_index]
        for index in indices:
            sample = request.samples.get(index)
            if sample is None or not sample.finished:
                outputs.append(CompletionOutput(index, finish_reason=reason))
                if sample is not None:
                    sample.finished = True
                else:
                    request.samples[index] = _Sample(None, finished=True)
        output = self._output(request_id, outputs, now)
        output.error = error
        return output

    def _output(
        self, request_id: str, samples: list[CompletionOutput], now: float
    ) -> RequestOutput:
        request = self.requests[request_id]
        finished = request.finished
        if finished:
            request.metrics.finished_time = now
            del self.requests[request_id]
        # A copy: the caller reads this step's timestamps while later steps update them.
        return RequestOutput(
            request_id,
            request.prompt_token_ids,
            samples,
            finished,
            request.num_cached_tokens,
            replace(request.metrics),
        )

    def _new_sample(self, request: _Request, seq: Sequence) -> _Sample:
        text = None
        if self.tokenizer is not None:
            text = SampleText(self.tokenizer, request.prompt_token_ids, request.params)
        sample = _Sample(text)
        request.samples[seq.sample_index] = sample
        return sample
