"""Tool-call parsers, by the names vLLM gives them (`--tool-call-parser`)."""

from pagefleet_serve.server.tool_parsers.base import ToolCall, ToolParser
from pagefleet_serve.server.tool_parsers.hermes import HermesToolParser
from pagefleet_serve.server.tool_parsers.llama3_json import Llama3JsonToolParser
from pagefleet_serve.server.tool_parsers.mistral import MistralToolParser
from pagefleet_serve.server.tool_parsers.openai import OpenAIToolParser

TOOL_CALL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "openai": OpenAIToolParser,
}

__all__ = ["TOOL_CALL_PARSERS", "ToolCall", "ToolParser"]
