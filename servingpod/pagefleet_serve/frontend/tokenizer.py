"""What the frontend asks of a tokenizer: the seam between text and token ids.

A Hugging Face tokenizer (`transformers`' fast or slow one, or the one read from a GGUF
file) satisfies it; `builtin://tiny-random` has none (`Tokenizer | None` where a model may
come without one). Only the API side holds a tokenizer: the engine core sees token ids.
"""

from __future__ import annotations

from typing import Any, Protocol


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any:
        """The chat template applied to messages (text with `tokenize=False`)."""

    def get_vocab(self) -> dict[str, int]: ...

    @property
    def all_special_ids(self) -> list[int]: ...

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]: ...
