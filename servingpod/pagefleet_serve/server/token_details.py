"""Token-level details that vLLM's clients ask for beyond OpenAI's fields, in vLLM's
shapes: the prompt echoed with its logprobs (completions `echo`: how lm-evaluation-harness
scores loglikelihood tasks, `echo` + `logprobs` + `max_tokens: 0`), each prompt token's
logprobs (`prompt_logprobs`), token ids beside the text (`return_token_ids`) and tokens
named by their ids (`return_tokens_as_token_ids`).

The engine scores the prompt (engine/model_runner.py); here its entries and the sampled
tokens' become JSON. A logprob of -inf is written as -9999.0, as OpenAI does (JSON has no
infinity).
"""

from collections.abc import Callable
from dataclasses import dataclass

from pagefleet_serve.outputs import CompletionOutput, TokenLogprob

MIN_LOGPROB = -9999.0


@dataclass(frozen=True)
class TokenLabels:
    """How a token is named in logprobs: its text, or "token_id:<id>" (vLLM's
    return_tokens_as_token_ids, for tokens whose text is not valid UTF-8 alone)."""

    token_text: Callable[[int], str]
    as_ids: bool = False

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.token_text(token_id)


def prompt_fields(
    request, prompt_token_ids: list[int], entries: list | None, label: TokenLabels
) -> dict:
    """What a response (chat) or a choice's first entry (completions) carries of its
    prompt where the request asked: `prompt_logprobs`, `prompt_token_ids`."""
    fields: dict = {}
    if request.prompt_logprobs is not None and entries is not None:
        fields["prompt_logprobs"] = prompt_logprobs_body(prompt_token_ids, entries, label)
    if request.return_token_ids:
        fields["prompt_token_ids"] = prompt_token_ids
    return fields


def without_generation(choice: CompletionOutput) -> CompletionOutput:
    """A choice of completions' echo with max_tokens 0: vLLM runs one token and drops it."""
    logprobs = None if choice.logprobs is None else []
    return CompletionOutput(choice.index, logprobs=logprobs, finish_reason=choice.finish_reason)


def logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def completion_logprobs(
    tokens: list[tuple[int, TokenLogprob | None]], label: TokenLabels, offset: int
) -> tuple[dict, int]:
    """The completions API's logprobs block for (token id, entry) pairs, text offsets
    counted from `offset`; and the offset after them. An entry None (the prompt's first
    token, which nothing scores) has null logprobs. Each `top_logprobs` holds the token
    itself first, then the top ones (with logprobs 0, the token alone)."""
    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for token_id, entry in tokens:
        text = label(token_id)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(logprob(entry.logprob))
        ranked = [(entry.token_id, entry.logprob), *entry.top_logprobs]
        out["top_logprobs"].append({label(t): logprob(lp) for t, lp in ranked})
    return out, offset


def prompt_logprobs_body(
    prompt_token_ids: list[int], entries: list[TokenLogprob | None], label: TokenLabels
) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token, null (the first) or {token id: {logprob,
    rank, decoded_token}} for the token itself and the top ones (rank 1 the likeliest; the
    prompt token's own rank is given where it is among them, else null)."""
    body: list[dict | None] = []
    for token_id, entry in zip(prompt_token_ids, entries, strict=True):
        if entry is None:
            body.append(None)
            continue
        ranks = {t: rank for rank, (t, _) in enumerate(entry.top_logprobs, start=1)}
        ranked = {token_id: entry.logprob} | dict(entry.top_logprobs)
        body.append(
            {
                str(t): {"logprob": logprob(lp), "rank": ranks.get(t), "decoded_token": label(t)}
                for t, lp in ranked.items()
            }
        )
    return body
