"""Benchmark prompts whose token counts are exact under the model's own tokenizer.

Three datasets, as `vllm bench serve` names them: `random` (random token ids turned into
text), `sharegpt` (the first human turn and the first model turn of each conversation in a
local ShareGPT-format JSON file) and `prefix-repetition` (a few shared prefixes, each
followed by a random suffix). For the chat endpoint the count includes the chat template,
so `prompt_len` is what the server prefills.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

DATASETS = ("random", "sharegpt", "prefix-repetition")
_FIT_ATTEMPTS = 8


@dataclass(frozen=True)
class SampleRequest:
    prompt: str  # completions: the whole prompt; chat: the user message
    prompt_len: int  # tokens the server prefills (chat: after its template)
    expected_output_len: int
    system: str | None = None  # chat only: a system message (the shared prefix)
    prefix_id: int | None = None  # prefix-repetition: which shared prefix


class PromptShaper:
    """Counts prompt tokens as the server will and makes random text of exact lengths."""

    def __init__(self, tokenizer, chat: bool) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        special = set(tokenizer.all_special_ids)
        # Tokens that decode to clean text on their own: random ids then re-encode to
        # (almost) the same count, so a few corrections reach the exact length.
        self.vocab = [
            i
            for i in range(tokenizer.vocab_size)
            if i not in special and "\ufffd" not in (piece := tokenizer.decode([i])) and piece
        ]
        if not self.vocab:
            raise ValueError("the tokenizer has no plain-text tokens to build prompts from")

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def count(self, prompt: str, system: str | None = None) -> int:
        """Tokens the server prefills for this prompt (chat: through the chat template)."""
        if not self.chat:
            return len(self.encode(prompt))
        messages = [{"role": "system", "content": system}] if system is not None else []
        text = self.tokenizer.apply_chat_template(
            [*messages, {"role": "user", "content": prompt}],
            tokenize=False,
            add_generation_prompt=True,
        )
        return len(self.encode(text))

    def random_text(self, num_tokens: int, rng: random.Random) -> str:
        """Text that encodes to `num_tokens` tokens on its own (as close as it gets)."""
        if num_tokens <= 0:
            return ""
        ids = rng.choices(self.vocab, k=num_tokens)
        text = self.tokenizer.decode(ids)
        for _ in range(_FIT_ATTEMPTS):
            ids = self.encode(text)
            if len(ids) == num_tokens:
                break
            if len(ids) > num_tokens:
                ids = ids[:num_tokens]
            else:
                ids = ids + rng.choices(self.vocab, k=num_tokens - len(ids))
            text = self.tokenizer.decode(ids)
        return text

    def fit(
        self, num_tokens: int, rng: random.Random, prefix: str = "", system: str | None = None
    ) -> tuple[str, int]:
        """`prefix` + random text whose prompt (with `system`, through the template when
        chatting) counts `num_tokens`; returns the prompt and its exact count, which differs
        from `num_tokens` only when the template alone is longer."""
        want = num_tokens - self.count(prefix, system)
        prompt, got = prefix, self.count(prefix, system)
        for _ in range(_FIT_ATTEMPTS):
            if want <= 0 or got == num_tokens:
                break
            prompt = prefix + self.random_text(want, rng)
            got = self.count(prompt, system)
            want += num_tokens - got
        return prompt, got


def _uniform_len(rng: random.Random, length: int, range_ratio: float) -> int:
    low, high = int(length * (1 - range_ratio)), int(length * (1 + range_ratio))
    return max(1, rng.randint(low, high))


def random_requests(
    shaper: PromptShaper,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    rng: random.Random,
) -> list[SampleRequest]:
    """Lengths uniform in [len * (1 - range_ratio), len * (1 + range_ratio)]."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"random-range-ratio must be in [0, 1), got {range_ratio}")
    requests = []
    for _ in range(num_prompts):
        prompt, prompt_len = shaper.fit(_uniform_len(rng, input_len, range_ratio), rng)
        requests.append(
            SampleRequest(prompt, prompt_len, _uniform_len(rng, output_len, range_ratio))
        )
    return requests


def sharegpt_requests(
    shaper: PromptShaper,
    path: str | Path,
    num_prompts: int,
    rng: random.Random,
    output_len: int | None = None,
) -> list[SampleRequest]:
    """First human turn as the prompt; the first model turn's token count as the output
    length unless `output_len` is given. Conversations are shuffled with the seed; those
    with fewer than two turns or a prompt or reply under 4 tokens are skipped, as vLLM
    does, and so are those over 1024 prompt or 2048 total tokens."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"dataset-path {path}: cannot read a ShareGPT JSON file: {exc}") from None
    if not isinstance(data, list):
        raise ValueError(f"dataset-path {path}: expected a JSON list of conversations")
    conversations = [
        d["conversations"]
        for d in data
        if isinstance(d, dict) and len(d.get("conversations") or []) >= 2
    ]
    rng.shuffle(conversations)
    requests = []
    for conversation in conversations:
        if len(requests) == num_prompts:
            break
        prompt, reply = conversation[0].get("value", ""), conversation[1].get("value", "")
        prompt_len = shaper.count(prompt)
        reply_len = len(shaper.encode(reply)) if output_len is None else output_len
        if prompt_len < 4 or reply_len < 4 or prompt_len > 1024 or prompt_len + reply_len > 2048:
            continue
        requests.append(SampleRequest(prompt, prompt_len, reply_len))
    if len(requests) < num_prompts:
        raise ValueError(
            f"dataset-path {path}: only {len(requests)} usable conversations, "
            f"{num_prompts} asked for (--num-prompts)"
        )
    return requests


def prefix_repetition_requests(
    shaper: PromptShaper,
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    rng: random.Random,
) -> list[SampleRequest]:
    """`num_prefixes` random prefixes of `prefix_len` tokens, request i using prefix
    i % num_prefixes followed by its own random suffix; shuffled. For chat the prefix is
    the system message, so it is shared after the template too."""
    if num_prefixes < 1:
        raise ValueError(f"prefix-repetition-num-prefixes must be >= 1, got {num_prefixes}")
    prefixes = [shaper.random_text(prefix_len, rng) for _ in range(num_prefixes)]
    requests = []
    for i in range(num_prompts):
        prefix_id = i % num_prefixes
        if shaper.chat:
            system = prefixes[prefix_id]
            target = shaper.count("", system) + suffix_len
            prompt, prompt_len = shaper.fit(target, rng, system=system)
        else:
            system = None
            # A space keeps the suffix's first token from merging with the prefix's last.
            prompt, prompt_len = shaper.fit(prefix_len + suffix_len, rng, prefixes[prefix_id] + " ")
        requests.append(SampleRequest(prompt, prompt_len, output_len, system, prefix_id))
    rng.shuffle(requests)
    return requests
