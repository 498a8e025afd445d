"""Offline batch use: `LLM(model=...).generate(prompts, SamplingParams(...))`, or
`LLM(model=...).embed(texts)` for an embedding model (task embed).

The same frontend and core as a serving pod: requests go through the core client
(`EngineCoreClient`: the one input processing, the core's one grammar compile, the one
detokenizer and stop-string pipeline) to an `EngineCore` on an `InlineLink`, which runs
in this thread, one step whenever `step()` is called, so that nothing here runs unless
the caller steps it.
"""

import itertools
from collections.abc import Iterator

from pagefleet_serve.config import EngineConfig
from pagefleet_serve.engine.inline_link import InlineLink
from pagefleet_serve.engine.llm_engine import LLMEngine
from pagefleet_serve.frontend.core_client import EngineCoreClient
from pagefleet_serve.frontend.embeddings import shape_embedding
from pagefleet_serve.frontend.input_processor import ChatPrompt, InputProcessor, Prompt
from pagefleet_serve.frontend.tokenizer import load_engine_tokenizer
from pagefleet_serve.messages import EngineStats, Request
from pagefleet_serve.outputs import CompletionOutput, RequestOutput
from pagefleet_serve.reasoning import NONE
from pagefleet_serve.reasoning import reasoning_parser as choose_reasoning_parser
from pagefleet_serve.sampling_params import SamplingParams


class LLM:
    def __init__(
        self, model: str | None = None, reasoning_parser: str | None = NONE, **config
    ) -> None:
        """`config`: `EngineConfig`'s fields. `reasoning_parser`: a reasoning model's, by
        the server's `--reasoning-parser` names (None: the one the model's tokenizer and
        template point to, as the server chooses); with one, `chat` renders as the server
        does and each output's thinking is in `CompletionOutput.reasoning`."""
        if model is not None:
            config["model"] = model
        engine_config = EngineConfig(**config)
        # One tokenizer, loaded here (the frontend's loader): the engine's grammars read its
        # vocabulary, the client's input and output processing its text.
        tokenizer = load_engine_tokenizer(engine_config)
        self.engine = LLMEngine(engine_config, tokenizer=tokenizer)
        self._link = InlineLink(self.engine)
        self.client = EngineCoreClient(engine_config, self._link, tokenizer)
        self.client.inputs.reasoning_parser = choose_reasoning_parser(reasoning_parser, tokenizer)
        self._ids = itertools.count()
        # What the core delivered since the last step was handed out.
        self._delivered: list[RequestOutput | BaseException] = []

    @property
    def tokenizer(self):
        return self.client.tokenizer

    @property
    def inputs(self) -> InputProcessor:
        return self.client.inputs

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        lora_name: str | list[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, continuously batched; results in prompt order.
        A prompt is text or a list of token ids; `lora_name` the LoRA adapter (see
        `enable_lora`, `lora_modules`) of every prompt or of each, None for the base model."""
        prompts = _as_list(prompts)
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
        results = {
            request.request_id: RequestOutput(
                request.request_id,
                request.prompt_token_ids,
                [CompletionOutput(i) for i in range(request.params.n)],
                finished=False,
            )
            for request in requests
        }
        for delta in self._run(requests):
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
        pooling = self.client.pooling
        if pooling is None:
            raise ValueError(
                f"embed: {self.client.model_name} generates text; embeddings need an "
                "embedding model (task embed)"
            )
        if dimensions is not None:
            pooling.check_dimensions(dimensions)
        requests = [
            self.make_request(
                f"offline-{next(self._ids)}", p, SamplingParams(), lora_name, pooling=True
            )
            for p in _as_list(prompts)
        ]  # validate all before queueing any
        results: dict[str, RequestOutput] = {}
        for output in self._run(requests):
            if output.error:
                raise RuntimeError(f"the engine failed an embedding: {output.error}")
            if output.finished:
                output.embedding = shape_embedding(output.embedding, pooling, dimensions)
                results[output.request_id] = output
        return [results[r.request_id] for r in requests]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        thinking_token_budget: int | None = None,
        lora_name: str | list[str | None] | None = None,
    ) -> list[RequestOutput]:
        """`generate` for one conversation or a list of them, each rendered as the server
        renders a chat request (the reasoning parser's renderer or the model's chat
        template, with `tools` and `chat_template_kwargs`; `thinking_token_budget` for a
        reasoning model)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = [
            ChatPrompt(list(c), tools, chat_template_kwargs, thinking_token_budget)  # type: ignore[arg-type]
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, lora_name)

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        """The prompt text a conversation is rendered to, ready for generation."""
        return self.inputs.render_chat(messages)

    # -- one request at a time, one step at a time -------------------------------------
    def make_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        lora_name: str | None = None,
        pooling: bool = False,
    ) -> Request:
        """Tokenize and validate (a structured output's constraint compiled, waited for);
        `pooling`: an embedding request. Raises ValueError."""
        # The one check of the name (the core only looks it up), against the engine's
        # own adapters: `engine.load_lora` serves one without a message to the client.
        if lora_name is not None and lora_name not in self.engine.loras.adapters:
            raise ValueError(f"the LoRA adapter {lora_name!r} is not loaded")
        processed = self.client.process_input(
            {request_id: prompt}, params, lora_name=lora_name, pooling=pooling
        )
        if processed.compiled is not None:
            processed.compiled.result()
        return processed.requests[0]

    def add(self, request: Request) -> None:
        """Queue a request from `make_request`; ValueError when the engine refuses it."""
        self.client.add(request, self._delivered.append)
        # The inline core takes it at once: a refusal has been delivered already.
        self._raise_delivered_error()

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        lora_name: str | None = None,
    ) -> None:
        self.add(self.make_request(request_id, prompt, params, lora_name))

    def abort_request(self, request_id: str) -> None:
        """End a request; its final output (finish reason "abort") comes with the next step."""
        self.client.abort(request_id, final_output=True)

    def step(self) -> list[RequestOutput]:
        """One engine step's outputs, with their text. Raises what ended a request that
        could not run (ValueError: the engine refused it)."""
        self._link.step()
        self._raise_delivered_error()
        delivered = list(self._delivered)
        self._delivered.clear()  # the list every request delivers to: kept, emptied
        return delivered  # type: ignore[return-value]

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def _raise_delivered_error(self) -> None:
        """Raise what ended a request that could not run, if one has been delivered."""
        errors = [item for item in self._delivered if isinstance(item, BaseException)]
        if errors:
            self._delivered[:] = [i for i in self._delivered if not isinstance(i, BaseException)]
            raise errors[0]

    def _run(self, requests: list[Request]) -> Iterator[RequestOutput]:
        """Queue `requests` and step until nothing is left to run; a failure ends them in
        the core too."""
        try:
            for request in requests:
                self.add(request)
            while self.has_unfinished_requests():
                yield from self.step()
        except BaseException:
            for request in requests:
                self.client.abort(request.request_id)
            if self.has_unfinished_requests():
                self._link.step()  # hands out the aborted requests' last outputs, unread
            raise


def _as_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    """One prompt (text, token ids, chat) or a list of them, as a list."""
    if isinstance(prompts, (str, ChatPrompt)) or (prompts and isinstance(prompts[0], int)):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]
