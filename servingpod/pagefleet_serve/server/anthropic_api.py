"""/v1/messages and /v1/messages/count_tokens, Anthropic's Messages API, on the chat path.

A request's system prompt, messages, tools and tool_choice become their chat forms
(`anthropic_protocol`), then `ChatCompletionsEndpoint` templates, bounds, constrains and
runs it as it runs a chat completion (same limits, errors, metrics and traces, and for a
reasoning model the same parser, template switch and thinking budget); only the output
is written Anthropic's way: content blocks (`thinking`, then `text` or `tool_use`),
`stop_reason`, usage, and in a stream Anthropic's events (`message_start`,
`content_block_start` / `_delta` / `_stop`, `message_delta`, `message_stop`).
count_tokens runs the same validation and template and answers the prompt's length.
Errors are Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`, app.py
renders them for these paths).
"""

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagefleet_serve.outputs import CompletionOutput
from pagefleet_serve.server.anthropic_protocol import (
    CountTokensRequest,
    MessagesRequest,
    error_body,
    messages_error,
)
from pagefleet_serve.server.errors import APIError, server_error, unavailable
from pagefleet_serve.server.generation import RequestCancelled, RequestFailed
from pagefleet_serve.server.openai_api import (
    ChatCompletionsEndpoint,
    _Input,
    _Run,
    read_json_body,
)
from pagefleet_serve.server.tools import ToolPlan, answer_deltas, answer_stream, split_output

# Anthropic's names for why a turn ended.
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "abort": "end_turn"}
# A stream's keep-alive is Anthropic's ping event.
PING = 'event: ping\ndata: {"type": "ping"}\n\n'
# Anthropic signs a thinking block so that its API can tell its own model's thinking when
# a client sends it back; this server signs nothing (the signature is empty) and reads the
# thinking blocks it is sent as they are.
SIGNATURE = ""


def _event(kind: str, **fields) -> str:
    data = json.dumps({"type": kind, **fields}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n"


class MessagesEndpoint(ChatCompletionsEndpoint):
    request_model = MessagesRequest  # type: ignore[assignment]
    id_prefix = "msg_"
    object_name = "message"
    prompt_param = "messages"

    def prepare(self, request: MessagesRequest) -> _Input:  # type: ignore[override]
        parser = self.state.reasoning_parser
        try:
            return super().prepare(request.chat_request(parser.switch if parser else None))
        except APIError as exc:
            raise messages_error(exc) from None

    # -- output ------------------------------------------------------------------------------
    def response_body(self, run: _Run, choices: list[CompletionOutput]) -> dict:
        [choice] = choices
        content, calls = split_output(run.tools, choice.text) if run.tools else (choice.text, [])
        blocks = []
        if choice.reasoning and run.shows_reasoning:
            blocks.append(_thinking(choice.reasoning))
        if content or not calls:
            blocks.append({"type": "text", "text": content})
        blocks += [_tool_use(c.id, c.name, c.arguments) for c in calls]
        stop_reason = _stop_reason(choice.finish_reason, choice.stop_reason, calls)
        body = self._message(run, blocks, stop_reason, choice.stop_reason)
        body["usage"]["output_tokens"] = len(choice.token_ids)
        return body

    async def _stream(self, run: _Run) -> AsyncIterator[str]:
        writer = _BlockWriter(run.tools, run.shows_reasoning)
        yield _event("message_start", message=self._message(run, [], None))
        output_tokens = 0
        try:
            async for delta in self.stream_deltas(run):
                if delta is None:
                    yield PING
                    continue
                output_tokens += len(delta.token_ids)
                writer.stop_sequence = delta.stop_reason or writer.stop_sequence
                for kind, fields in writer.feed(delta.text, delta.finish_reason, delta.reasoning):
                    yield _event(kind, **fields)
            for kind, fields in writer.finish():
                yield _event(kind, **fields)
        except RequestFailed as exc:
            yield _event("error", error=error_body(server_error(str(exc)))["error"])
            return
        except RequestCancelled as exc:
            cancelled = unavailable(str(exc), code="server_shutting_down")
            yield _event("error", error=error_body(cancelled)["error"])
            return
        stop = {"stop_reason": writer.stop_reason, "stop_sequence": writer.stop_sequence}
        yield _event("message_delta", delta=stop, usage={"output_tokens": output_tokens})
        yield _event("message_stop")

    def _message(
        self,
        run: _Run,
        content: list[dict],
        stop_reason: str | None,
        stop_sequence: str | None = None,
    ) -> dict:
        return {
            "id": run.id,
            "type": "message",
            "role": "assistant",
            "model": run.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": {
                "input_tokens": run.generation.num_prompt_tokens,
                "output_tokens": 0,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": run.generation.num_cached_tokens,
            },
        }


