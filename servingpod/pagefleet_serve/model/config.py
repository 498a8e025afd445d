"""What every decoder's configuration has, read from a Hugging Face config.json dict (a
GGUF's metadata is turned into one first, see `loader.gguf`).

A family's own switches live in its file, as a subclass (`models.gemma2.Gemma2Config`,
`layers.moe.MoEConfig`, ...) that reads its fields in `family_fields`; `architecture` names
the registry's entry the model is built from.
"""

from dataclasses import dataclass
from typing import ClassVar

from pagefleet_serve.model_uri import UnsupportedModelError

# The gated MLP activations `layers.activation` computes, by config.json's `hidden_act`.
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # (key, value) pairs: llama3 (factor, freq factors...), linear, longrope (short_factor,
    # long_factor, original_max_position_embeddings, attention_factor), yarn (factor,
    # beta_fast, beta_slow, original_max_position_embeddings, truncate, attention_factor),
    # freqs (GGUF); see layers.rotary.
    rope_scaling: tuple[tuple[str, object], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # Every id that ends a generation (the config's and generation_config's); includes
    # eos_token_id.
    eos_token_ids: tuple[int, ...] = ()
    qkv_bias: bool = False
    o_bias: bool = False
    sliding_window: int | None = None  # keys within this many positions, the query's included
    # Per layer, whether it uses the sliding window; None: every layer does (when set).
    sliding_layers: tuple[bool, ...] | None = None
    hidden_act: str = "silu"  # or "gelu_pytorch_tanh" (GeGLU)
    # The registry's name of the model class (a Hugging Face `architectures` entry).
    architecture: str = "LlamaForCausalLM"
    # The share of each head's dimensions rope rotates (the first ones), in families that
    # say `partial_rotary`; the others rotate whole heads and refuse anything else.
    partial_rotary_factor: float = 1.0
    partial_rotary: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.sliding_layers is not None and len(self.sliding_layers) != self.num_layers:
            raise ValueError(
                f"sliding_layers has {len(self.sliding_layers)} entries for "
                f"{self.num_layers} layers"
            )

    @property
    def rotary_dim(self) -> int:
        """The dimensions of each head that rope rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_sliding_window(self, layer: int) -> int | None:
        if self.sliding_layers is not None and not self.sliding_layers[layer]:
            return None
        return self.sliding_window

    def layer_is_sparse(self, layer: int) -> bool:
        """Whether the layer's MLP is a mixture of experts (see `layers.moe.MoEConfig`)."""
        return False

    @classmethod
    def from_hf(
        cls, hf: dict, rope_scaling, eos_ids: tuple[int, ...], architecture: str
    ) -> "ModelConfig":
        """The config of a Hugging Face config.json dict (its rope scaling resolved by
        `layers.rotary.rope_scaling`, `tie_word_embeddings` set by the loader)."""
        num_heads = hf["num_attention_heads"]
        bias = bool(hf.get("attention_bias", False))
        rotary = float(hf.get("partial_rotary_factor", 1.0))
        if rotary != 1.0 and not cls.partial_rotary:
            raise UnsupportedModelError(
                f"partial_rotary_factor {rotary} is not supported by {architecture} (rope on "
                "whole heads only)"
            )
        common = {
            "vocab_size": hf["vocab_size"],
            "hidden_size": hf["hidden_size"],
            "intermediate_size": hf["intermediate_size"],
            "num_layers": hf["num_hidden_layers"],
            "num_heads": num_heads,
            "num_kv_heads": hf.get("num_key_value_heads") or num_heads,
            "head_dim": hf.get("head_dim") or hf["hidden_size"] // num_heads,
            "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-5)),
            "rope_theta": float(hf.get("rope_theta") or 10000.0),
            "rope_scaling": rope_scaling,
            "max_position_embeddings": hf.get("max_position_embeddings", 2048),
            "tie_word_embeddings": hf["tie_word_embeddings"],
            "bos_token_id": hf.get("bos_token_id"),
            "eos_token_id": eos_ids[0] if eos_ids else None,
            "eos_token_ids": eos_ids,
            "qkv_bias": bias,
            "o_bias": bias,
            "architecture": architecture,
            "partial_rotary_factor": rotary,
        }
        return cls(**(common | cls.sliding_fields(hf) | cls.family_fields(hf)))

    @classmethod
    def language_config(cls, hf: dict) -> dict:
        """The config.json dict the language model's fields are read from: the whole
        of it, a vision-language family's `text_config` (with what else it needs)."""
        return hf

    @classmethod
    def family_fields(cls, hf: dict) -> dict:
        """A family's own fields (and the common ones it sets otherwise), from config.json."""
        return {}

    @classmethod
    def sliding_fields(cls, hf: dict) -> dict:
        """sliding_window and sliding_layers, from `sliding_window` and `layer_types` (the
        families with older layouts read theirs in `sliding_layer_types`)."""
        window = hf.get("sliding_window")
        if window is None:
            return {}
        layers = hf.get("layer_types") or cls.sliding_layer_types(hf)
        sliding = None if layers is None else tuple(t == "sliding_attention" for t in layers)
        if sliding is not None and not any(sliding):
            return {}
        return {"sliding_window": int(window), "sliding_layers": sliding}

    @classmethod
    def sliding_layer_types(cls, hf: dict) -> list[str] | None:
        """Each layer's type where config.json predates `layer_types`; None: all sliding."""
        return None
