"""A request's prefix key: hash-chained blocks of its prompt text, and the table of which
pod most recently served each block.

The router hashes characters, not tokens: it runs without the model's tokenizer (the
operator's image has no model files). A shared text prefix gives the same leading block
hashes, which is all affinity needs; a block here is `block_chars` characters, roughly
`block_chars / 4` tokens, so it only approximates the pods' block boundaries."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterable


def prompt_text(path: str, body: dict) -> str:
    """The part of a request body that forms the pod's prompt prefix, as text: the model
    name first (a prefix is only shared within a model), then the prompt or messages.
    An embedding's pod keeps no KV past the request (and runs without a prefix cache): it
    has no prefix to follow, "" (it goes to the least loaded pod)."""
    if path.endswith("/embeddings"):
        return ""
    model = str(body.get("model", ""))
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        parts = (
            [_message_text(m) for m in messages if isinstance(m, dict)]
            if isinstance(messages, list)
            else []
        )
        return model + "\n" + "".join(parts)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # a one-prompt batch shares the prefix of that prompt
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, separators=(",", ":"))
    return model + "\n" + text


def _message_text(message: dict) -> str:
    content = message.get("content")
    if not isinstance(content, str):
        content = json.dumps(content, separators=(",", ":"))
    return f"{message.get('role', '')}\n{content}\n"


def block_hashes(text: str, block_chars: int, max_blocks: int) -> list[bytes]:
    """sha256 of each full leading block chained over its parent's hash, like the pods'
    prefix cache: equal hash at block i means equal text up to the end of block i. JSON
    may carry a lone surrogate (`"\\ud800"`), which strict UTF-8 cannot encode."""
    hashes: list[bytes] = []
    parent = b""
    for start in range(0, min(len(text) // block_chars, max_blocks) * block_chars, block_chars):
        block = text[start : start + block_chars].encode("utf-8", "surrogatepass")
        parent = hashlib.sha256(parent + block).digest()
        hashes.append(parent)
    return hashes


class PrefixTable:
    """block hash -> the pod that most recently served a prompt containing that block,
    bounded by evicting the least recently served block."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"prefix table capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._pods: OrderedDict[bytes, str] = OrderedDict()

    def get(self, block_hash: bytes) -> str | None:
        return self._pods.get(block_hash)

    def record(self, hashes: Iterable[bytes], pod: str) -> None:
        for block_hash in hashes:
            self._pods[block_hash] = pod
            self._pods.move_to_end(block_hash)
        while len(self._pods) > self.capacity:
            self._pods.popitem(last=False)

    def forget_pod(self, pod: str) -> None:
        """Drop a vanished pod's entries: its cache went with it."""
        for block_hash in [h for h, p in self._pods.items() if p == pod]:
            del self._pods[block_hash]

    def __len__(self) -> int:
        return len(self._pods)
