"""Granite 4.0-H (IBM, transformers' `granitemoehybrid`): pre-norm decoder layers whose
mixer is, layer by layer (`layer_types`), a Mamba2 mixer (`layers.mamba2`, its state in
the engine's state slots) or grouped-query attention (rotary positions only where
`position_embedding_type` is "rope": Granite 4.0-H's attention has none); every layer's
feed-forward is a shared SwiGLU MLP plus, where `num_local_experts` > 0, a mixture of
experts (softmax over the router's top k).

Granite's multipliers: the embedding times `embedding_multiplier`, each sublayer's output
times `residual_multiplier` before its residual add, attention scaled by
`attention_multiplier` (in place of head_dim^-1/2), the logits divided by
`logits_scaling`."""

from dataclasses import dataclass

import torch
from torch import nn

from pagefleet_serve.model.layers.mamba2 import MixerShape
from pagefleet_serve.model.layers.moe import MoEBlock, MoEConfig
from pagefleet_serve.model.layers.norm import RMSNorm
from pagefleet_serve.model.layers.state import RecurrentDecoderLayer, StateSpec
from pagefleet_serve.model.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
)
from pagefleet_serve.model.models.mamba2 import json_float

# config.json's names of a Mamba2 layer (older configs "mamba", transformers' own
# "linear_attention"); every other type is attention.
_MAMBA_TYPES = ("mamba", "linear_attention")

# The checkpoint's names -> ours: the experts stacked and fused already (gate | up), the
# shared MLP's gate and up fused too.
_NAMES = (
    (".block_sparse_moe.input_linear.weight", ".mlp.block_sparse_moe.experts.gate_up_proj"),
    (".block_sparse_moe.output_linear.weight", ".mlp.block_sparse_moe.experts.down_proj"),
    (".block_sparse_moe.router.layer.", ".mlp.block_sparse_moe.gate."),
    (".shared_mlp.input_linear.", ".mlp.shared_mlp.gate_up_proj."),
    (".shared_mlp.output_linear.", ".mlp.shared_mlp.down_proj."),
)

# transformers' defaults of the mixers' shape.
_TRANSFORMERS_MIXER = MixerShape(128, 64, 1, 256, 4, 256, False, True, (0.0, float("inf")))


@dataclass(frozen=True)
class GraniteHybridConfig(MoEConfig):
    layer_types: tuple[str, ...] = ()  # "mamba" or "attention", per layer
    shared_intermediate_size: int = 0
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0
    rotary: bool = False
    mamba: MixerShape = _TRANSFORMERS_MIXER

    @classmethod
    def family_fields(cls, hf: dict) -> dict:
        count = hf["num_hidden_layers"]
        kinds = hf.get("layer_types") or hf.get("layers_block_type") or ["mamba"] * count
        heads = hf.get("mamba_n_heads", 128)
        head_dim = hf.get("mamba_d_head", "auto")
        if head_dim == "auto":
            head_dim = hf.get("mamba_expand", 2) * hf["hidden_size"] // heads
        return super().family_fields(hf) | {
            "norm_topk_prob": True,
            "layer_types": tuple("mamba" if k in _MAMBA_TYPES else "attention" for k in kinds),
            "shared_intermediate_size": hf["shared_intermediate_size"],
            "embedding_multiplier": float(hf.get("embedding_multiplier") or 1.0),
            "residual_multiplier": float(hf.get("residual_multiplier") or 1.0),
            "attention_multiplier": float(hf.get("attention_multiplier") or 1.0),
            "logits_scaling": float(hf.get("logits_scaling") or 1.0),
            "rotary": hf.get("position_embedding_type") == "rope",
            "mamba": MixerShape(
                heads,
                head_dim,
                hf.get("mamba_n_groups", 1),
                hf.get("mamba_d_state", 256),
                hf.get("mamba_d_conv", 4),
                hf.get("mamba_chunk_size", 256),
                bool(hf.get("mamba_proj_bias", False)),
                bool(hf.get("mamba_conv_bias", True)),
                tuple(map(json_float, hf.get("time_step_limit") or (0, "inf"))),
            ),
        }


class GraniteFeedForward(nn.Module):
    """The shared MLP, plus the experts' output where the model has experts."""

    def __init__(self, config: GraniteHybridConfig) -> None:
        super().__init__()
        self.shared_mlp = LlamaMLP(config, config.shared_intermediate_size)
        self.block_sparse_moe = MoEBlock(config) if config.num_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.shared_mlp(x)
        return y if self.block_sparse_moe is None else self.block_sparse_moe(x) + y


class GraniteAttention(LlamaAttention):
    fusable = False

    def __init__(self, config: GraniteHybridConfig, layer: int) -> None:
        super().__init__(config, layer)
        self.rotary = config.rotary

    def attention_options(self, config: GraniteHybridConfig) -> dict:
        return {"scale": config.attention_multiplier}


class GraniteAttentionLayer(LlamaDecoderLayer):
    attention_class = GraniteAttention
    fusable = False  # type: ignore[assignment]

    def __init__(self, config: GraniteHybridConfig, layer: int) -> None:
        super().__init__(config, layer)
        self.residual_multiplier = config.residual_multiplier

    def make_mlp(self, config: GraniteHybridConfig, layer: int) -> nn.Module:
        return GraniteFeedForward(config)

    def attention_outputs(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        return granite_residuals(self, x, self.self_attn.o_proj(attended))


class GraniteMambaLayer(RecurrentDecoderLayer):
    """norm, Mamba2 mixer, scaled residual; norm, feed-forward, scaled residual. Its cache
    is its state rows, `attn.state` the step's slots."""

    def __init__(self, config: GraniteHybridConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mamba = config.mamba.mixer(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GraniteFeedForward(config)
        self.residual_multiplier = config.residual_multiplier

    def state_specs(self) -> tuple[StateSpec, ...]:
        return self.mamba.state_specs()

    def forward(self, x, cos, sin, state, attn) -> torch.Tensor:
        return granite_residuals(self, x, self.mamba(self.input_layernorm(x), state, attn.state))


def granite_residuals(layer: nn.Module, x: torch.Tensor, mixed: torch.Tensor) -> torch.Tensor:
    """The rest of a layer after its mixer's output: both sublayers' outputs scaled by the
    residual multiplier before their adds."""
    scale = layer.residual_multiplier
    x, normed = layer.post_attention_layernorm.add(x, mixed * scale)
    return x + layer.mlp(normed) * scale


def _granite_layer(config: GraniteHybridConfig, layer: int) -> nn.Module:
    if config.layer_types[layer] == "mamba":
        return GraniteMambaLayer(config, layer)
    return GraniteAttentionLayer(config, layer)


class GraniteMoeHybridForCausalLM(LlamaForCausalLM):
    layer_class = staticmethod(_granite_layer)  # type: ignore[assignment]
    config_class = GraniteHybridConfig
    unsplit_reason = "Granite 4.0-H's Mamba2 mixers are not split over tensor-parallel ranks"
    checkpoint_renames = _NAMES

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.config.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        return None if logits is None else logits / self.config.logits_scaling
