"""`--speculative-config`: vLLM's JSON keys, validated once into a frozen dataclass."""

import json
from dataclasses import dataclass, fields

from pagefleet_serve.model.uri import ModelURIError, parse_model_uri

SPEC_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    # draft_model: the draft's URI (any form the loader reads); it must share the target's
    # vocabulary, and runs in the target's dtype, quantization and KV cache dtype.
    model: str | None = None
    # n-gram prompt lookup: the longest and shortest suffix of the sequence looked up.
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # No proposals in a step whose decoding batch is larger than this: verifying drafts
    # turns each decode row into a query span, which costs more than it saves once the
    # step is compute-bound rather than weight-reading-bound. None: always propose.
    disable_by_batch_size: int | None = 4

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {SPEC_METHODS}, got {self.method!r}"
            )
        self._check_model()
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"speculative_config.{name} must be a positive integer, got {value!r}"
                )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be at "
                f"most prompt_lookup_max ({self.prompt_lookup_max})"
            )
        size = self.disable_by_batch_size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ValueError(
                f"speculative_config.disable_by_batch_size must be a positive integer or null, "
                f"got {size!r}"
            )

    def _check_model(self) -> None:
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError(
                    "speculative_config.model names a draft model, which method 'ngram' does "
                    "not use; drop it or set method to 'draft_model'"
                )
            return
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(
                "speculative_config.model is required by method 'draft_model': the draft "
                f"model's URI, got {self.model!r}"
            )
        try:
            parse_model_uri(self.model)
        except ModelURIError as exc:
            raise ValueError(f"speculative_config.model: {exc}") from exc

    @classmethod
    def from_json(cls, text: str | dict | None) -> "SpeculativeConfig | None":
        """Parse the flag's JSON (a dict is taken as already parsed); None or {} is off."""
        if text is None or isinstance(text, cls):
            return text
        if isinstance(text, str):
            try:
                text = json.loads(text) if text.strip() else {}
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from exc
        if not isinstance(text, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {text!r}")
        if not text:
            return None
        if "model" in text and "method" not in text:  # vLLM's short form of a draft model
            text = {"method": "draft_model", **text}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(text) - known)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown keys {unknown}; allowed: {sorted(known)}"
            )
        return cls(**text)
