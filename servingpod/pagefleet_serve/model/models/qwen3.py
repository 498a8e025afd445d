"""Qwen3: Qwen2's layers with an RMSNorm over each head of q and k before rope (and
attention biases only where `attention_bias` says)."""

from dataclasses import dataclass

import torch

from pagefleet_serve.model.config import ModelConfig
from pagefleet_serve.model.layers.norm import RMSNorm
from pagefleet_serve.model.loader.gguf_names import GGUFLayout
from pagefleet_serve.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from pagefleet_serve.model.models.qwen2 import QwenSliding


@dataclass(frozen=True)
class Qwen3Config(QwenSliding, ModelConfig):
    pass


class Qwen3Attention(LlamaAttention):
    """q and k normed per head (`q_norm`, `k_norm`: RMSNorms of head_dim)."""

    fusable = False

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer)
        self.q_norm = self.make_qk_norm(config)
        self.k_norm = self.make_qk_norm(config)

    def make_qk_norm(self, config: ModelConfig) -> RMSNorm:
        return RMSNorm(config.head_dim, config.rms_norm_eps)

    def normalize_qk(self, qkv: torch.Tensor, qk: torch.Tensor, v: torch.Tensor):
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        return torch.cat((self.q_norm(q), self.k_norm(k)), dim=1), v


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_class = Qwen3DecoderLayer
    config_class = Qwen3Config
    gguf = GGUFLayout()
