"""Offline batch use: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

import itertools

from pagefleet_serve.config import EngineConfig
from pagefleet_serve.engine.llm_engine import LLMEngine
from pagefleet_serve.outputs import CompletionOutput, RequestOutput
from pagefleet_serve.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **config) -> None:
        if model is not None:
            config["model"] = model
        self.engine = LLMEngine(EngineConfig(**config))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | list[str | list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, continuously batched; results in prompt order.
        A prompt is text or a list of token ids."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("sampling_params must be one per prompt")
        requests = [
            self.engine.make_request(f"offline-{next(self._ids)}", prompt, params)
            for prompt, params in zip(prompts, sampling_params, strict=True)
        ]  # validate all before queueing any
        results: dict[str, RequestOutput] = {}
        for request in requests:
            self.engine.add(request)
            results[request.request_id] = RequestOutput(
                request.request_id,
                request.prompt_token_ids,
                [CompletionOutput(i) for i in range(request.params.n)],
                finished=False,
            )
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                final = results[delta.request_id]
                for sample in delta.outputs:
                    final.outputs[sample.index].extend(sample)
                final.finished = delta.finished
                final.num_cached_tokens = delta.num_cached_tokens
                final.metrics = delta.metrics
        return [results[r.request_id] for r in requests]

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        """The model's chat template applied, ready for generation."""
        return self.engine.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
