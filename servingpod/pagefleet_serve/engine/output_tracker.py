"""Turns the engine core's new token ids into per-request outputs: token ids, logprobs,
finish reasons, timestamps, cached-token counts. Token ids only: the text (and the stop
strings, which are matched on it) is made by the frontend's `OutputProcessor`."""

from dataclasses import dataclass, field, replace

from pagefleet_serve.engine.sampler import SampledToken
from pagefleet_serve.engine.sequence import Sequence
from pagefleet_serve.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from pagefleet_serve.sampling_params import SamplingParams


@dataclass
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    finished_samples: set[int] = field(default_factory=set)
    num_cached_tokens: int = 0
    # Prompt logprobs (when asked for) go out once, with the request's first output.
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return len(self.finished_samples) == self.params.n


class OutputTracker:
    def __init__(self) -> None:
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
    ) -> list[RequestOutput]:
        """This step's outputs, one per request that got tokens."""
        deltas: dict[str, dict[int, CompletionOutput]] = {}
        prompt_logprobs: dict[str, list[TokenLogprob | None]] = {}
        # A sequence may get several tokens in a step (accepted drafts): its finish reason
        # belongs to the last of them.
        last = {seq: i for i, (seq, _) in enumerate(new_tokens)}
        for i, (seq, token) in enumerate(new_tokens):
            request = self.requests[seq.request_id]
            if seq.sample_index in request.finished_samples:
                continue  # ended since it was scheduled (a stop string the frontend found)
            if seq.params.prompt_logprobs is not None and not request.prompt_logprobs_sent:
                request.prompt_logprobs_sent = True
                prompt_logprobs[seq.request_id] = [None, *seq.prompt_logprobs]
            delta = deltas.setdefault(seq.request_id, {}).setdefault(
                seq.sample_index, CompletionOutput(seq.sample_index)
            )
            delta.token_ids.append(token.token_id)
            if token.logprob is not None:
                entry = TokenLogprob(token.token_id, token.logprob, token.top_logprobs or [])
                delta.logprobs = (delta.logprobs or []) + [entry]
            finish_reason = seq.finish_reason if i == last[seq] else None
            if finish_reason is not None:
                request.finished_samples.add(seq.sample_index)
            delta.finish_reason = finish_reason
            request.metrics.first_token_time = request.metrics.first_token_time or now
            request.metrics.last_token_time = now
            request.metrics.num_preemptions = max(
                request.metrics.num_preemptions, seq.num_preemptions
            )
        outputs = [self._output(rid, list(s.values()), now) for rid, s in deltas.items()]
        for output in outputs:
            output.prompt_logprobs = prompt_logprobs.get(output.request_id)
        return outputs

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
            if index not in request.finished_samples:
                outputs.append(CompletionOutput(index, finish_reason=reason))
                request.finished_samples.add(index)
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
