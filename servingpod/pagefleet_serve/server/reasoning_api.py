"""What the OpenAI endpoints do for a reasoning model, in one place the chat, Responses and
tokenizer endpoints call: the request's `chat_template_kwargs` (bounded, JSON values only,
the server's own template arguments refused by name) with its `reasoning_effort`; the
prompt, through the model's chat template or the parser's own renderer (harmony for
gpt-oss); where the thinking ends (`thinking`, with `thinking_token_budget`); and the
fields an answer carries (`reasoning` and its older name `reasoning_content`, the
reasoning tokens in the usage).

The parser is the frontend's, chosen by the server (`--reasoning-parser`, or the one the
model's tokenizer and template point to); a model without one thinks nothing the server knows of, so asking
for a budget is refused rather than ignored.
"""

import json
from collections.abc import Mapping

from pagefleet_serve.frontend.input_processor import ChatPromptError, InputProcessor
from pagefleet_serve.server.errors import bad_request
from pagefleet_serve.structured.thinking import ThinkingSpec

MAX_TEMPLATE_KWARGS = 32
MAX_TEMPLATE_KWARGS_CHARS = 16 * 1024
# Arguments of `apply_chat_template` the server sets itself: a request may not.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def template_kwargs(
    kwargs: dict | None, reasoning_effort: str | None, param: str = "chat_template_kwargs"
) -> dict:
    """The variables the chat template gets beside the messages; `reasoning_effort` (the
    request's own field) wins over a key of the same name. 400s naming `param`."""
    kwargs = dict(kwargs or {})
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise bad_request(
            f"{param}: at most {MAX_TEMPLATE_KWARGS} keys, got {len(kwargs)}", param=param
        )
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise bad_request(
                f"{param}.{key}: the server sets {key} itself; remove it from {param}",
                param=param,
            )
    size = len(json.dumps(kwargs, ensure_ascii=False))
    if size > MAX_TEMPLATE_KWARGS_CHARS:
        raise bad_request(
            f"{param}: {size} characters of JSON; at most {MAX_TEMPLATE_KWARGS_CHARS} are read",
            param=param,
        )
    if reasoning_effort is not None:
        kwargs["reasoning_effort"] = reasoning_effort
    return kwargs


def render_prompt(
    inputs: InputProcessor,
    messages: list[dict],
    tools: list[dict] | None,
    kwargs: Mapping[str, object],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """The prompt text, as the frontend renders it (the reasoning parser's own renderer
    where it has one, else the model's chat template with `kwargs`); a 400 naming the
    field at fault."""
    try:
        return inputs.render_chat(
            messages, tools, add_generation_prompt, continue_final_message, kwargs
        )
    except ChatPromptError as exc:
        raise bad_request(str(exc), param=exc.param) from None


def thinking(
    inputs: InputProcessor,
    prompt_token_ids: list[int],
    kwargs: Mapping[str, object],
    budget: int | None,
) -> ThinkingSpec | None:
    """Where the request's thinking ends, for the engine core (the frontend reads it);
    None: it does not think."""
    try:
        return inputs.thinking(prompt_token_ids, kwargs, budget)
    except ChatPromptError as exc:
        raise bad_request(str(exc), param=exc.param) from None


def reasoning_fields(text: str | None) -> dict:
    """A message's or delta's thinking, by vLLM's two names (clients read either)."""
    return {"reasoning": text, "reasoning_content": text}
