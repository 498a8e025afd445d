"""Precise prefix routing's data: which blocks each pod's KV cache holds, kept from the
pods' KV cache events (vLLM's format), and a prompt's blocks named as the pods name them.

The pods name a full block of `block_size` tokens by sha256 over its parent's name and
its token ids (`pagefleet_serve.kv_event_messages.hash_block`), so the router, tokenizing
a prompt with the model's own tokenizer (the `tokenizers` package and the model's
tokenizer.json: no model weights, no transformers), computes the very names the events
carry and asks which pod holds the longest run of them from the start. Only base-model
/v1/completions prompts are named this way: a chat prompt's tokens are the model's chat
template rendered by transformers in the pod (its Jinja environment, the request's
messages as the pod normalizes them), which a router with the tokenizer alone would only
imitate, and a near miss names no block any pod holds; an adapter's blocks chain from a
seed the router cannot know. Those requests, and pods whose events are missing, are
routed by the approximate prefix table, counted by why
(metrics.PRECISE_FALLBACK_REASONS).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from pagefleet_serve.kv_event_messages import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    hash_block,
)
from pagefleet_serve.model_uri import ModelURIError, parse_model_uri

_CHAT_PATHS = ("/v1/chat/completions", "/v1/responses")


class PromptBlocks:
    """A completion prompt's leading block names, from its text as the pods tokenize it
    (no special tokens added) or from its token ids."""

    def __init__(self, tokenizer: str | Path, block_size: int, max_blocks: int) -> None:
        if block_size < 1 or max_blocks < 1:
            raise ValueError(
                f"block size and max blocks must be >= 1, got {block_size}, {max_blocks}"
            )
        self.tokenizer = load_tokenizer(str(tokenizer))
        self.block_size = block_size
        self.max_blocks = max_blocks

    def names(self, path: str, body: Mapping) -> tuple[list[bytes], str | None]:
        """A completion's block names, else [] and the reason why (metrics.PRECISE_FALLBACK_REASONS)
        (None for a request with no prompt to cache, an embedding's)."""
        if path.endswith(_CHAT_PATHS):
            return [], "chat_template"
        if not path.endswith("/v1/completions"):
            return [], None
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            token_ids = prompt
        else:
            return [], "prompt_form"
        return chain_names(token_ids, self.block_size, self.max_blocks), None


def load_tokenizer(source: str):
    """A tokenizer.json path, or hf://org/name[@revision]: that repository's tokenizer.json
    from the Hugging Face Hub (the `tokenizers` package's own download; HF_TOKEN for a
    gated or private one), the pods' model as the operator names it. ValueError naming
    the source when it is neither."""
    from tokenizers import Tokenizer  # only with precise routing

    if not source.startswith("hf://"):
        return Tokenizer.from_file(source)
    try:
        model = parse_model_uri(source)
    except ModelURIError as exc:
        raise ValueError(f"--tokenizer {source}: {exc}") from None
    if model.filename is not None:
        raise ValueError(
            f"--tokenizer {source}: a GGUF file holds its tokenizer; give the tokenizer.json "
            "of the repository it was made from"
        )
    return Tokenizer.from_pretrained(
        str(model.repo_id), revision=model.revision or "main", token=os.environ.get("HF_TOKEN")
    )


def chain_names(token_ids: Sequence[int], block_size: int, max_blocks: int) -> list[bytes]:
    names: list[bytes] = []
    parent = None
    for start in range(0, min(len(token_ids) // block_size, max_blocks) * block_size, block_size):
        parent = hash_block(parent, list(token_ids[start : start + block_size]))
        names.append(parent)
    return names


class KVBlockIndex:
    """block name -> the pods holding it, from each pod's events in order."""

    def __init__(self) -> None:
        self._holders: dict[bytes, set[str]] = {}
        self._held: dict[str, set[bytes]] = {}

    def apply(self, pod: str, events: Iterable[KVCacheEvent]) -> None:
        held = self._held.setdefault(pod, set())
        for event in events:
            if isinstance(event, BlockStored):
                for name in event.block_hashes:
                    held.add(name)
                    self._holders.setdefault(name, set()).add(pod)
            elif isinstance(event, BlockRemoved):
                for name in event.block_hashes:
                    held.discard(name)
                    self._forget(name, pod)
            elif isinstance(event, AllBlocksCleared):
                self.clear(pod)
                held = self._held.setdefault(pod, set())

    def clear(self, pod: str) -> None:
        """Forget what the pod held (it restarted, vanished, or its events were lost)."""
        for name in self._held.pop(pod, ()):
            self._forget(name, pod)

    def _forget(self, name: bytes, pod: str) -> None:
        holders = self._holders.get(name)
        if holders is not None:
            holders.discard(pod)
            if not holders:
                del self._holders[name]

    def cached_blocks(self, names: Sequence[bytes]) -> dict[str, int]:
        """Each pod's number of leading blocks of `names` in its cache (pods holding none
        left out)."""
        matched: dict[str, int] = {}
        alive = None
        for depth, name in enumerate(names):
            holders = self._holders.get(name, set())
            alive = holders if alive is None else alive & holders
            if not alive:
                break
            for pod in alive:
                matched[pod] = depth + 1
        return matched

    def num_blocks(self, pod: str) -> int:
        return len(self._held.get(pod, ()))
