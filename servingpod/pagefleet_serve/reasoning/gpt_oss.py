"""gpt-oss (vLLM's `gpt_oss`): the output is harmony messages, `<|channel|>analysis<|message|>
...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>`, each marker one special
token. The analysis channel is the reasoning, the final channel (and a commentary without
a recipient, a preamble the user may see) the content; a message to `functions.NAME` is
a tool call, written into the content as `<|channel|>commentary to=functions.NAME<|message|>
{arguments}<|call|>` for the `openai` tool-call parser to read; a message to a built-in
tool (python, browser) is part of the reasoning. Headers are parsed as the `openai-harmony`
package parses them; several messages of one channel are joined with a line break, as
vLLM joins them. The prompt is harmony's own (`harmony.render`, the parser's
`prompt_renderer`), not the model's chat template."""

import re
from collections.abc import Mapping

from pagefleet_serve.reasoning import harmony
from pagefleet_serve.reasoning.base import (
    CONTENT,
    REASONING,
    Piece,
    ReasoningParser,
    ReasoningStream,
)
from pagefleet_serve.structured.thinking import ThinkingSpec

_CHANNEL = re.compile(re.escape(harmony.CHANNEL) + r"([^\s<]+)")
_RECIPIENT = re.compile(r"(?:^|\s)to=(\S+?)(?=\s|<|$)")
TOOL = "tool"  # a message to a function: content, as markup the tool-call parser reads


class GptOssReasoningParser(ReasoningParser):
    name = "gpt_oss"
    switch = "enable_thinking"  # read by `harmony.render`

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.ids = {
            marker: self.token_id(marker)
            for marker in (
                harmony.START,
                harmony.MESSAGE,
                harmony.END,
                harmony.CALL,
                harmony.RETURN,
                harmony.CHANNEL,
            )
        }
        self.prompt_renderer = harmony.render

    def thinking(
        self,
        prompt_token_ids: list[int],
        template_kwargs: Mapping[str, object],
        budget: int | None,
    ) -> ThinkingSpec | None:
        if prompt_token_ids[-1:] == [self.ids[harmony.MESSAGE]]:  # the final channel is open
            return None
        final = f"{harmony.CHANNEL}final{harmony.MESSAGE}"
        return ThinkingSpec(
            self.name,
            end=self.encode(final),
            forced_end=self.encode(f"{harmony.END}{harmony.START}assistant{final}"),
            budget=budget,
        )

    def stream(self, spec: ThinkingSpec) -> ReasoningStream:
        return HarmonyStream(self)


class HarmonyStream(ReasoningStream):
    """States: a header being read (its tokens kept), a message body (routed), and between
    messages (after `<|end|>`, waiting for `<|start|>`). The prompt ends in a header."""

    def __init__(self, parser: GptOssReasoningParser) -> None:
        super().__init__()
        self.parser = parser
        self.ids = parser.ids
        self.header: list[int] | None = []  # None: not in a header
        self.route: str | None = None  # the body's channel; None: between messages
        self.written: set[str] = set()  # channels a message has written text to

    def feed(self, token_id: int, text: str) -> list[Piece]:
        ids = self.ids
        if self.header is not None:
            if token_id != ids[harmony.MESSAGE]:
                self.header.append(token_id)
                return []
            return self._open(self.header + [token_id])
        if self.route is None:  # between messages
            if token_id == ids[harmony.START]:
                self.header = [token_id]
                return []
            return [(CONTENT, text)] if text else []  # not harmony: the model's text
        route = self.route
        if route == REASONING:
            self.num_reasoning_tokens += 1
        if token_id in (ids[harmony.END], ids[harmony.CALL], ids[harmony.RETURN]):
            self.route = None
            return [(CONTENT, harmony.CALL)] if route == TOOL else []
        if not text:
            return []
        self.written.add(route)
        return [(CONTENT if route == TOOL else route, text)]

    def _open(self, header_ids: list[int]) -> list[Piece]:
        """A header is whole: where its body goes (its tokens count as that body's)."""
        self.header = None
        header = self.parser.tokenizer.decode(header_ids, skip_special_tokens=False)
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header.replace(harmony.CHANNEL, " "))
        name = channel.group(1) if channel else None
        to = recipient.group(1) if recipient else None
        if to is not None and to.startswith("functions."):
            self.route = TOOL
            markup = f"{harmony.CHANNEL}commentary to={to}{harmony.MESSAGE}"
            return [(CONTENT, markup)]
        self.route = CONTENT if to is None and name in ("final", "commentary") else REASONING
        if self.route == REASONING:
            self.num_reasoning_tokens += len(header_ids)
        if self.route in self.written:  # a second message of the channel: a new line
            return [(self.route, "\n")]
        return []