class CountTokensEndpoint(MessagesEndpoint):
    """POST /v1/messages/count_tokens: the prompt's length in tokens, as /v1/messages would
    template it (its tools included), validated as a request is; nothing is generated."""

    request_model = CountTokensRequest  # type: ignore[assignment]

    def prepare(self, request: MessagesRequest) -> _Input:  # type: ignore[override]
        prepared = super().prepare(request)
        # Nothing is generated: a forced tool call's grammar is not compiled.
        prepared.params = replace(prepared.params, structured_outputs=None)
        return prepared

    async def __call__(self, raw: Request) -> Response:
        body = await read_json_body(raw, self.state.settings.max_request_body_bytes)
        _, processed, _ = await self.state.off_loop(
            lambda: self._validate(body, f"{self.id_prefix}{uuid.uuid4().hex}")
        )
        [engine_request] = processed.requests
        return JSONResponse({"input_tokens": len(engine_request.prompt_token_ids)})


class _BlockWriter:
    """One streamed message's content blocks as Anthropic's events: a reasoning model's
    thinking goes into a thinking block (`thinking_delta`s, then its `signature_delta`),
    text into a text block, each tool call (as `ToolCallStream` finds them) into a
    tool_use block whose input comes as JSON fragments; a block ends where the next
    begins, the last at the end."""

    def __init__(self, tools: ToolPlan | None, shows_reasoning: bool) -> None:
        self.calls = answer_stream(tools)
        self.shows_reasoning = shows_reasoning
        self.open: tuple[int, str] | None = None  # (block index, "thinking" | "text" | call)
        self.count = 0  # blocks begun
        self.answered = False  # a text or tool_use block was begun
        self.finish_reason: str | None = None
        self.stop_sequence: str | None = None  # the stop sequence that ended the text

    @property
    def stop_reason(self) -> str:
        calls = self.calls.sent_calls if self.calls is not None else []
        return _stop_reason(self.finish_reason, self.stop_sequence, calls)

    def feed(
        self, text: str, finish_reason: str | None, reasoning: str = ""
    ) -> Iterator[tuple[str, dict]]:
        self.finish_reason = finish_reason or self.finish_reason
        if reasoning and self.shows_reasoning:
            yield from self._begin("thinking", _thinking(""))
            piece = {"type": "thinking_delta", "thinking": reasoning}
            yield "content_block_delta", {"index": self.open[0], "delta": piece}
        for delta in answer_deltas(self.calls, text, finish_reason is not None):
            if delta.get("content"):
                yield from self._begin("text", {"type": "text", "text": ""})
                piece = {"type": "text_delta", "text": delta["content"]}
                yield "content_block_delta", {"index": self.open[0], "delta": piece}
            for call in delta.get("tool_calls", ()):
                function = call.get("function", {})
                if "id" in call:  # a call begins: its name is whole
                    block = _tool_use(call["id"], function["name"], None)
                    yield from self._begin(f"call {call['index']}", block)
                if function.get("arguments"):
                    piece = {"type": "input_json_delta", "partial_json": function["arguments"]}
                    yield "content_block_delta", {"index": self.open[0], "delta": piece}

    def finish(self) -> Iterator[tuple[str, dict]]:
        if not self.answered:  # no text, no calls: an empty text block, as the whole response
            yield from self._begin("text", {"type": "text", "text": ""})
        yield from self._stop()

    def _begin(self, what: str, block: dict) -> Iterator[tuple[str, dict]]:
        if self.open is not None and self.open[1] == what:
            return
        yield from self._stop()
        self.answered = self.answered or what != "thinking"
        self.open = (self.count, what)
        self.count += 1
        yield "content_block_start", {"index": self.open[0], "content_block": block}

    def _stop(self) -> Iterator[tuple[str, dict]]:
        if self.open is None:
            return
        index, what = self.open
        if what == "thinking":  # Anthropic's stream gives a thinking block's signature last
            piece = {"type": "signature_delta", "signature": SIGNATURE}
            yield "content_block_delta", {"index": index, "delta": piece}
        yield "content_block_stop", {"index": index}
        self.open = None


def _thinking(text: str) -> dict:
    return {"type": "thinking", "thinking": text, "signature": SIGNATURE}


def _tool_use(call_id: str, name: str, arguments: str | None) -> dict:
    """A tool_use block; `arguments` None: one being streamed (its input comes in deltas).
    A call cut short by max_tokens has arguments that do not parse: its input is {}."""
    try:
        tool_input = json.loads(arguments) if arguments is not None else {}
    except ValueError:
        tool_input = {}
    return {"type": "tool_use", "id": call_id, "name": name, "input": tool_input}


def _stop_reason(finish_reason: str | None, stop_sequence: str | None, calls: list) -> str:
    if calls and finish_reason == "stop":
        return "tool_use"
    if stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(finish_reason or "stop", "end_turn")
