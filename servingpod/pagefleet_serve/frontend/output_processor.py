"""The one text pipeline: the core's token-id outputs become text, cut at stop strings.

Every caller of an engine core goes through here, the HTTP server (through the core
client) and the offline `LLM` alike. Per sample, tokens are detokenized incrementally and
matched against the request's stop strings (`detokenizer.SampleText`); a stop string found
ends that sample here at once, and `process` names it so the caller stops it in the core
too (an `AbortRequest` with reason "stop"). Deltas the core sends for a sample already
ended here (tokens it computed before the abort reached it) are dropped.
"""

import functools
from dataclasses import dataclass, field

from pagefleet_serve.frontend.detokenizer import SampleText
from pagefleet_serve.frontend.tokenizer import Tokenizer
from pagefleet_serve.messages import Request
from pagefleet_serve.outputs import CompletionOutput, RequestOutput
from pagefleet_serve.reasoning import REASONING_PARSERS, ReasoningParser, ReasoningStream
from pagefleet_serve.structured.thinking import ThinkingSpec


@dataclass
class RequestText:
    """One request's text so far."""

    request: Request
    texts: dict[int, SampleText] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)  # sample indices


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        """`tokenizer` None: a model without one; outputs then carry token ids only."""
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestText] = {}
        self._reasoning_parsers: dict[str, ReasoningParser] = {}

    def decode(self, token_ids: list[int]) -> str:
        """Token ids -> text at once (a whole sequence, as /detokenize asks)."""
        return self.tokenizer.decode(token_ids)

    @functools.cached_property
    def token_text(self):
        """One token's own text (logprobs' entries; `<id>` without a tokenizer), cached."""

        @functools.lru_cache(maxsize=65536)
        def token_text(token_id: int) -> str:
            if self.tokenizer is None:
                return f"<{token_id}>"
            return self.tokenizer.decode([token_id])

        return token_text

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = RequestText(request)

    def abort(self, request_id: str) -> None:
        """Forget a request: no more of its outputs are processed."""
        self.requests.pop(request_id, None)

    def process(self, output: RequestOutput) -> tuple[RequestOutput | None, list[int]]:
        """Add the text to one core output (in place). Returns it (None for a request not
        here: aborted, or already finished) and the indices of the samples a stop string
        ended here that the core still runs. A request ends here when all its samples have;
        it is then forgotten."""
        state = self.requests.get(output.request_id)
        if state is None:
            return None, []
        output.prompt_token_ids = state.request.prompt_token_ids
        stopped: list[int] = []
        samples = []
        for sample in output.outputs:
            if sample.index in state.finished:
                continue
            if self._add_text(state, sample):
                stopped.append(sample.index)
            if sample.finish_reason is not None:
                state.finished.add(sample.index)
            samples.append(sample)
        output.outputs = samples
        if len(state.finished) == state.request.params.n:
            output.finished = True
        if output.finished:
            self.requests.pop(output.request_id, None)  # (`abort` may race it: no del)
        return output, stopped

    def _add_text(self, state: RequestText, sample: CompletionOutput) -> bool:
        """Make the text of a sample's delta, ending the sample at a stop string; True when
        a stop string ended a sample the core still runs."""
        request = state.request
        if self.tokenizer is None or request.pooling:  # no text: token ids, or a vector
            return False
        text = state.texts.get(sample.index)
        if text is None:
            reasoning = self._reasoning_stream(request.params.thinking)
            text = SampleText(self.tokenizer, request.prompt_token_ids, request.params, reasoning)
            state.texts[sample.index] = text
        for position, token_id in enumerate(sample.token_ids):
            if text.add(token_id):
                del sample.token_ids[position + 1 :]
                if sample.logprobs is not None:
                    del sample.logprobs[position + 1 :]
                break
        still_running = False
        if text.stopped and sample.finish_reason != "stop":
            still_running = sample.finish_reason is None
            sample.finish_reason = "stop"
        if text.stopped:
            sample.stop_reason = text.matcher.matched
        sample.text = text.release(sample.finish_reason is not None)
        sample.reasoning, sample.num_reasoning_tokens = text.release_reasoning()
        return still_running

    def _reasoning_stream(self, thinking: ThinkingSpec | None) -> ReasoningStream | None:
        """A sample's split into thinking and answer, by its request's parser (made once
        per parser: it looks its markers up in the vocabulary)."""
        if thinking is None or self.tokenizer is None:
            return None
        parser = self._reasoning_parsers.get(thinking.parser)
        if parser is None:
            parser = REASONING_PARSERS[thinking.parser](self.tokenizer)
            self._reasoning_parsers[thinking.parser] = parser
        return parser.stream(thinking)
