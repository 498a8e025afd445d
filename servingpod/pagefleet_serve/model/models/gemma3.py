"""Gemma 3 (text): Gemma 2's layers with per-head q/k norms (Gemma's (1 + weight) norms),
and sliding-window layers that rotate with their own base (`local_rope_theta`) and no
rope scaling."""

from dataclasses import dataclass

from pagefleet_serve.model.layers.norm import RMSNorm
from pagefleet_serve.model.layers.rotary import RotaryEmbedding
from pagefleet_serve.model.loader.gguf_names import GGUFLayout
from pagefleet_serve.model.models.gemma2 import (
    GEMMA_NORMS,
    Gemma2Attention,
    Gemma2Config,
    Gemma2DecoderLayer,
    Gemma2ForCausalLM,
    gemma_norm,
)
from pagefleet_serve.model.models.qwen3 import Qwen3Attention


@dataclass(frozen=True)
class Gemma3Config(Gemma2Config):
    local_rope_theta: float = 10000.0

    default_sliding_period = 6

    @classmethod
    def family_fields(cls, hf: dict) -> dict:
        theta = float(hf.get("rope_local_base_freq", 10000.0))
        return super().family_fields(hf) | {"local_rope_theta": theta}


class Gemma3Attention(Gemma2Attention, Qwen3Attention):
    def make_qk_norm(self, config) -> RMSNorm:
        return gemma_norm(config.head_dim, config)


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_class = Gemma3Attention


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    layer_class = Gemma3DecoderLayer
    config_class = Gemma3Config
    gguf = GGUFLayout(norm_offset=1.0, tensors=GEMMA_NORMS, query_scale_by_hidden_layers=62)

    def __init__(self, config: Gemma3Config) -> None:
        super().__init__(config)
        self.local_rotary = RotaryEmbedding(config.head_dim, config.local_rope_theta)

    def layer_ropes(self, positions, attn, dtype):
        rope = self.rotary(positions, attn, dtype)
        local = self.local_rotary(positions, attn, dtype)
        return [local if layer.self_attn.attn.sliding_window else rope for layer in self.layers]
