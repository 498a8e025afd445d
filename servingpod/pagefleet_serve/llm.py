"""Offline batch use: `LLM(model=...).generate(prompts, SamplingParams(...))`, or
`LLM(model=...).embed(texts)` for an embedding model (task embed).

The same three parts as a serving pod, in one thread: the frontend's `InputProcessor`
(template, tokenize, validate), an `LLMEngine` stepped in process, and the frontend's
`OutputProcessor` (the one detokenizer and stop-string pipeline; a stop string it finds
ends that sample in the engine before the next step).
"""

import itertools

from pagefleet_serve.config import EngineConfig
from pagefleet_serve.engine.llm_engine import LLMEngine
from pagefleet_serve.frontend.embeddings import shape_embedding
from pagefleet_serve.frontend.input_processor import InputProcessor
from pagefleet_serve.frontend.output_processor import OutputProcessor
from pagefleet_serve.messages import EngineStats, Request
from pagefleet_serve.outputs import CompletionOutput, RequestOutput
from pagefleet_serve.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **config) -> None:
        if model is not None:
            config["model"] = model
        self.engine = LLMEngine(EngineConfig(**config))
        engine = self.engine
        self.inputs = InputProcessor(
            engine.tokenizer, engine.model_name, engine.limits, engine.grammar_compiler
        )
        self.outputs = OutputProcessor(engine.tokenizer)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.inputs.tokenizer

    def generate(
        self,
        prompts: str | list[int] | list[str | list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        lora_name: str | list[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, continuously batched; results in prompt order.
        A prompt is text or a list of token ids; `lora_name` the LoRA adapter (see
        `enable_lora`, `lora_modules`) of every prompt or of each, None for the base model."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("sampling_params must be one per prompt")
        if not isinstance(lora_name, list):
            lora_name = [lora_name] * len(prompts)
        if len(lora_name) != len(prompts):
            raise ValueError("lora_name must be one per prompt")
        requests = [
            self.make_request(f"offline-{next(self._ids)}", prompt, params, lora)
            for prompt, params, lora in zip(prompts, sampling_params, lora_name, strict=True)
        ]  # validate all before queueing any
        results: dict[str, RequestOutput] = {}
        for request in requests:
            self.add(request)
            results[request.request_id] = RequestOutput(
                request.request_id,
                request.prompt_token_ids,
                [CompletionOutput(i) for i in range(request.params.n)],
                finished=False,
            )
        while self.has_unfinished_requests():
            for delta in self.step():
                final = results[delta.request_id]
                for sample in delta.outputs:
                    final.outputs[sample.index].extend(sample)
                final.finished = delta.finished
                final.num_cached_tokens = delta.num_cached_tokens
                final.metrics = delta.metrics
                final.prompt_logprobs = final.prompt_logprobs or delta.prompt_logprobs
        return [results[r.request_id] for r in requests]

    def embed(
        self,
        prompts: str | list[int] | list[str | list[int]],
        dimensions: int | None = None,
        lora_name: str | None = None,
    ) -> list[RequestOutput]:
        """The embedding of every prompt (text, or a list of token ids), its vector in
        `RequestOutput.embedding`, in prompt order; batched as `generate` batches.
        `dimensions`: a Matryoshka model's vector cut to that size (renormalised).
        ValueError for a model that generates, or for a bad prompt or `dimensions`."""
        pooling = self.engine.pooling
        if pooling is None:
            raise ValueError(
                f"embed: {self.engine.model_name} generates text; embeddings need an "
                "embedding model (task embed)"
            )
        if dimensions is not None:
            pooling.check_dimensions(dimensions)
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        requests = [
            self.inputs.make_request(
                f"offline-{next(self._ids)}", p, SamplingParams(), lora_name=lora_name, pooling=True
            )
            for p in prompts
        ]  # validate all before queueing any
        for request in requests:
            self.add(request)
        results: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for output in self.step():
                if output.error:
                    raise RuntimeError(f"the engine failed an embedding: {output.error}")
                if output.finished:
                    output.embedding = shape_embedding(output.embedding, pooling, dimensions)
                    results[output.request_id] = output
        return [results[r.request_id] for r in requests]

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        """The model's chat template applied, ready for generation."""
        return self.inputs.render_chat(messages)

    # -- one request at a time, one step at a time -------------------------------------
    def make_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        lora_name: str | None = None,
    ) -> Request:
        """Tokenize and validate (a structured output's constraint compiled, waited for).
        Raises ValueError."""
        if lora_name is not None and lora_name not in self.engine.lora_adapters:
            raise ValueError(f"the LoRA adapter {lora_name!r} is not loaded")
        request = self.inputs.make_request(request_id, prompt, params, lora_name=lora_name)
        compiling = self.inputs.grammar_future(request)
        if compiling is not None:
            compiling.result()
        return request

    def add(self, request: Request) -> None:
        self.engine.add(request)
        self.outputs.add_request(request)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        lora_name: str | None = None,
    ) -> None:
        self.add(self.make_request(request_id, prompt, params, lora_name))

    def abort_request(self, request_id: str) -> None:
        """End a request; its final output (finish reason "abort") comes with the next step."""
        self.engine.abort_request(request_id)

    def step(self) -> list[RequestOutput]:
        """One engine step's outputs, with their text."""
        outputs = []
        for output in self.engine.step():
            output, stopped = self.outputs.process(output)
            for sample_index in stopped:
                self.engine.abort_request(output.request_id, "stop", sample_index=sample_index)
            if output is not None:
                outputs.append(output)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def stats(self) -> EngineStats:
        return self.engine.stats()
