"""A request's prefix key: hash-chained blocks of its prompt text, and the table of which
pod most recently served each block.

The router hashes characters, not tokens: it runs without the model's tokenizer (the
operator's image has no model files). A shared text prefix gives the same leading block
hashes, which is all affinity needs; a block here is `block_chars` characters, roughly
`block_chars / 4` tokens, so it only approximates the pods' block boundaries."""

from __future__ import annotations

import hashlib
import json

from .pod_table import PodTable


def prompt_text(path: str, body: dict) -> str:
    """The part of a request body that forms the pod's prompt prefix, as text: the model
    name first (a prefix is only shared within a model), then the prompt, the messages or
    a response's instructions and input.
    An embedding's pod keeps no KV past the request (and runs without a prefix cache): it
    has no prefix to follow, "" (it goes to the least loaded pod)."""
    if path.endswith("/embeddings"):
        return ""
    model = str(body.get("model", ""))
    if path.endswith("/chat/completions"):
        return model + "\n" + _messages_text(body.get("messages"))
    if path.endswith("/responses"):
        # The pod's chat prompt: instructions as the system message, then the input.
        items = body.get("input")
        if isinstance(items, str):
            items = [{"role": "user", "content": items}]
        instructions = body.get("instructions")
        system = [{"role": "system", "content": instructions}] if instructions else []
        return model + "\n" + _messages_text(system + (items if isinstance(items, list) else []))
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # a one-prompt batch shares the prefix of that prompt
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, separators=(",", ":"))
    return model + "\n" + text


def _messages_text(messages: object) -> str:
    if not isinstance(messages, list):
        return ""
    return "".join(_message_text(m) for m in messages if isinstance(m, dict))


def _message_text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, list):
        content = [_part(part) for part in content]
    if not isinstance(content, str):
        content = json.dumps(content, separators=(",", ":"))
    return f"{message.get('role', '')}\n{content}\n"


def _part(part: object) -> object:
    """A content part as the prefix reads it: an image (chat's `image_url.url`, the
    Responses API's `image_url`) by the hash of its URL, whose data: URL is the image's
    bytes, so that a megabyte of base64 is one short block of the prefix and the text
    after it still lines up."""
    if not isinstance(part, dict):
        return part
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str):
        return part
    digest = hashlib.sha256(url.encode("utf-8", "surrogatepass")).hexdigest()
    return {"type": part.get("type"), "image": digest}


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


class PrefixTable(PodTable[bytes]):
    """block hash -> the pod that most recently served a prompt containing that block,
    bounded by evicting the least recently served block."""
