"""Reasoning parsers, by the names vLLM gives them (`--reasoning-parser`), and the choice
of one for a model that names none: by what its tokenizer and chat template carry, since
the frontend sees the tokenizer, not the weights (harmony's special tokens: gpt_oss;
Granite's thinking phrase in the template: granite; `<think>` and `</think>` tokens with
a template that writes them: deepseek_r1 for DeepSeek's template, else qwen3)."""

import logging

from pagefleet_serve.reasoning.base import (
    CONTENT,
    REASONING,
    ReasoningParser,
    ReasoningStream,
)
from pagefleet_serve.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from pagefleet_serve.reasoning.gpt_oss import GptOssReasoningParser
from pagefleet_serve.reasoning.granite import THOUGHT_STARTS, GraniteReasoningParser
from pagefleet_serve.reasoning.qwen3 import Qwen3ReasoningParser
from pagefleet_serve.reasoning.think_tags import END, START

logger = logging.getLogger(__name__)

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser
    for parser in (
        Qwen3ReasoningParser,
        DeepSeekR1ReasoningParser,
        GptOssReasoningParser,
        GraniteReasoningParser,
    )
}
NONE = "none"  # `--reasoning-parser none`: no parser, whatever the model
# DeepSeek's chat templates name the assistant with this token (full-width bars).
_DEEPSEEK_ASSISTANT = "<\uff5cAssistant\uff5c>"


def reasoning_parser(name: str | None, tokenizer) -> ReasoningParser | None:
    """The parser `--reasoning-parser` names (None: the model's family's, chosen and
    logged; "none": no parser). ValueError naming the flag when the name is unknown or the
    tokenizer lacks the parser's markers."""
    if name == NONE or tokenizer is None:
        return None
    if name is None:
        name = family_parser(tokenizer)
        if name is None:
            return None
        logger.info("reasoning parser %s (chosen by the model's tokenizer and template)", name)
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"--reasoning-parser: unknown parser {name!r}; known: "
            f"{', '.join([*REASONING_PARSERS, NONE])}"
        )
    return REASONING_PARSERS[name](tokenizer)


def family_parser(tokenizer) -> str | None:
    vocab = tokenizer.get_vocab()
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else ""
    if all(t in vocab for t in ("<|channel|>", "<|message|>", "<|start|>", "<|end|>")):
        return GptOssReasoningParser.name
    if any(phrase in template for phrase in THOUGHT_STARTS):
        return GraniteReasoningParser.name
    if START in vocab and END in vocab and END in template:
        if _DEEPSEEK_ASSISTANT in template:
            return DeepSeekR1ReasoningParser.name
        return Qwen3ReasoningParser.name
    return None


__all__ = [
    "CONTENT",
    "REASONING",
    "REASONING_PARSERS",
    "ReasoningParser",
    "ReasoningStream",
    "family_parser",
    "reasoning_parser",
]
