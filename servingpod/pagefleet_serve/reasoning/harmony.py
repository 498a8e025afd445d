"""A chat conversation as gpt-oss's harmony prompt, written the way the `openai-harmony`
package renders it for completion (`render_conversation_for_completion`, auto-dropping
analysis): a system message (identity, knowledge cutoff, date, `Reasoning: {effort}`,
the valid channels), a developer message (the request's system and developer text as
`# Instructions`, its function tools as a `functions` namespace), the turns (an
assistant's `reasoning` as an analysis message, its tool calls as commentary messages to
`functions.NAME`, its text as a final message; a tool's result from `functions.NAME` to
the assistant), then `<|start|>assistant` for the model to go on. With thinking switched
off (`enable_thinking: false`) the prompt opens the final channel itself, as vLLM does.

Text, not token ids: the model's tokenizer tokenizes it like any rendered template (its
special tokens are whole tokens of the text)."""

import datetime
import json
from collections.abc import Mapping

from pagefleet_serve.reasoning.harmony_schema import typescript

IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
EFFORTS = ("low", "medium", "high")
CHANNELS = ("analysis", "commentary", "final")
START, MESSAGE, END, CALL, RETURN = "<|start|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>"
CHANNEL, CONSTRAIN = "<|channel|>", "<|constrain|>"


def render(
    messages: list[dict], tools: list[dict] | None, template_kwargs: Mapping[str, object]
) -> str:
    """`messages` as the chat template gets them (role, content, tool_calls with arguments
    as objects, tool_call_id, reasoning); `tools` OpenAI's function tools; template kwargs
    `reasoning_effort` (low, medium, high; default medium), `enable_thinking`,
    `current_date` (default: today, UTC). ValueError naming the field that is wrong."""
    effort = template_kwargs.get("reasoning_effort") or "medium"
    if effort not in EFFORTS:
        raise ValueError(f"reasoning_effort: must be one of {', '.join(EFFORTS)}, got {effort!r}")
    date = template_kwargs.get("current_date") or datetime.datetime.now(
        datetime.timezone.utc
    ).strftime("%Y-%m-%d")
    functions = [t["function"] for t in tools or []]
    turns = _turns(messages)
    instructions = [m["content"] for m in messages if m["role"] in ("system", "developer")]
    header = [_message("system", _system(str(effort), str(date), bool(functions)))]
    if instructions or functions:
        header.append(_message("developer", _developer("\n\n".join(instructions), functions)))
    prompt = "".join(header + _dropping_analysis(turns)) + START + "assistant"
    if template_kwargs.get("enable_thinking") is False:
        prompt += f"{CHANNEL}final{MESSAGE}"
    return prompt


def _system(effort: str, date: str, has_functions: bool) -> str:
    channels = (
        f"# Valid channels: {', '.join(CHANNELS)}. Channel must be included for every message."
    )
    if has_functions:
        channels += "\nCalls to these tools must go to the commentary channel: 'functions'."
    top = f"{IDENTITY}\nKnowledge cutoff: {KNOWLEDGE_CUTOFF}\nCurrent date: {date}"
    return "\n\n".join([top, f"Reasoning: {effort}", channels])


def _developer(instructions: str, functions: list[dict]) -> str:
    sections = ["# Instructions", instructions] if instructions else []
    if functions:
        lines = ["## functions\n", "namespace functions {\n"]
        for function in functions:
            lines += [f"// {line}" for line in (function.get("description") or "").splitlines()]
            parameters = function.get("parameters")
            signature = f"(_: {typescript(parameters)})" if parameters is not None else "()"
            lines.append(f"type {function['name']} = {signature} => any;\n")
        lines.append("} // namespace functions")
        sections += ["# Tools", "\n".join(lines)]
    return "\n\n".join(sections)


def _turns(messages: list[dict]) -> list[tuple[str | None, str]]:
    """The conversation's messages after the instructions, as (channel, rendered text):
    the channel decides which analysis messages are dropped."""
    names = {
        call["id"]: call["function"]["name"] for m in messages for call in m.get("tool_calls") or ()
    }
    turns: list[tuple[str | None, str]] = []
    for m in messages:
        role = m["role"]
        if role == "user":
            turns.append((None, _message("user", m["content"])))
        elif role == "tool":
            author = f"functions.{names.get(m.get('tool_call_id'), m.get('name') or '')}"
            text = _message(author, m["content"], "commentary", recipient="assistant")
            turns.append(("commentary", text))
        elif role == "assistant":
            turns += _assistant(m)
    return turns


def _assistant(m: dict) -> list[tuple[str | None, str]]:
    turns: list[tuple[str | None, str]] = []
    calls = m.get("tool_calls") or []
    if m.get("content") and calls:  # a preamble to its calls
        turns.append(("commentary", _message("assistant", m["content"], "commentary")))
    reasoning = m.get("reasoning") or m.get("reasoning_content")
    if reasoning:
        turns.append(("analysis", _message("assistant", reasoning, "analysis")))
    for call in calls:
        arguments = call["function"]["arguments"]
        text = _message(
            "assistant",
            arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False),
            "commentary",
            recipient=f"functions.{call['function']['name']}",
            content_type=f"{CONSTRAIN}json",
        )
        turns.append(("commentary", text))
    if m.get("content") and not calls:
        turns.append(("final", _message("assistant", m["content"], "final")))
    return turns


def _dropping_analysis(turns: list[tuple[str | None, str]]) -> list[str]:
    """The reference's auto-drop: when the last assistant message is a final answer, the
    analysis messages before the first final one are left out."""
    assistant = [c for c, text in turns if text.startswith(f"{START}assistant")]
    finals = [i for i, (c, _) in enumerate(turns) if c == "final"]
    drop = bool(assistant) and assistant[-1] == "final" and bool(finals)
    return [t for i, (c, t) in enumerate(turns) if not (drop and c == "analysis" and i < finals[0])]


def _message(
    author: str,
    content: str,
    channel: str | None = None,
    recipient: str | None = None,
    content_type: str | None = None,
) -> str:
    header = author + (f" to={recipient}" if recipient else "")
    header += f"{CHANNEL}{channel}" if channel else ""
    header += f" {content_type}" if content_type else ""
    end = CALL if author == "assistant" and recipient else END
    return f"{START}{header}{MESSAGE}{content}{end}"
