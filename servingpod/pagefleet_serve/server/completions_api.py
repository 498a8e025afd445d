"""POST /v1/completions: prompts as text or token ids (one or a batch), each run as its own
engine request on the shared generation path (`openai_api.GenerationEndpoint`), written as
text choices with the legacy logprobs shape (tokens, token_logprobs, top_logprobs,
text_offset).

`echo` puts each prompt's text before its choice's first text (with `logprobs`, the
prompt's tokens scored too, the first null); with `max_tokens` 0 the prompt alone comes
back, as vLLM answers it: one token is generated and dropped. This is how
lm-evaluation-harness's local-completions scores a loglikelihood task.
"""

from collections.abc import AsyncIterator

from pagefleet_serve.frontend.input_processor import Prompt
from pagefleet_serve.outputs import CompletionOutput
from pagefleet_serve.server.errors import bad_request
from pagefleet_serve.server.openai_api import GenerationEndpoint, _Input, _Run
from pagefleet_serve.server.protocol import (
    MAX_PROMPTS_PER_REQUEST,
    CompletionRequest,
    too_many_prompts,
)
from pagefleet_serve.server.token_details import (
    completion_logprobs,
    prompt_fields,
    without_generation,
)


class CompletionsEndpoint(GenerationEndpoint):
    request_model = CompletionRequest
    id_prefix = "cmpl-"
    object_name = "text_completion"
    chunk_object = "text_completion"
    prompt_param = "prompt"

    def prepare(self, request: CompletionRequest) -> _Input:
        prompt = request.prompt
        max_tokens = 16 if request.max_tokens is None else request.max_tokens
        if request.echo and max_tokens == 0:
            max_tokens = 1  # vLLM's echo of the prompt alone: one token, dropped (`settled`)
        if request.echo:
            self.check_tokenizer()  # the echo is the prompt's text

        def read(prompt: str | list[int]) -> Prompt:
            """Text goes to the frontend as text; truncate_prompt_tokens needs its ids."""
            if request.truncate_prompt_tokens is None:
                return prompt
            token_ids = self.encode(prompt) if isinstance(prompt, str) else prompt
            return request.truncated(token_ids, self.max_model_len)

        prompts: list[Prompt]
        if isinstance(prompt, str):
            self.check_tokenizer()
            prompts = [read(prompt)]
        elif not prompt:
            raise bad_request("prompt: must not be empty", param="prompt")
        elif isinstance(prompt[0], int):
            prompts = [read(list(prompt))]
        elif len(prompt) > MAX_PROMPTS_PER_REQUEST:
            raise too_many_prompts(len(prompt))
        elif isinstance(prompt[0], str):
            self.check_batch_chars(sum(map(len, prompt)))
            self.check_tokenizer()
            prompts = [read(text) for text in prompt]  # the frontend stops at the first too long
        else:
            prompts = [read(list(p)) for p in prompt]
        # echo with logprobs: the prompt's tokens are scored too (as vLLM does).
        echoed = request.logprobs if request.echo else None
        params = request.sampling_params(
            max_tokens,
            request.logprobs,
            prompt_logprobs=echoed,
            defaults=self.state.sampling_defaults,
        )
        return _Input(prompts, params)

    async def stream_deltas(self, run: _Run) -> AsyncIterator[CompletionOutput | None]:
        async for delta in super().stream_deltas(run):
            yield delta if delta is None else self._settled(run, delta)

    def response_body(self, run: _Run, choices: list[CompletionOutput]) -> dict:
        return super().response_body(run, [self._settled(run, c) for c in choices])

    def _settled(self, run: _Run, choice: CompletionOutput) -> CompletionOutput:
        echo_only = run.request.echo and run.request.max_tokens == 0
        return without_generation(choice) if echo_only else choice

    def choice_chunk(self, run: _Run, delta: CompletionOutput) -> dict:
        return self.final_choice(run, delta)

    def final_choice(self, run: _Run, choice: CompletionOutput) -> dict:
        request: CompletionRequest = run.request  # type: ignore[assignment]
        first = run.open_choice(choice.index)
        prompt_ids, prompt_logprobs = run.prompt_of(choice.index)
        echo = request.echo and first
        text = choice.text
        if echo:
            text = self.state.engine.outputs.decode(prompt_ids) + text
        body = {
            "index": choice.index,
            "text": text,
            "logprobs": self._logprobs(run, choice, echo),
            "finish_reason": choice.finish_reason,
        }
        if first:
            body |= prompt_fields(request, prompt_ids, prompt_logprobs, self._labels(run))
        return body | self._token_ids(run, choice)

    def _logprobs(self, run: _Run, choice: CompletionOutput, echo: bool) -> dict | None:
        if run.request.logprobs is None or (choice.logprobs is None and not echo):
            return None
        tokens: list = []
        if echo:
            prompt_ids, prompt_logprobs = run.prompt_of(choice.index)
            tokens = list(zip(prompt_ids, prompt_logprobs or [None] * len(prompt_ids), strict=True))
        tokens += [(e.token_id, e) for e in choice.logprobs or []]
        out, run.text_offsets[choice.index] = completion_logprobs(
            tokens, self._labels(run), run.text_offsets.get(choice.index, 0)
        )
        return out
