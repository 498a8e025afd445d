"""DeepSeek-R1 and its distills (vLLM's `deepseek_r1`): the reasoning starts before any
tag, since the model often leaves out `<think>`; everything up to `</think>` is thinking
unless the prompt has closed it (DeepSeek-V3.1 with `thinking` off)."""

from pagefleet_serve.reasoning.think_tags import ThinkTagParser


class DeepSeekR1ReasoningParser(ThinkTagParser):
    name = "deepseek_r1"
    switch = "thinking"  # DeepSeek-V3.1's template
    opens_unmarked = True
