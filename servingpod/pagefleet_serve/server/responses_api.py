"""/v1/responses, OpenAI's Responses API, on the chat path.

A request's `instructions`, the conversation of its `previous_response_id` (kept in this
process's `ResponseStore`) and its `input` items become chat messages; its flat function
tools, `tool_choice`, `text.format` and `max_output_tokens` become their chat forms; then
`ChatCompletionsEndpoint` templates, bounds, constrains and runs it as it runs a chat
completion (same limits, errors, metrics and traces). Only the output is written the
Responses way: output items (a message with `output_text`, `function_call`s), the usage
with its details, and in a stream the Responses events, each with its `sequence_number`.

A response is kept (unless `store` is false) for `previous_response_id`, GET and DELETE
/v1/responses/{id}; ids are OpenAI's shapes (`resp_`, `msg_`, `fc_`, calls `call_`). An
error the chat path raises names the Responses field the client sent (`text.format`, not
`response_format`).

A reasoning model's thinking is a `reasoning` item before the message (streamed with
`response.reasoning_text.delta` events), its tokens `output_tokens_details.
reasoning_tokens`; `reasoning.effort` goes to the template, and reasoning items in
`input` give an earlier turn's thinking back to it.

What this server cannot do is refused by name (400): built-in tools, non-text input
parts (images, files, audio), items other than messages, function calls and their
outputs and reasoning, `reasoning` for a model whose thinking it does not read, and
fields such as `background` or `conversation`; of `include`, only
"message.output_text.logprobs" (the output text's logprobs, `top_logprobs` of them).
"""

import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from itertools import count
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Discriminator, Field, PrivateAttr, Tag

from pagefleet_serve.frontend.core_client import ProcessedInput
from pagefleet_serve.outputs import CompletionOutput
from pagefleet_serve.server.errors import APIError, bad_request
from pagefleet_serve.server.generation import RequestCancelled, RequestFailed
from pagefleet_serve.server.openai_api import KEEPALIVE, ChatCompletionsEndpoint, _Input, _Run
from pagefleet_serve.server.protocol import (
    MAX_USER_CHARS,
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    FunctionCall,
    FunctionDefinition,
    ImageURL,
    JSONSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolCallMessage,
    _absent,
    check_metadata,
    refuse_unsupported,
)
from pagefleet_serve.server.response_store import ResponseStore
from pagefleet_serve.server.responses_output import (
    OutputWriter,
    function_call_item,
    message_item,
    new_id,
    reasoning_item,
    status_of,
)
from pagefleet_serve.server.state import ServerState
from pagefleet_serve.server.tools import split_output

_CONFIG = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
_OPEN = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

# Fields of the Responses API this server does not implement, with the values that ask
# for nothing; any other value is a 400 naming the field.
UNSUPPORTED_RESPONSES_FIELDS = {
    "background": _absent(False),
    "conversation": _absent(),
    "prompt": _absent(),
    "max_tool_calls": _absent(),
    "truncation": _absent("disabled"),
    "context_management": _absent([]),
}
# The chat fields a request's own become (see `ResponsesEndpoint.prepare`): the chat path's
# errors that name one name the Responses field instead, as (param, name in the message).
CHAT_FIELDS = {
    "response_format": ("text", "text.format"),
    "max_completion_tokens": ("max_output_tokens", "max_output_tokens"),
    "max_tokens": ("max_output_tokens", "max_output_tokens"),
    "messages": ("input", "input"),
}
INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the one `include` this server fills
TEXT_PART_TYPES = ("input_text", "output_text")


def _kind(value: object, known: tuple[str, ...], default: str | None = None) -> str:
    """The tag of an item or tool: its `type` when this server knows it, else "other"."""
    kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in known else "other"


class _Unsupported(BaseModel):
    """An item or tool of a type this server does not take: kept to be refused by name."""

    model_config = _OPEN
    type: str


