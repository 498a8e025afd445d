"""The OpenAI endpoints' shared generation path and /v1/chat/completions, /v1/models.

Every generation endpoint (completions in `completions_api`, chat here, Responses and
Anthropic's Messages on the chat path) shares one path (`GenerationEndpoint`): read the
body (JSON only, bounded in size), then in the frontend thread parse and validate it and
hand its prompts to the frontend's one entry point (`process_input`: tokenizer, bounds,
the core's compile of a constraint), wait for that compile, admit, then either stream SSE
chunks or collect a JSON response. They differ only in how a prompt is read and how a
choice is written. Chat has its messages rendered by the frontend (`render_chat`: the
model's chat template or a reasoning parser's renderer, as for the offline `LLM`),
truncates the tokens (vLLM's `truncate_prompt_tokens`), has the frontend read where a
reasoning model's thinking ends off them, and hands the frontend the token ids.

Nothing that grows with a request's size runs on the event loop: the body is read in
chunks against a byte limit, and the rest runs in the frontend thread, cheapest checks
first: prompt text longer than the context could hold is refused by its length in
characters before any tokenizer sees it (a batch of prompts by their total too, chat by
its number of messages), and a batch stops at its first prompt over the context. A
structured output's grammar compiles on the event loop's time, not a thread's: the request
waits for it (in the compile queue, bounded per client) until the client leaves, and a
compile nobody waits for any more is dropped.
"""

import abc
import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from pagefleet_serve.frontend.core_client import ProcessedInput
from pagefleet_serve.frontend.input_processor import (
    ContextLengthError,
    ImagePrompt,
    Prompt,
    PromptTooLongError,
)
from pagefleet_serve.outputs import CompletionOutput
from pagefleet_serve.sampling_params import SamplingParams
from pagefleet_serve.server.chat_template import content_chars, template_messages
from pagefleet_serve.server.errors import APIError, bad_request, server_error, unavailable
from pagefleet_serve.server.fair_queue import current_client
from pagefleet_serve.server.generation import (
    Generation,
    RequestCancelled,
    RequestFailed,
)
from pagefleet_serve.server.media import read_images
from pagefleet_serve.server.protocol import (
    ChatCompletionRequest,
    _GenerationRequest,
    parse,
    value_error,
)
from pagefleet_serve.server.reasoning_api import (
    reasoning_fields,
    render_prompt,
    template_kwargs,
    thinking,
)
from pagefleet_serve.server.refusals import mark_body_read
from pagefleet_serve.server.state import ServerState
from pagefleet_serve.server.token_details import (
    MIN_LOGPROB,
    TokenLabels,
    prompt_fields,
)
from pagefleet_serve.server.tools import ToolCallStream, ToolPlan, plan_tools, split_output
from pagefleet_serve.structured.constraint import CompileQueueFull

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
KEEPALIVE = ": keep-alive\n\n"
DONE = "data: [DONE]\n\n"
# A batch of text prompts is read whole only if it holds no more characters than this many
# full-length prompts (each is read with `max_prompt_chars` at most).
MAX_BATCH_CONTEXTS = 4

logger = logging.getLogger(__name__)


def sse_event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _Stalled(Exception):
    """The client took no bytes of the stream for the write timeout."""


class SSEResponse(StreamingResponse):
    """An event stream that closes its generation however the response ends, even when
    the client leaves before the body starts. A write the client does not take within
    `write_timeout` seconds (it holds the connection open and reads nothing, so the
    socket's buffers are full) ends the stream and aborts its request: unread output
    stops piling up and the request's KV blocks go back (`on_stall` counts it)."""

    def __init__(
        self,
        generation: Generation,
        body: AsyncIterator[str],
        write_timeout: float,
        on_stall: Callable[[], None],
    ) -> None:
        super().__init__(body, media_type="text/event-stream", headers=SSE_HEADERS)
        self.generation = generation
        self.write_timeout = write_timeout
        self.on_stall = on_stall
        self.stalled = False

    async def __call__(self, scope, receive, send) -> None:
        async def bounded_send(message) -> None:
            try:
                await asyncio.wait_for(send(message), self.write_timeout or None)
            except TimeoutError:
                self.stalled = True
                raise _Stalled from None

        try:
            await super().__call__(scope, receive, bounded_send)
        except BaseException:
            if not self.stalled:
                raise
            # The exception may come wrapped (starlette's task group): the flag says.
            logger.warning(
                "a stream's client took no bytes for %.0f s: its request is aborted",
                self.write_timeout,
            )
            self.on_stall()
        finally:
            self.generation.close()


