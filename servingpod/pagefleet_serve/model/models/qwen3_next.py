"""Qwen3-Next and Qwen3.5's text models (dense and MoE): pre-norm decoder layers whose
mixer is, layer by layer (`layer_types`), Gated DeltaNet (`layers.gated_deltanet`, its
state in the engine's state slots) or gated attention; then a SwiGLU MLP, or on sparse
layers experts (softmax router, top k renormalized) beside a shared expert scaled by
sigmoid(its gate).

The gated attention: q_proj gives each head's query and an output gate side by side; q
and k are RMS-normed per head; rope turns the first `partial_rotary_factor` of each head;
the attention output is multiplied by sigmoid(gate) before o_proj. Every RMSNorm but the
DeltaNet's own scales by (1 + weight) in float32 (the weights are stored centred on zero).

Qwen3-Next and Qwen3.5 differ in the DeltaNet's projections (Qwen3-Next interleaves them
per key head, see `InterleavedGatedDeltaNet`). Qwen3.5's multimodal rope gives a text
token the same position in its three sections, which is plain rope."""

from dataclasses import dataclass

import torch
from torch import nn

from pagefleet_serve.model.config import ModelConfig
from pagefleet_serve.model.context import current_context
from pagefleet_serve.model.layers.attention import Attention
from pagefleet_serve.model.layers.gated_deltanet import GatedDeltaNet, InterleavedGatedDeltaNet
from pagefleet_serve.model.layers.linear import QKVParallelLinear, RowParallelLinear
from pagefleet_serve.model.layers.norm import RMSNorm
from pagefleet_serve.model.layers.state import RecurrentDecoderLayer, StateSpec
from pagefleet_serve.model.models.llama import LlamaForCausalLM, LlamaMLP
from pagefleet_serve.model.models.qwen2_moe import Qwen2MoeConfig, SharedExpertMoEBlock


@dataclass(frozen=True)
class Qwen3NextConfig(Qwen2MoeConfig):
    partial_rotary = True
    layer_types: tuple[str, ...] = ()  # "linear_attention" or "full_attention", per layer
    # The DeltaNet's: key and value heads and their sizes, the convolution's taps, and
    # whether its projections are Qwen3-Next's interleaved ones.
    linear_key_heads: int = 16
    linear_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel: int = 4
    interleaved_deltanet: bool = True

    @classmethod
    def family_fields(cls, hf: dict) -> dict:
        bias = bool(hf.get("attention_bias", False))
        return super().family_fields(hf) | {
            "qkv_bias": bias,
            "o_bias": bias,
            # Qwen3.5's MoE renormalizes always (its config has no switch).
            "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
            "layer_types": _layer_types(hf),
            "linear_key_heads": hf["linear_num_key_heads"],
            "linear_value_heads": hf["linear_num_value_heads"],
            "linear_key_head_dim": hf["linear_key_head_dim"],
            "linear_value_head_dim": hf["linear_value_head_dim"],
            "linear_conv_kernel": hf.get("linear_conv_kernel_dim", 4),
            "interleaved_deltanet": hf.get("model_type") == "qwen3_next",
        }


def _layer_types(hf: dict) -> tuple[str, ...]:
    """`layer_types`, or where config.json predates it every `full_attention_interval`-th
    layer attention (the released Qwen3-Next configs: every 4th)."""
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    interval = hf.get("full_attention_interval", 4)
    kinds = ("full_attention", "linear_attention")
    return tuple(kinds[bool((i + 1) % interval)] for i in range(hf["num_hidden_layers"]))


def centred_norm(size: int, config: ModelConfig) -> RMSNorm:
    """An RMSNorm that scales by (1 + weight)."""
    return RMSNorm(size, config.rms_norm_eps, unit_offset=True)


class GatedAttention(nn.Module):
    def __init__(self, config: Qwen3NextConfig, layer: int) -> None:
        super().__init__()
        self.backend = current_context().backend
        d = self.head_dim = config.head_dim
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.rotary_dim = config.rotary_dim
        # Each head's query and gate side by side: twice the query heads.
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, d, 2 * config.num_heads, config.num_kv_heads, config.qkv_bias
        )
        self.o_proj = RowParallelLinear(config.num_heads * d, config.hidden_size, config.o_bias)
        self.q_norm = centred_norm(d, config)
        self.k_norm = centred_norm(d, config)
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, scale=d**-0.5)

    def forward(self, x, cos, sin, kv_cache, attn) -> torch.Tensor:
        tokens, d = x.shape[0], self.head_dim
        q_gate, k, v = self.qkv_proj(x).split(
            (2 * self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d), dim=-1
        )
        q, gate = q_gate.view(tokens, self.num_heads, 2 * d).chunk(2, dim=-1)
        qk = torch.cat((self.q_norm(q), self.k_norm(k.view(tokens, self.num_kv_heads, d))), dim=1)
        turned = self.backend.rope(qk[..., : self.rotary_dim].contiguous(), cos, sin)
        qk = torch.cat((turned, qk[..., self.rotary_dim :]), dim=-1)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        out = self.attn(q, k, v.view(tokens, self.num_kv_heads, d), kv_cache, attn)
        return self.o_proj(out * torch.sigmoid(gate.reshape(tokens, -1)))


class Qwen3NextDecoderLayer(RecurrentDecoderLayer):
    """Either mixer in one class (as transformers has it): `linear_attn` with its state
    rows as its cache, or `self_attn` with its K/V. Nothing is fused or compiled around
    either (see `RecurrentDecoderLayer`)."""

    def __init__(self, config: Qwen3NextConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = centred_norm(config.hidden_size, config)
        self.linear_attn: GatedDeltaNet | None = None
        if config.layer_types[layer] == "linear_attention":
            kind = InterleavedGatedDeltaNet if config.interleaved_deltanet else GatedDeltaNet
            self.linear_attn = kind(
                config.hidden_size,
                config.linear_key_heads,
                config.linear_value_heads,
                config.linear_key_head_dim,
                config.linear_value_head_dim,
                config.linear_conv_kernel,
                config.rms_norm_eps,
            )
        else:
            self.self_attn = GatedAttention(config, layer)
        self.keeps_kv = self.linear_attn is None
        self.post_attention_layernorm = centred_norm(config.hidden_size, config)
        self.mlp = (
            SharedExpertMoEBlock(config) if config.layer_is_sparse(layer) else LlamaMLP(config)
        )

    def state_specs(self) -> tuple[StateSpec, ...]:
        return () if self.linear_attn is None else self.linear_attn.state_specs()

    def forward(self, x, cos, sin, cache, attn) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.linear_attn is None:
            mixed = self.self_attn(h, cos, sin, cache, attn)
        else:
            mixed = self.linear_attn(h, cache, attn.state)
        x, normed = self.post_attention_layernorm.add(x, mixed)
        return x + self.mlp(normed)


class Qwen3NextForCausalLM(LlamaForCausalLM):
    layer_class = Qwen3NextDecoderLayer
    config_class = Qwen3NextConfig
    unsplit_reason = "the Gated DeltaNet layers are not split over tensor-parallel ranks"
    unused_prefixes = ("mtp.",)

    def make_norm(self, size: int) -> RMSNorm:
        return centred_norm(size, self.config)