class MessagePart(BaseModel):
    """A message's content part: text (`input_text`, `output_text`) or an image
    (`input_image`, its `image_url` a data: URL; see docs/multimodal.md)."""

    model_config = _CONFIG
    type: str
    text: str | None = None
    image_url: str | None = None
    detail: Literal["auto", "low", "high"] | None = None  # accepted; images are read whole


class MessageItem(BaseModel):
    model_config = _CONFIG
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[MessagePart]


class FunctionCallItem(BaseModel):
    model_config = _CONFIG
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class ReasoningText(BaseModel):
    model_config = _CONFIG
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(BaseModel):
    """A reasoning model's earlier thinking, given back for the turn it belongs to."""

    model_config = _CONFIG
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None


class ReasoningConfig(BaseModel):
    model_config = _CONFIG
    effort: Literal["low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = _CONFIG
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[_Unsupported, Tag("other")],
    # An item without a type is a message (OpenAI's "easy input message").
    Discriminator(lambda v: _kind(v, INPUT_ITEM_TYPES, "message")),
]


class FunctionTool(FunctionDefinition):
    """A function tool in the Responses API's flat shape."""

    type: Literal["function"]


ResponsesTool = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[_Unsupported, Tag("other")],
    Discriminator(lambda v: _kind(v, ("function",))),
]


class FunctionToolChoice(BaseModel):
    model_config = _CONFIG
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = _CONFIG
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = _CONFIG
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    model_config = _OPEN
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    priority: int | None = None  # vLLM's extra field, as on chat
    # Reasoning models: the effort, and vLLM's extra fields as chat has them.
    reasoning: ReasoningConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool | None = None
    thinking_token_budget: int | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    # The conversation so far (the previous response's and this input, no instructions).
    _conversation: list[ChatMessage] = PrivateAttr(default_factory=list)

    def check_supported(self) -> None:
        refuse_unsupported(self, UNSUPPORTED_RESPONSES_FIELDS)
        check_metadata(self.metadata)
        for name in self.include or []:
            if name != OUTPUT_LOGPROBS:
                raise bad_request(
                    f"include: {name!r} is not supported; this server includes "
                    f"{OUTPUT_LOGPROBS!r} only",
                    param="include",
                    code="unsupported_field",
                )

    @property
    def wants_logprobs(self) -> bool:
        return OUTPUT_LOGPROBS in (self.include or [])


@dataclass(frozen=True)
class _Stored:
    response: dict  # the response's JSON as it was answered (the final one, streamed)
    conversation: list[ChatMessage]  # what a continuation's prompt starts with


class ResponsesEndpoint(ChatCompletionsEndpoint):
    request_model = ResponsesRequest  # type: ignore[assignment]
    id_prefix = "resp_"
    object_name = "response"
    prompt_param = "input"

    def __init__(self, state: ServerState) -> None:
        super().__init__(state)
        settings = state.settings
        self.store: ResponseStore[_Stored] = ResponseStore(
            settings.responses_store_max_entries, settings.responses_store_max_age
        )

    # -- GET and DELETE /v1/responses/{response_id} -----------------------------------------
    def retrieve(self, response_id: str, raw: Request) -> Response:
        if raw.query_params.get("stream", "false").lower() not in ("false", "0"):
            raise bad_request(
                "stream: this server does not stream a stored response again; retrieve it "
                "without stream",
                param="stream",
            )
        stored = self.store.get(response_id)
        if stored is None:
            raise self._not_found(response_id)
        return JSONResponse(stored.response)

    def delete(self, response_id: str) -> Response:
        if not self.store.delete(response_id):
            raise self._not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    def _not_found(
        self, response_id: str, param: str | None = None, code: str = "response_not_found"
    ) -> APIError:
        what = "Previous response" if param == "previous_response_id" else "Response"
        kept = "" if self.store.enabled else " (this server keeps no responses)"
        return APIError(
            404, f"{what} with id '{response_id}' not found{kept}.", param=param, code=code
        )

    # -- input -------------------------------------------------------------------------------
    def prepare(self, request: ResponsesRequest) -> _Input:  # type: ignore[override]
        history = self._history(request.previous_response_id)
        items = request.input
        if isinstance(items, str):
            items = [MessageItem(role="user", content=items)]
        if not items:
            raise bad_request("input: must not be empty", param="input")
        thinks = self.state.reasoning_parser is not None
        if request.reasoning is not None and not thinks:
            raise bad_request(
                "reasoning: this server reads no reasoning model's thinking (start it with "
                "--reasoning-parser); remove reasoning from the request",
                param="reasoning",
            )
        if request.reasoning is not None and request.reasoning.summary is not None:
            raise bad_request(
                "reasoning.summary: this server writes no summaries of the thinking; the "
                "reasoning item carries the thinking itself (remove summary)",
                param="reasoning",
            )
        request._conversation = history + _chat_messages(items, thinks)
        messages = list(request._conversation)
        if request.instructions:
            messages.insert(0, ChatMessage(role="system", content=request.instructions))
        chat = ChatCompletionRequest(
            model=request.model,
            messages=messages,
            max_completion_tokens=request.max_output_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            tools=_chat_tools(request.tools),
            tool_choice=_chat_tool_choice(request.tool_choice),
            parallel_tool_calls=request.parallel_tool_calls,
            response_format=_response_format(request.text),
            priority=request.priority,
            chat_template_kwargs=request.chat_template_kwargs,
            reasoning_effort=request.reasoning.effort if request.reasoning else None,
            include_reasoning=request.include_reasoning,
            thinking_token_budget=request.thinking_token_budget,
            logprobs=request.wants_logprobs,
            top_logprobs=request.top_logprobs if request.wants_logprobs else None,
        )
        if request.top_logprobs is not None and not 0 <= request.top_logprobs <= 20:
            raise bad_request("top_logprobs: must be in [0, 20]", param="top_logprobs")
        return super().prepare(chat)

    def _validate(self, body: bytes, request_id: str):
        # The chat path's errors name chat fields (messages, response_format...).
        try:
            return super()._validate(body, request_id)
        except APIError as exc:
            raise _responses_error(exc) from None

    async def _grammar_compiled(self, raw: Request, processed: ProcessedInput) -> bool:
        # The constraint compiles under its chat field's name (response_format).
        try:
            return await super()._grammar_compiled(raw, processed)
        except APIError as exc:
            raise _responses_error(exc) from None

    def _history(self, response_id: str | None) -> list[ChatMessage]:
        if response_id is None:
            return []
        stored = self.store.get(response_id)
        if stored is None:
            raise self._not_found(
                response_id, "previous_response_id", "previous_response_not_found"
            )
        return stored.conversation

    # -- output ------------------------------------------------------------------------------
    def response_body(self, run: _Run, choices: list[CompletionOutput]) -> dict:
        [choice] = choices
        status = status_of(choice.finish_reason)
        content, calls = split_output(run.tools, choice.text) if run.tools else (choice.text, [])
        output = []
        if choice.reasoning and run.shows_reasoning:
            output.append(reasoning_item(new_id("rs"), choice.reasoning, "completed"))
        if content or not calls:
            logprobs = (self._logprobs(choice) or {}).get("content", [])
            output.append(message_item(new_id("msg"), content or "", status, logprobs))
        output += [
            function_call_item(new_id("fc"), c.id, c.name, c.arguments, "completed") for c in calls
        ]
        usage = self._usage(run, len(choice.token_ids), choice.num_reasoning_tokens)
        body = self._response(run, status, output, usage)
        self._keep(run, body)
        return body

    async def _stream(self, run: _Run) -> AsyncIterator[str]:
        numbers = count()

        def event(kind: str, **fields) -> str:
            payload = {"type": kind, "sequence_number": next(numbers), **fields}
            data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
            return f"event: {kind}\ndata: {data}\n\n"

        writer = OutputWriter(run.tools, run.shows_reasoning)
        yield event("response.created", response=self._response(run, "in_progress", [], None))
        yield event("response.in_progress", response=self._response(run, "in_progress", [], None))
        output_tokens = reasoning_tokens = 0
        try:
            async for delta in self.stream_deltas(run):
                if delta is None:
                    yield KEEPALIVE
                    continue
                output_tokens += len(delta.token_ids)
                reasoning_tokens += delta.num_reasoning_tokens
                writer.logprobs += (self._logprobs(delta) or {}).get("content", [])
                for kind, fields in writer.feed(delta.text, delta.finish_reason, delta.reasoning):
                    yield event(kind, **fields)
            for kind, fields in writer.finish():
                yield event(kind, **fields)
        except (RequestFailed, RequestCancelled) as exc:
            failed = self._response(run, "failed", writer.items(), None)
            failed["error"] = {"code": "server_error", "message": str(exc)}
            yield event("response.failed", response=failed)
            return
        usage = self._usage(run, output_tokens, reasoning_tokens)
        final = self._response(run, writer.status, writer.items(), usage)
        self._keep(run, final)
        done = "response.completed" if writer.status == "completed" else "response.incomplete"
        yield event(done, response=final)

    def _keep(self, run: _Run, response: dict) -> None:
        request: ResponsesRequest = run.request  # type: ignore[assignment]
        if request.store is not False:
            conversation = request._conversation + _output_messages(response["output"])
            self.store.put(response["id"], _Stored(response, conversation))

    def _usage(self, run: _Run, output_tokens: int, reasoning_tokens: int) -> dict:
        input_tokens = run.generation.num_prompt_tokens
        return {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": run.generation.num_cached_tokens},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens,
        }

    def _response(self, run: _Run, status: str, output: list[dict], usage: dict | None) -> dict:
        request: ResponsesRequest = run.request  # type: ignore[assignment]
        text_format = request.text.format if request.text and request.text.format else None
        tool_choice = request.tool_choice
        if tool_choice is None:
            tool_choice = "auto" if request.tools else "none"
        return {
            "id": run.id,
            "object": "response",
            "created_at": run.created,
            "status": status,
            "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata or {},
            "model": run.model,
            "output": output,
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id,
            "store": request.store is not False and self.store.enabled,
            "temperature": request.temperature,
            "text": {
                "format": (
                    text_format.model_dump(by_alias=True, exclude_none=True)
                    if text_format
                    else {"type": "text"}
                )
            },
            "tool_choice": (
                tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump()
            ),
            "tools": [t.model_dump(by_alias=True, exclude_none=True) for t in request.tools or []],
            "top_p": request.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": request.user,
        }


# -- Responses shapes <-> chat shapes --------------------------------------------------------
def _chat_messages(items: list, thinks: bool) -> list[ChatMessage]:
    """Input items -> chat messages: a function call joins the assistant turn before it
    (parallel calls are one turn), its output is a tool message; a reasoning item opens
    the assistant turn it was thought for (`thinks`: the server reads a reasoning
    model's thinking, else it is refused)."""
    messages: list[ChatMessage] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if isinstance(item, ReasoningItem) and not thinks:
            item = _Unsupported(type="reasoning")
        if isinstance(item, _Unsupported):
            raise bad_request(
                f"{where}: items of type {item.type!r} are not supported; this server takes "
                f"{', '.join(INPUT_ITEM_TYPES)} items",
                param="input",
                code="unsupported_content",
            )
        last = messages[-1] if messages else None
        if isinstance(item, ReasoningItem):
            text = "".join(part.text for part in item.content or ())
            messages.append(ChatMessage(role="assistant", content="", reasoning=text))
        elif isinstance(item, MessageItem):
            content = _message_content(item.content, where)
            if (
                item.role == "assistant"
                and last is not None
                and last.role == "assistant"
                and last.reasoning is not None
                and not last.content
                and not last.tool_calls
            ):  # the answer of the turn a reasoning item opened
                last.content = content
            else:
                messages.append(ChatMessage(role=item.role, content=content))
        elif isinstance(item, FunctionCallItem):
            try:
                json.loads(item.arguments)
            except ValueError:
                raise bad_request(f"{where}.arguments: not valid JSON", param="input") from None
            call = ToolCallMessage(
                id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments)
            )
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content="", tool_calls=[call]))
        else:
            content = _text(item.output, f"{where}.output")
            messages.append(ChatMessage(role="tool", content=content, tool_call_id=item.call_id))
    return messages


def _message_content(content: str | list[MessagePart], where: str) -> str | list[ContentPart]:
    """A message's text; one with images as chat content parts (`image_url`), which the
    chat path reads (`server/media.py`)."""
    if isinstance(content, str) or not any(part.type == "input_image" for part in content):
        return _text(content, where)
    parts = []
    for position, part in enumerate(content):
        if part.type == "input_image" and part.image_url is not None:
            parts.append(ContentPart(type="image_url", image_url=ImageURL(url=part.image_url)))
        else:
            parts.append(ContentPart(type="text", text=_text([part], where, position)))
    return parts


def _text(content: str | list[ContentPart] | list[MessagePart], where: str, first: int = 0) -> str:
    if isinstance(content, str):
        return content
    for position, part in enumerate(content, first):
        if part.type not in TEXT_PART_TYPES or part.text is None:
            raise bad_request(
                f"{where}.content[{position}]: content parts of type {part.type!r} are not "
                f"supported; this server reads {', '.join(TEXT_PART_TYPES)} and "
                "input_image (image_url) parts",
                param="input",
                code="unsupported_content",
            )
    return "\n".join(part.text or "" for part in content)


def _chat_tools(tools: list | None) -> list[Tool] | None:
    if tools is None:
        return None
    chat_tools = []
    for index, tool in enumerate(tools):
        if isinstance(tool, _Unsupported):
            raise bad_request(
                f"tools[{index}]: built-in tools ({tool.type!r}) are not supported; this "
                "server calls function tools only",
                param="tools",
                code="unsupported_tool",
            )
        definition = FunctionDefinition.model_validate(
            tool.model_dump(by_alias=True, exclude={"type"})
        )
        chat_tools.append(Tool(type="function", function=definition))
    return chat_tools


def _chat_tool_choice(choice) -> str | NamedToolChoice | None:
    if isinstance(choice, FunctionToolChoice):
        return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    return choice


def _response_format(text: TextConfig | None) -> ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.schema_ is None:
        raise bad_request("text.format: schema is required for type json_schema", param="text")
    schema = JSONSchemaFormat.model_validate(
        {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
    )
    return ResponseFormat(type="json_schema", json_schema=schema)


def _output_messages(output: list[dict]) -> list[ChatMessage]:
    """A response's output items as the chat messages a continuation reads."""
    return _chat_messages(
        [
            MessageItem(role="assistant", content=item["content"][0]["text"])
            if item["type"] == "message"
            else ReasoningItem.model_validate(item)
            if item["type"] == "reasoning"
            else FunctionCallItem(
                type="function_call",
                call_id=item["call_id"],
                name=item["name"],
                arguments=item["arguments"] or "{}",
            )
            for item in output
        ],
        thinks=True,
    )


def _responses_error(exc: APIError) -> APIError:
    """A chat-path error naming a chat field (its param, or the field its message leads
    with) -> the same error naming the Responses field."""
    leading = re.match(rf"(?:{'|'.join(CHAT_FIELDS)})\b", exc.message)
    chat_param = exc.param or (leading.group() if leading else None)
    param = CHAT_FIELDS[chat_param][0] if chat_param in CHAT_FIELDS else exc.param
    message = exc.message
    if leading:
        message = CHAT_FIELDS[leading.group()][1] + message[leading.end() :]
    message = re.sub(r"\bresponse_format\b", CHAT_FIELDS["response_format"][1], message)
    if (param, message) == (exc.param, exc.message):
        return exc
    return APIError(exc.status_code, message, exc.type, param, exc.code, exc.headers)