@dataclass
class _Run:
    id: str
    created: int
    model: str
    request: _GenerationRequest
    generation: Generation
    tools: ToolPlan | None = None  # chat requests with tools
    text_offsets: dict[int, int] = field(default_factory=dict)  # completions logprobs
    tool_streams: dict[int, ToolCallStream] = field(default_factory=dict)  # by choice index
    # Choices whose first entry was written: it carries the prompt (echo, its token ids and
    # logprobs).
    opened: set[int] = field(default_factory=set)

    def open_choice(self, index: int) -> bool:
        """True the first time a choice is written."""
        first = index not in self.opened
        self.opened.add(index)
        return first

    def prompt_of(self, index: int) -> tuple[list[int], list | None]:
        """A choice's prompt token ids and their logprobs (None unless asked for)."""
        prompt_index = index // self.generation.params.n
        request = self.generation.requests[prompt_index].request
        return request.prompt_token_ids, self.generation.prompt_logprobs.get(prompt_index)

    def usage(self, completion_tokens: int, reasoning_tokens: int = 0) -> dict:
        prompt_tokens = self.generation.num_prompt_tokens
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        if self.thinks:  # -- reasoning models (issue 72)
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        return usage

    @property
    def thinks(self) -> bool:
        """The request runs a reasoning model's thinking (its output is split)."""
        return self.generation.params.thinking is not None

    @property
    def shows_reasoning(self) -> bool:
        """The answer carries the thinking (`include_reasoning` is not false)."""
        return self.thinks and self.request.include_reasoning is not False


@dataclass
class _Input:
    """An API request's prompts and settings, ready for the frontend."""

    prompts: list[Prompt]  # one engine request each
    params: SamplingParams
    tools: ToolPlan | None = None  # chat requests with tools


class PromptBounds:
    """What every endpoint that reads prompts checks before tokenizing them: text longer
    than the context could hold, alone or in a batch, is refused by its length (a prompt
    by the frontend, as `PromptTooLongError`); the refusals name `prompt_param`."""

    prompt_param: str

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.inputs = state.engine.inputs
        self.tokenizer = self.inputs.tokenizer
        self.max_model_len = self.inputs.limits.max_model_len
        self.max_prompt_chars = self.inputs.max_prompt_chars

    def encode(self, text: str) -> list[int]:
        self.check_tokenizer()
        self.check_prompt_chars(len(text))
        return self.inputs.tokenize(text)

    def check_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise bad_request(
                f"{self.prompt_param}: this model has no tokenizer; send token ids",
                param=self.prompt_param,
            )

    def check_prompt_chars(self, num_chars: int) -> None:
        """Refuse text that cannot fit the context whatever its tokens, before tokenizing."""
        if num_chars > self.max_prompt_chars:
            raise self.too_long(num_chars)

    def too_long(self, num_chars: int) -> APIError:
        return bad_request(
            f"{self.prompt_param}: {num_chars} characters cannot fit in this model's "
            f"maximum context length of {self.max_model_len} tokens (at most "
            f"{self.max_prompt_chars} characters can). Please reduce the length of the "
            f"{self.prompt_param}.",
            param=self.prompt_param,
            code="context_length_exceeded",
        )

    def check_batch_chars(self, num_chars: int) -> None:
        """Refuse a batch of prompts longer in all than MAX_BATCH_CONTEXTS contexts could
        hold, before tokenizing any of them."""
        limit = MAX_BATCH_CONTEXTS * self.max_prompt_chars
        if num_chars > limit:
            where = self.prompt_param
            raise bad_request(
                f"{where}: the batch's prompts have {num_chars} characters in all; at most "
                f"{limit} are read in one request ({MAX_BATCH_CONTEXTS} times the "
                f"{self.max_prompt_chars} one prompt may have). Send fewer or shorter prompts.",
                param=where,
                code="context_length_exceeded",
            )


class GenerationEndpoint(PromptBounds, abc.ABC):
    request_model: type[_GenerationRequest]
    id_prefix: str  # with its separator, as OpenAI writes the endpoint's ids
    object_name: str
    chunk_object: str

    def __init__(self, state: ServerState) -> None:
        super().__init__(state)
        self.token_text = state.engine.outputs.token_text

    async def __call__(self, raw: Request) -> Response:
        body = await read_json_body(raw, self.state.settings.max_request_body_bytes)
        request_id = f"{self.id_prefix}{uuid.uuid4().hex}"
        request, processed, tools = await self.state.off_loop(
            lambda: self._validate(body, request_id)
        )
        if not await self._grammar_compiled(raw, processed):
            return Response(status_code=499)  # the client has gone; nobody reads this
        generation = Generation(self.state, processed.requests)
        run = _Run(
            request_id,
            int(time.time()),
            request.model or self.state.settings.model_name,
            request,
            generation,
            tools,
        )
        if request.stream:
            return SSEResponse(
                generation,
                self._stream(run),
                self.state.settings.stream_write_timeout,
                self.state.metrics.stream_write_timeouts.labels(self.state.settings.model_name).inc,
            )
        return await self._respond(run, raw)

    async def _grammar_compiled(self, raw: Request, processed: ProcessedInput) -> bool:
        """Wait for the core to compile the constraint the request's prompts share (at
        once without one or when cached): False if the client left first. 400 when it
        cannot compile, 429 when the compile queue or this client's share of it is full."""
        if processed.compiled is None:
            return True
        try:
            return await _unless_disconnected(raw, self.state.engine.compiled(processed))
        except CompileQueueFull as exc:
            field = processed.requests[0].params.structured_outputs.field
            raise APIError(
                429,
                f"{field}: {exc}",
                type="rate_limit_error",
                param=field,
                code="compile_queue_full",
                headers={"Retry-After": "1"},
            ) from None
        except ValueError as exc:
            raise value_error(exc, self.request_model) from None

    def _validate(
        self, body: bytes, request_id: str
    ) -> tuple[_GenerationRequest, ProcessedInput, ToolPlan | None]:
        """Body -> validated engine requests, one per prompt (frontend thread)."""
        if self.state.engine.pooling is not None:
            raise bad_request(
                f"{self.state.settings.model_name} is an embedding model (task embed): it "
                "generates no text; use /v1/embeddings",
                param="model",
                code="model_not_supported",
            )
        request = parse(self.request_model, body)
        lora_name = self.state.check_model(request.model)
        request.check_supported()
        if request.priority and self.state.settings.scheduling_policy != "priority":
            raise bad_request(
                "priority: this server schedules first come, first served; it honours "
                "priority only when started with --scheduling-policy priority",
                param="priority",
            )
        try:
            prepared = self.prepare(request)
            processed = self.state.engine.process_input(
                {f"{request_id}-{i}": prompt for i, prompt in enumerate(prepared.prompts)},
                prepared.params,
                lora_name=lora_name,
                client=current_client(),
            )
            return request, processed, prepared.tools
        except ContextLengthError as exc:
            raise self._context_error(exc) from None
        except PromptTooLongError as exc:
            raise self.too_long(exc.num_chars) from None
        except ValueError as exc:
            raise value_error(exc, self.request_model) from None

    # -- what each endpoint defines ---------------------------------------------------------
    @abc.abstractmethod
    def prepare(self, request) -> _Input:
        """The prompts (one engine request each), the sampling settings and, for chat with
        tools, how tool calls are constrained and parsed."""

    def opening_chunks(self, run: _Run) -> list[dict]:
        return []

    def choice_chunks(self, run: _Run, delta: CompletionOutput) -> list[dict]:
        """A choice's entries in stream chunks for one delta (none when it has no news)."""
        if delta.text or delta.finish_reason or delta.logprobs:
            return [self.choice_chunk(run, delta)]
        return []

    @abc.abstractmethod
    def choice_chunk(self, run: _Run, delta: CompletionOutput) -> dict:
        """One choice's entry in a stream chunk."""

    @abc.abstractmethod
    def final_choice(self, run: _Run, choice: CompletionOutput) -> dict:
        """One choice's entry in a whole response."""

    # -- shared ---------------------------------------------------------------------------
    def _labels(self, run: _Run) -> TokenLabels:
        return TokenLabels(self.token_text, bool(run.request.return_tokens_as_token_ids))

    def _token_ids(self, run: _Run, choice: CompletionOutput) -> dict:
        return {"token_ids": choice.token_ids} if run.request.return_token_ids else {}

    def envelope(self, run: _Run, chunk: bool) -> dict:
        return {
            "id": run.id,
            "object": self.chunk_object if chunk else self.object_name,
            "created": run.created,
            "model": run.model,
        }

    async def _stream(self, run: _Run) -> AsyncIterator[str]:
        usage_field = {"usage": None} if run.request.include_usage else {}
        completion_tokens = reasoning_tokens = 0
        try:
            for chunk in self.opening_chunks(run):
                yield sse_event(self.envelope(run, chunk=True) | {"choices": [chunk]} | usage_field)
            async for delta in self.stream_deltas(run):
                if delta is None:
                    yield KEEPALIVE
                    continue
                completion_tokens += len(delta.token_ids)
                reasoning_tokens += delta.num_reasoning_tokens
                if run.request.continuous_usage:  # vLLM's: the usage so far in every chunk
                    usage_field = {"usage": run.usage(completion_tokens, reasoning_tokens)}
                for choice in self.choice_chunks(run, delta):
                    yield sse_event(
                        self.envelope(run, chunk=True) | {"choices": [choice]} | usage_field
                    )
            if run.request.include_usage:
                yield sse_event(
                    self.envelope(run, chunk=True)
                    | {"choices": [], "usage": run.usage(completion_tokens, reasoning_tokens)}
                )
        except RequestFailed as exc:
            yield sse_event(server_error(str(exc)).body())
        except RequestCancelled as exc:
            yield sse_event(unavailable(str(exc), code="server_shutting_down").body())
        yield DONE

    async def stream_deltas(self, run: _Run) -> AsyncIterator[CompletionOutput | None]:
        """A streamed run's choice deltas as they come; None: a keep-alive is due."""
        settings = self.state.settings
        async for deltas in run.generation.stream(
            settings.sse_keepalive_interval or None, settings.stream_coalesce_interval
        ):
            if not deltas:
                yield None
            for delta in deltas:
                yield delta

    async def _respond(self, run: _Run, raw: Request) -> Response:
        choices = [CompletionOutput(i) for i in range(run.generation.num_choices)]

        async def collect() -> None:
            async for deltas in run.generation.stream(None, 0.0):
                for delta in deltas:
                    choices[delta.index].extend(delta)

        if not await run_to_end(raw, run.generation, collect()):
            return Response(status_code=499)  # the client has gone; nobody reads this
        return JSONResponse(self.response_body(run, choices))

    def response_body(self, run: _Run, choices: list[CompletionOutput]) -> dict:
        """The whole (non-stream) response of a finished run."""
        completion_tokens = sum(len(c.token_ids) for c in choices)
        reasoning_tokens = sum(c.num_reasoning_tokens for c in choices)
        return self.envelope(run, chunk=False) | {
            "choices": [self.final_choice(run, c) for c in choices],
            "usage": run.usage(completion_tokens, reasoning_tokens),
        }

    def _context_error(self, exc: ContextLengthError) -> APIError:
        where = "messages" if self.prompt_param == "messages" else "prompt"
        return bad_request(
            f"This model's maximum context length is {exc.max_model_len} tokens. However, you "
            f"requested {exc.num_prompt_tokens + exc.max_tokens} tokens "
            f"({exc.num_prompt_tokens} in the {where}, {exc.max_tokens} in the completion). "
            f"Please reduce the length of the {where} or completion.",
            param=self.prompt_param,
            code="context_length_exceeded",
        )


class ChatCompletionsEndpoint(GenerationEndpoint):
    request_model = ChatCompletionRequest
    id_prefix = "chatcmpl-"
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"
    prompt_param = "messages"

    def prepare(self, request: ChatCompletionRequest) -> _Input:
        if not request.messages:
            raise bad_request("messages: must not be empty", param="messages")
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs: requires logprobs to be true", param="top_logprobs")
        if self.tokenizer is None:
            raise bad_request(
                "messages: this model has no tokenizer or chat template", param="messages"
            )
        # Every message costs a token of the context at least (its role): counted before
        # any is read, templated or tokenized.
        if len(request.messages) > self.max_model_len:
            raise bad_request(
                f"messages: {len(request.messages)} messages cannot fit in this model's "
                f"maximum context length of {self.max_model_len} tokens",
                param="messages",
                code="context_length_exceeded",
            )
        tools = plan_tools(request, self.state.settings)
        images = read_images(request.messages, self.state.media, self.state.settings.model_name)
        messages = template_messages(request.messages)
        self.check_prompt_chars(content_chars(messages))
        # -- reasoning models (issue 72): template kwargs, the parser's prompt, the thinking
        kwargs = template_kwargs(request.chat_template_kwargs, request.reasoning_effort)
        text = render_prompt(self.inputs, messages, tools.template_tools, kwargs)
        vision = self.state.image_processing
        if images and vision is not None:  # read_images refuses images for a text-only model
            text = vision.expand(text, len(images))
        prompt = request.truncated(self.encode(text), self.max_model_len)
        spec = thinking(self.inputs, prompt, kwargs, request.thinking_token_budget)
        max_tokens = request.max_completion_tokens
        if max_tokens is None:
            max_tokens = request.max_tokens
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        if max_tokens is None:  # OpenAI's default: whatever the context has left
            max_tokens = max(1, self.max_model_len - len(prompt))
        params = request.sampling_params(
            max_tokens, logprobs, tools.constraint, spec, defaults=self.state.sampling_defaults
        )
        if images and vision is not None:
            image_prompt = ImagePrompt(prompt, vision.inputs(prompt, images))
            self.state.metrics.request_images.labels(self.state.settings.model_name).observe(
                len(images)
            )
            return _Input([image_prompt], params, tools)
        return _Input([prompt], params, tools)

    def opening_chunks(self, run: _Run) -> list[dict]:
        return [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(run.generation.num_choices)
        ]

    def choice_chunk(self, run: _Run, delta: CompletionOutput) -> dict:
        return {
            "index": delta.index,
            "delta": {"content": delta.text} if delta.text else {},
            "logprobs": self._logprobs(delta, self._labels(run)),
            "finish_reason": delta.finish_reason,
        } | self._token_ids(run, delta)

    def response_body(self, run: _Run, choices: list[CompletionOutput]) -> dict:
        body = super().response_body(run, choices)
        return body | prompt_fields(run.request, *run.prompt_of(0), self._labels(run))

    def choice_chunks(self, run: _Run, delta: CompletionOutput) -> list[dict]:
        """A delta's thinking goes out first, in a chunk of its own, then its answer."""
        reasoning = []
        if delta.reasoning and run.shows_reasoning:
            fields = reasoning_fields(delta.reasoning)
            reasoning = [
                {"index": delta.index, "delta": fields, "logprobs": None, "finish_reason": None}
            ]
        return reasoning + self._answer_chunks(run, delta)

    def _answer_chunks(self, run: _Run, delta: CompletionOutput) -> list[dict]:
        if run.tools is None or run.tools.parser is None:
            return super().choice_chunks(run, delta)
        stream = run.tool_streams.setdefault(delta.index, ToolCallStream(run.tools))
        finished = delta.finish_reason is not None
        chunks = [
            {"index": delta.index, "delta": d, "logprobs": None, "finish_reason": None}
            for d in stream.feed(delta.text, finished)
        ]
        logprobs = self._logprobs(delta, self._labels(run))
        if (finished or logprobs) and not chunks:
            chunks.append(
                {"index": delta.index, "delta": {}, "logprobs": None, "finish_reason": None}
            )
        if logprobs:
            chunks[0]["logprobs"] = logprobs
        if finished:
            chunks[-1]["finish_reason"] = _finish_reason(
                run.tools, delta.finish_reason, stream.calls
            )
        return chunks

    def final_choice(self, run: _Run, choice: CompletionOutput) -> dict:
        message = {"role": "assistant", "content": choice.text}
        if run.shows_reasoning:
            message |= reasoning_fields(choice.reasoning or None)
        finish_reason = choice.finish_reason
        if run.tools is not None and run.tools.parser is not None:
            content, calls = split_output(run.tools, choice.text)
            message["content"] = content
            if calls:
                message["tool_calls"] = [call.as_message() for call in calls]
            finish_reason = _finish_reason(run.tools, finish_reason, calls)
        return {
            "index": choice.index,
            "message": message,
            "logprobs": self._logprobs(choice, self._labels(run)),
            "finish_reason": finish_reason,
        } | self._token_ids(run, choice)

    def _logprobs(self, choice: CompletionOutput, label: TokenLabels | None = None) -> dict | None:
        if choice.logprobs is None:
            return None
        label = label or TokenLabels(self.token_text)

        def item(token_id: int, logprob: float) -> dict:
            text = label(token_id)
            return {
                "token": text,
                "logprob": max(logprob, MIN_LOGPROB),
                "bytes": list(text.encode("utf-8")),
            }

        return {
            "content": [
                item(e.token_id, e.logprob)
                | {"top_logprobs": [item(t, lp) for t, lp in e.top_logprobs]}
                for e in choice.logprobs
            ]
        }


