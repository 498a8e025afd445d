"""What a /v1/responses response is made of, as items (a reasoning item, a message with
its `output_text`, function calls) and, for a stream, as the Responses events that write
them one after the other (`OutputWriter`), each item opened, filled and closed."""

import uuid
from collections.abc import Iterator

from pagefleet_serve.server.tools import ToolPlan, answer_deltas, answer_stream


class OutputWriter:
    """One streamed response's output items as Responses events: a reasoning model's
    thinking goes into a reasoning item first (`response.reasoning_text.delta`), text into
    a message item, each tool call (as `ToolCallStream` finds them) into a function_call
    item whose arguments come in fragments; the thinking ends where the answer begins, a
    message where a call begins, everything at the end."""

    def __init__(self, tools: ToolPlan | None, shows_reasoning: bool = False) -> None:
        self.calls = answer_stream(tools)
        self.shows_reasoning = shows_reasoning
        self.thought: int | None = None  # the index of the reasoning item being written
        self.answered = False  # a message or call item was opened
        self.output: list[dict] = []
        self.open: set[int] = set()  # output indices not yet done
        self.message: int | None = None  # the index of the message being written
        self.by_call: dict[int, int] = {}  # tool call index -> output index
        self.status = "completed"
        self.logprobs: list[dict] = []  # the tokens' logprobs not yet sent with text

    def items(self) -> list[dict]:
        return [dict(item) for item in self.output]

    def feed(
        self, text: str, finish_reason: str | None, reasoning: str = ""
    ) -> Iterator[tuple[str, dict]]:
        if finish_reason is not None:
            self.status = status_of(finish_reason)
        if reasoning and self.shows_reasoning:
            yield from self._reasoning(reasoning)
        for delta in answer_deltas(self.calls, text, finish_reason is not None):
            if delta.get("content"):
                yield from self._text(delta["content"])
            for call in delta.get("tool_calls", ()):
                yield from self._call(call)

    def finish(self) -> Iterator[tuple[str, dict]]:
        if not self.answered:  # no text, no calls: an empty message, as the whole response
            yield from self._open_message()
        for index in sorted(self.open):
            yield from self._close(index)

    def _text(self, text: str) -> Iterator[tuple[str, dict]]:
        if self.message is None:
            yield from self._open_message()
        assert self.message is not None
        item = self.output[self.message]
        item["content"][0]["text"] += text
        logprobs, self.logprobs = self.logprobs, []
        item["content"][0]["logprobs"] += logprobs
        yield (
            "response.output_text.delta",
            self._where(self.message) | {"content_index": 0, "delta": text, "logprobs": logprobs},
        )

    def _reasoning(self, text: str) -> Iterator[tuple[str, dict]]:
        if self.thought is None:
            self.thought = self._add(reasoning_item(new_id("rs"), "", "in_progress"))
            item = self.output[self.thought] | {"content": []}
            yield "response.output_item.added", {"output_index": self.thought, "item": item}
            part = {"content_index": 0, "part": {"type": "reasoning_text", "text": ""}}
            yield "response.content_part.added", self._where(self.thought) | part
        self.output[self.thought]["content"][0]["text"] += text
        delta = {"content_index": 0, "delta": text}
        yield "response.reasoning_text.delta", self._where(self.thought) | delta

    def _answer(self) -> Iterator[tuple[str, dict]]:
        """The answer begins: the thinking is over."""
        self.answered = True
        if self.thought is not None and self.thought in self.open:
            yield from self._close(self.thought)

    def _open_message(self) -> Iterator[tuple[str, dict]]:
        yield from self._answer()
        index = self._add(message_item(new_id("msg"), "", "in_progress"))
        self.message = index
        yield (
            "response.output_item.added",
            {
                "output_index": index,
                "item": message_item(self.output[index]["id"], "", "in_progress", parts=False),
            },
        )
        yield (
            "response.content_part.added",
            self._where(index)
            | {
                "content_index": 0,
                "part": text_part(""),
            },
        )

    def _call(self, call: dict) -> Iterator[tuple[str, dict]]:
        function = call.get("function", {})
        if "id" in call:  # a call begins: its name is whole
            yield from self._answer()
            if self.message is not None:
                yield from self._close(self.message)
            item = function_call_item(new_id("fc"), call["id"], function["name"], "", "in_progress")
            index = self._add(item)
            self.by_call[call["index"]] = index
            yield "response.output_item.added", {"output_index": index, "item": dict(item)}
        piece = function.get("arguments", "")
        if piece:
            index = self.by_call[call["index"]]
            self.output[index]["arguments"] += piece
            yield "response.function_call_arguments.delta", self._where(index) | {"delta": piece}

    def _close(self, index: int) -> Iterator[tuple[str, dict]]:
        self.open.discard(index)
        item = self.output[index]
        if item["type"] == "message":
            self.message = None
            part = item["content"][0]
            where = self._where(index) | {"content_index": 0}
            yield (
                "response.output_text.done",
                where | {"text": part["text"], "logprobs": part["logprobs"]},
            )
            yield "response.content_part.done", where | {"part": dict(part)}
            item["status"] = self.status
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            where = self._where(index) | {"content_index": 0}
            yield "response.reasoning_text.done", where | {"text": text}
            part = {"type": "reasoning_text", "text": text}
            yield "response.content_part.done", where | {"part": part}
            item["status"] = "completed"
        else:
            done = self._where(index) | {"arguments": item["arguments"]}
            yield "response.function_call_arguments.done", done
            item["status"] = "completed" if self.status == "completed" else "incomplete"
        yield "response.output_item.done", {"output_index": index, "item": dict(item)}

    def _add(self, item: dict) -> int:
        self.output.append(item)
        self.open.add(len(self.output) - 1)
        return len(self.output) - 1

    def _where(self, index: int) -> dict:
        return {"item_id": self.output[index]["id"], "output_index": index}


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def text_part(text: str, logprobs: list[dict] | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(
    item_id: str, text: str, status: str, logprobs: list[dict] | None = None, parts: bool = True
) -> dict:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [text_part(text, logprobs)] if parts else [],
    }


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "encrypted_content": None,
        "status": status,
    }


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }
