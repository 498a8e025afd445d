"""Qwen3, Qwen3.5 and Qwen3-Next (vLLM's `qwen3`): thinking is on unless the template is
told `enable_thinking: false`, which closes it in the prompt. Templates up to Qwen3-2507
leave the model to write `<think>` itself, so without a tag in the prompt the output
thinks only if it opens with `<think>` (a Qwen3 Instruct model that never thinks keeps
its whole answer as content)."""

from pagefleet_serve.reasoning.think_tags import ThinkTagParser


class Qwen3ReasoningParser(ThinkTagParser):
    name = "qwen3"
    switch = "enable_thinking"
    opens_unmarked = False
