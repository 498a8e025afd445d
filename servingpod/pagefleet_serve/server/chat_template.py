"""Chat messages (the API's models) -> the template's message dicts, which the frontend's
`InputProcessor.render_chat` renders as transformers' `apply_chat_template` renders them
(or a reasoning parser's own renderer): tool definitions go in as `tools=`, assistant turns
keep their `tool_calls` (arguments as objects, as templates expect them) and tool results
keep their `tool_call_id`. A template that does not mention tools (SmolLM2's) leaves them
out, as it does under transformers and vLLM."""

import json

from pagefleet_serve.server.errors import bad_request
from pagefleet_serve.server.protocol import ChatMessage


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    return [_template_message(i, m) for i, m in enumerate(messages)]


def _template_message(index: int, message: ChatMessage) -> dict:
    out = {
        "role": "system" if message.role == "developer" else message.role,
        "content": _content(message),
    }
    if message.name:
        out["name"] = message.name
    reasoning = message.reasoning or message.reasoning_content
    if reasoning:  # templates read either name: Qwen3's reasoning_content, vLLM's reasoning
        out["reasoning"] = out["reasoning_content"] = reasoning
    if message.role == "tool":
        if not message.tool_call_id:
            raise bad_request(
                f"messages[{index}].tool_call_id: a tool message must name the call it answers",
                param="messages",
            )
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        if message.role != "assistant":
            raise bad_request(
                f"messages[{index}].tool_calls: only assistant messages carry tool calls",
                param="messages",
            )
        out["tool_calls"] = [_template_call(index, j, c) for j, c in enumerate(message.tool_calls)]
    return out


def _content(message: ChatMessage) -> str | list[dict]:
    """A message's text; one with images as the content parts templates read (an image
    is `{"type": "image"}` where it stood, its pixels travel beside the prompt)."""
    if isinstance(message.content, str) or not any(
        part.type == "image_url" for part in message.content or ()
    ):
        return message.text()
    return [
        {"type": "image"} if part.type == "image_url" else {"type": "text", "text": part.text}
        for part in message.content or ()
    ]


def content_chars(messages: list[dict]) -> int:
    """The characters of the messages' text (their images not counted)."""
    return sum(
        len(m["content"])
        if isinstance(m["content"], str)
        else sum(len(part.get("text") or "") for part in m["content"])
        for m in messages
    )


def _template_call(index: int, position: int, call) -> dict:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        raise bad_request(
            f"messages[{index}].tool_calls[{position}].function.arguments: not valid JSON",
            param="messages",
        ) from None
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }
