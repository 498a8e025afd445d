"""Request bodies of Anthropic's Messages API (pydantic), their translation into the chat
path's `ChatCompletionRequest`, and errors in Anthropic's shape.

A Messages request is a chat request written another way: `system` is the first message,
content blocks become messages (`tool_use` blocks an assistant turn's tool calls,
`tool_result` blocks tool messages answering them), `tools` carry `input_schema` where chat
has `parameters`, and `tool_choice` says `any` where chat says "required". For a
reasoning model, `thinking` is chat's switch and budget: `enabled` (with `budget_tokens`,
chat's `thinking_token_budget`) and `adaptive` switch the model's thinking on through its
template variable, `disabled` off, as `chat_template_kwargs` would; an earlier turn's
thinking blocks are that assistant message's `reasoning`. What this server cannot do is
refused by name (400): image and document blocks, server tools, other thinking types.
"""

import json
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, Discriminator, Field, Tag

from pagefleet_serve.server.errors import APIError, bad_request
from pagefleet_serve.server.protocol import (
    _BODY_CONFIG,
    _CONFIG,
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    Tool,
    ToolCallMessage,
    _absent,
    refuse_unsupported,
)

# Fields of the Messages API this server does not implement, with the values that ask for
# nothing; any other value is a 400 naming the field.
UNSUPPORTED_MESSAGES_FIELDS = {
    "container": _absent(),
    "mcp_servers": _absent([]),
    "context_management": _absent(),
}
BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")
# Messages' thinking types (what each does: `MessagesRequest.chat_request`) and displays
# ("summarized" is the thinking as written: this server writes no summaries).
THINKING_TYPES = ("enabled", "adaptive", "disabled")
THINKING_DISPLAYS = ("summarized", "omitted")
# Anthropic's error types by HTTP status (its SDK raises one exception class per status).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
# The chat fields a request's own become: the chat path's errors name the Messages field.
CHAT_FIELDS = {
    "max_completion_tokens": "max_tokens",
    "stop": "stop_sequences",
    "thinking_token_budget": "thinking.budget_tokens",
}


def _block_kind(value: object) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in BLOCK_TYPES else "other"


class TextBlock(BaseModel):
    model_config = _CONFIG
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    model_config = _CONFIG
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class ToolResultBlock(BaseModel):
    model_config = _CONFIG
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None


class ThinkingBlock(BaseModel):
    """A thinking block of an earlier assistant turn (a client sends them back): the
    turn's reasoning for the template (which may leave it out, as Qwen3's does for turns
    before the last); a redacted one carries none."""

    model_config = _BODY_CONFIG
    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None


class _OtherBlock(BaseModel):
    """A block of a type this server does not take: kept to be refused by name."""

    model_config = _BODY_CONFIG
    type: str


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[ThinkingBlock, Tag("redacted_thinking")]
    | Annotated[_OtherBlock, Tag("other")],
    Discriminator(_block_kind),
]


class Message(BaseModel):
    model_config = _CONFIG
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class ToolDefinition(BaseModel):
    """A client tool; a server tool (a `type` such as "web_search_20250305") is refused."""

    model_config = _BODY_CONFIG
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict | None = None
    type: str | None = None


class ToolChoice(BaseModel):
    model_config = _CONFIG
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(BaseModel):
    model_config = _BODY_CONFIG
    type: str
    budget_tokens: int | None = None
    display: str | None = None


class MessagesRequest(BaseModel):
    model_config = _BODY_CONFIG
    model: str | None = None
    max_tokens: int
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    stream: bool | None = None
    metadata: dict | None = None
    thinking: ThinkingConfig | None = None
    priority: int | None = None  # vLLM's extra field, as on chat
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extra field, as on chat

    def check_supported(self) -> None:
        refuse_unsupported(self, UNSUPPORTED_MESSAGES_FIELDS)
        thinking = self.thinking
        if thinking is None:
            return
        if thinking.type not in THINKING_TYPES:
            raise bad_request(
                f"thinking.type: {thinking.type!r} is not supported; this server takes "
                f"{', '.join(THINKING_TYPES)}",
                param="thinking",
            )
        if (thinking.type == "enabled") != (thinking.budget_tokens is not None):
            raise bad_request(
                "thinking.budget_tokens: required with type enabled (the most tokens the "
                'thinking may take), and only there; {"type": "adaptive"} thinks unbounded',
                param="thinking",
            )
        if thinking.display is not None and thinking.display not in THINKING_DISPLAYS:
            raise bad_request(
                f"thinking.display: must be one of {', '.join(THINKING_DISPLAYS)}, got "
                f"{thinking.display!r}",
                param="thinking",
            )

    @property
    def include_reasoning(self) -> bool | None:
        """Chat's include_reasoning. Display "omitted": Anthropic's thinking blocks then
        carry a signature alone, and this server has none to give: no blocks."""
        omitted = self.thinking is not None and self.thinking.display == "omitted"
        return False if omitted else None

    def chat_request(self, thinking_switch: str | None) -> ChatCompletionRequest:
        """The same request on the chat path (400s naming the Messages field).
        `thinking_switch`: the template variable that turns the model's thinking on and
        off (its reasoning parser's); None: the server reads no thinking, and `thinking`
        switches nothing (a budget is then refused, as on chat)."""
        thinking = self.thinking
        kwargs = self.chat_template_kwargs
        if thinking is not None and thinking_switch is not None:
            kwargs = (kwargs or {}) | {thinking_switch: thinking.type != "disabled"}
        messages = []
        if self.system:
            system = self.system
            text = system if isinstance(system, str) else "\n".join(b.text for b in system)
            messages.append(ChatMessage(role="system", content=text))
        for index, message in enumerate(self.messages):
            messages += _chat_messages(message, f"messages[{index}]")
        tool_choice, parallel = _chat_tool_choice(self.tool_choice)
        return ChatCompletionRequest(
            model=self.model,
            messages=messages,
            max_completion_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=self.stop_sequences,
            tools=_chat_tools(self.tools),
            tool_choice=tool_choice,
            parallel_tool_calls=parallel,
            priority=self.priority,
            chat_template_kwargs=kwargs,
            thinking_token_budget=thinking.budget_tokens if thinking else None,
            include_reasoning=self.include_reasoning,
        )


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: a Messages request without max_tokens."""

    max_tokens: int | None = None  # type: ignore[assignment]


def _chat_messages(message: Message, where: str) -> list[ChatMessage]:
    """One Messages turn -> chat messages: a user turn's tool results come first, as tool
    messages, then its text; an assistant turn's tool_use blocks are its tool calls."""
    if isinstance(message.content, str):
        return [ChatMessage(role=message.role, content=message.content)]
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCallMessage] = []
    results: list[ChatMessage] = []
    for position, block in enumerate(message.content):
        if isinstance(block, _OtherBlock):
            raise bad_request(
                f"{where}.content[{position}]: blocks of type {block.type!r} are not "
                "supported; this server reads text, tool_use and tool_result blocks",
                param="messages",
                code="unsupported_content",
            )
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thoughts.append(block.thinking or "")
        elif isinstance(block, ToolUseBlock):
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append(
                ToolCallMessage(
                    id=block.id, function=FunctionCall(name=block.name, arguments=arguments)
                )
            )
        elif isinstance(block, ToolResultBlock):
            content = block.content
            text = content if isinstance(content, str) else "\n".join(b.text for b in content)
            results.append(ChatMessage(role="tool", content=text, tool_call_id=block.tool_use_id))
    if message.role == "assistant":
        return [
            ChatMessage(
                role="assistant",
                content="\n".join(texts),
                tool_calls=calls or None,
                reasoning="".join(thoughts) or None,
            )
        ]
    return results + ([ChatMessage(role="user", content="\n".join(texts))] if texts else [])


def _chat_tools(tools: list[ToolDefinition] | None) -> list[Tool] | None:
    if tools is None:
        return None
    chat_tools = []
    for index, tool in enumerate(tools):
        if tool.type not in (None, "custom"):
            raise bad_request(
                f"tools[{index}]: server tools ({tool.type!r}) are not supported; this server "
                "calls client tools (name, description, input_schema) only",
                param="tools",
                code="unsupported_tool",
            )
        definition = FunctionDefinition(
            name=tool.name, description=tool.description, parameters=tool.input_schema
        )
        chat_tools.append(Tool(type="function", function=definition))
    return chat_tools


def _chat_tool_choice(choice: ToolChoice | None) -> tuple[str | NamedToolChoice | None, bool]:
    """Messages' tool_choice -> chat's, and whether parallel calls are allowed."""
    if choice is None:
        return None, True
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "tool":
        if not choice.name:
            raise bad_request('tool_choice: type "tool" needs a name', param="tool_choice")
        return NamedToolChoice(type="function", function=NamedFunction(name=choice.name)), False
    return {"any": "required"}.get(choice.type, choice.type), parallel


def messages_error(exc: APIError) -> APIError:
    """A chat-path error naming a chat field -> the same naming the Messages field."""
    message, param = exc.message, exc.param
    for chat, ours in CHAT_FIELDS.items():
        if message.startswith(chat):
            message = ours + message[len(chat) :]
        if param == chat:
            param = ours
    if (message, param) == (exc.message, exc.param):
        return exc
    return APIError(exc.status_code, message, exc.type, param, exc.code, exc.headers)


def error_body(exc: APIError) -> dict:
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""
    kind = ERROR_TYPES.get(exc.status_code, "api_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.status_code, headers=exc.headers)
