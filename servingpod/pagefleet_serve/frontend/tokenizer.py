"""What the frontend asks of a tokenizer: the seam between text and token ids; and the
loading of a model source's tokenizer.

A Hugging Face tokenizer (`transformers`' fast or slow one, or the one read from a GGUF
file) satisfies it; `builtin://tiny-random` has none (`Tokenizer | None` where a model may
come without one). Only the API side holds a tokenizer: the engine core sees token ids.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any:
        """The chat template applied to messages (text with `tokenize=False`)."""

    def get_vocab(self) -> dict[str, int]: ...

    @property
    def all_special_ids(self) -> list[int]: ...

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]: ...


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def load_tokenizer(uri: str):
    """The tokenizer (with chat template) of a model source, without its weights; None for
    builtin://tiny-random, a directory without tokenizer files and a GGUF file without a
    vocabulary (such a model is served on token ids)."""
    from pagefleet_serve.model.loader.resolve import resolve_model_uri

    path = resolve_model_uri(uri, weights="none").path
    if path is None:
        return None
    if path.is_file():
        return _gguf_tokenizer(path)
    if not any((path / name).exists() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def load_engine_tokenizer(config):
    """The tokenizer of an `EngineConfig`'s model, for the engine core (its grammars' token
    masks); ValueError when its draft model (speculative decoding) tokenizes otherwise."""
    tokenizer = load_tokenizer(config.model)
    spec = config.speculative_config
    if spec is not None and spec.model:
        draft = load_tokenizer(spec.model)
        if (draft is None) != (tokenizer is None) or (
            draft is not None and draft.get_vocab() != tokenizer.get_vocab()
        ):
            from pagefleet_serve.model.uri import parse_model_uri

            raise ValueError(
                f"speculative_config.model: the draft {parse_model_uri(spec.model).name}'s "
                "tokenizer differs from the target's; a draft must share the target's tokenizer"
            )
    return tokenizer


def _gguf_tokenizer(path: Path):
    """transformers converts a GGUF vocabulary in seconds; keep the result on disk so later
    starts (and every test process) load it in milliseconds, without reading the file. None
    when the file carries no vocabulary."""
    from transformers import AutoTokenizer

    from pagefleet_serve.model.loader.gguf_file import GGUFFile

    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    cache_root = Path(os.environ.get("PAGEFLEET_CACHE_DIR", Path.home() / ".cache" / "pagefleet"))
    cache = cache_root / "tokenizers" / key[:16]
    if (cache / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(cache)
    if "tokenizer.ggml.tokens" not in GGUFFile(path).fields:
        logger.warning("%s has no vocabulary: prompts must be token ids", path.name)
        return None
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    try:
        tokenizer.save_pretrained(cache)
    except OSError as exc:  # a read-only home is fine: we just convert again next time
        logger.warning("could not cache the tokenizer in %s: %s", cache, exc)
    return tokenizer