def _finish_reason(tools: ToolPlan, reason: str | None, calls: list) -> str | None:
    """OpenAI ends a turn that called tools with "tool_calls" (a named function: "stop")."""
    return tools.finish_reason if calls and reason == "stop" else reason


def list_models(state: ServerState, created: int) -> dict:
    """The served names of the base model, then its LoRA adapters (`parent`: the base)."""
    engine = state.engine

    def card(name: str, root: str, parent: str | None) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "pagefleet",
            "root": root,
            "parent": parent,
            "max_model_len": engine.max_model_len,
        }

    base = [card(name, engine.config.model, None) for name in state.settings.served_model_names]
    adapters = [
        card(a.name, a.path, state.settings.model_name) for a in engine.lora_adapters.values()
    ]
    return {"object": "list", "data": base + adapters}


async def read_json_body(raw: Request, limit: int) -> bytes:
    """The body of a JSON request, refused (415, 413) before it is read whole."""
    content_type = raw.headers.get("content-type", "")
    if content_type.partition(";")[0].strip().lower() != "application/json":
        raise APIError(
            415,
            f"Content-Type must be application/json, got {content_type[:100]!r}",
            code="unsupported_media_type",
        )
    declared = raw.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _body_too_large(limit)
    body = bytearray()
    try:
        async for chunk in raw.stream():
            body += chunk
            if len(body) > limit:
                raise _body_too_large(limit)
    except ClientDisconnect:
        # Nobody will read this answer; it only ends the request quietly.
        raise bad_request("the client disconnected before sending the whole body") from None
    mark_body_read(raw.scope)  # a refusal from here on is charged by its work
    return bytes(body)


def _body_too_large(limit: int) -> APIError:
    # Connection: close, so that the rest of the body is not read (and not waited for).
    return APIError(
        413,
        f"the request body is larger than this server accepts ({limit} bytes; "
        f"--max-request-body-bytes)",
        code="request_too_large",
        headers={"Connection": "close"},
    )


async def run_to_end(raw: Request, generation: Generation, collect: Coroutine) -> bool:
    """Run `collect` (which reads the generation's stream to its end) unless the client
    disconnects first: True if it ran. The engine's failure is a 500, a drain's cancel a
    503; the generation is closed either way."""
    try:
        return await _unless_disconnected(raw, collect)
    except RequestFailed as exc:
        raise server_error(str(exc)) from None
    except RequestCancelled as exc:
        raise unavailable(str(exc), code="server_shutting_down") from None
    finally:
        generation.close()


async def _unless_disconnected(raw: Request, work: Coroutine) -> bool:
    """Run `work` unless the client disconnects first (then cancel it): True if it ran."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(raw))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task not in done:
        await asyncio.wait({task})  # let its cleanup (the engine abort) run
        return False
    task.result()
    return True


async def _disconnected(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass
