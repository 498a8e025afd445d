"""LFM2 (Liquid AI): pre-norm decoder layers whose mixer is, layer by layer
(`layer_types`), either grouped-query attention with per-head q/k RMSNorms (Qwen3's) or a
gated short convolution (`layers.short_conv`: a causal depthwise convolution over
`conv_L_cache` tokens, whose per-sequence state the engine's state slots hold), each
followed by a SwiGLU MLP; the final norm is config.json's `embedding_norm`.

LFM2-MoE (`lfm2_moe`) has experts in place of the MLP past its first `num_dense_layers`,
routed by sigmoid scores: the top k chosen by score + `expert_bias` (a bias that balances
the experts' load, not a weight), weighted by their scores renormalized and times
`routed_scaling_factor`.

The attention layers keep their K/V in the paged cache; the convolution layers keep only
their last `conv_L_cache - 1` inputs per sequence, so the KV cache holds the attention
layers alone (see `CausalLM.state_specs`)."""

from dataclasses import dataclass

import torch
from torch import nn

from pagefleet_serve.model.config import ModelConfig
from pagefleet_serve.model.layers.linear import default_weight_loader, parameter
from pagefleet_serve.model.layers.moe import MoEBlock, MoEConfig
from pagefleet_serve.model.layers.norm import RMSNorm
from pagefleet_serve.model.layers.short_conv import ShortConv
from pagefleet_serve.model.layers.state import RecurrentDecoderLayer, StateSpec
from pagefleet_serve.model.models.llama import LlamaForCausalLM, LlamaMLP
from pagefleet_serve.model.models.qwen3 import Qwen3DecoderLayer

# The checkpoint's names -> ours (Llama's, which the shared parts and mappings use).
_NAMES = (
    ("embedding_norm.", "norm."),
    (".operator_norm.", ".input_layernorm."),
    (".ffn_norm.", ".post_attention_layernorm."),
    (".feed_forward.", ".mlp."),  # the MLP, or the router and experts
    (".w1.", ".gate_proj."),
    (".w3.", ".up_proj."),
    (".w2.", ".down_proj."),
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".q_layernorm.", ".q_norm."),
    (".k_layernorm.", ".k_norm."),
)


@dataclass(frozen=True)
class Lfm2Config(ModelConfig):
    layer_types: tuple[str, ...] = ()  # "conv" or "full_attention", per layer
    conv_kernel_size: int = 3  # config.json's conv_L_cache
    conv_bias: bool = False

    @classmethod
    def family_fields(cls, hf: dict) -> dict:
        rope = hf.get("rope_parameters") or {}
        return {
            "layer_types": _layer_types(hf),
            "conv_kernel_size": hf.get("conv_L_cache", 3),
            "conv_bias": bool(hf.get("conv_bias", False)),
            "intermediate_size": _mlp_size(hf),
            "rms_norm_eps": float(hf.get("norm_eps", 1e-5)),
            "rope_theta": float(hf.get("rope_theta") or rope.get("rope_theta") or 1e6),
        }


@dataclass(frozen=True)
class Lfm2MoeConfig(Lfm2Config, MoEConfig):
    routed_scaling_factor: float = 1.0
    use_expert_bias: bool = True

    @classmethod
    def family_fields(cls, hf: dict) -> dict:
        dense = hf.get("num_dense_layers", 0)
        # Lfm2Config's reads none of the experts' (it calls no super).
        return (
            super().family_fields(hf)
            | MoEConfig.family_fields(hf)
            | {
                "intermediate_size": hf["intermediate_size"],  # the dense layers' MLP, as given
                "sparse_layers": tuple(i >= dense for i in range(hf["num_hidden_layers"])),
                "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
                "routed_scaling_factor": float(hf.get("routed_scaling_factor") or 1.0),
                "use_expert_bias": bool(hf.get("use_expert_bias", True)),
            }
        )


def _layer_types(hf: dict) -> tuple[str, ...]:
    """`layer_types`, or where config.json predates it the attention layers' indices
    (`full_attn_idxs`)."""
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    attention = set(hf["full_attn_idxs"])
    count = hf["num_hidden_layers"]
    return tuple("full_attention" if i in attention else "conv" for i in range(count))


def _mlp_size(hf: dict) -> int:
    """The MLP's width: config.json's size, or where `block_auto_adjust_ff_dim` is set
    two thirds of it times `block_ffn_dim_multiplier`, rounded up to `block_multiple_of`
    (how LFM2 derives it)."""
    size = hf.get("block_ff_dim") or hf["intermediate_size"]
    if not hf.get("block_auto_adjust_ff_dim", True):
        return size
    size = int(2 * size / 3)
    multiplier = hf.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is not None:
        multiple = hf.get("block_multiple_of", 256)
        size = multiple * -(-int(multiplier * size) // multiple)
    return size


class ExpertBiasMoEBlock(MoEBlock):
    """LFM2-MoE's experts and router (see the module)."""

    def __init__(self, config: Lfm2MoeConfig) -> None:
        super().__init__(config)
        self.scaling = config.routed_scaling_factor
        self.expert_bias = (
            parameter((config.num_experts,), default_weight_loader, torch.float32)
            if config.use_expert_bias
            else None
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.gate(x).float().sigmoid()
        choice = scores if self.expert_bias is None else scores + self.expert_bias.float()
        ids = torch.topk(choice, self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
        return weights * self.scaling, ids


def _lfm2_mlp(config: ModelConfig, layer: int) -> nn.Module:
    if isinstance(config, Lfm2MoeConfig) and config.layer_is_sparse(layer):
        return ExpertBiasMoEBlock(config)
    return LlamaMLP(config)


class Lfm2AttentionLayer(Qwen3DecoderLayer):
    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        return _lfm2_mlp(config, layer)


class Lfm2ConvLayer(RecurrentDecoderLayer):
    """A layer whose mixer is the short convolution: norm, conv, residual; norm, MLP,
    residual. Its cache is its state rows, its `attn` the step's metadata with the
    sequences' state slots."""

    def __init__(self, config: Lfm2Config, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.conv = ShortConv(config.hidden_size, config.conv_kernel_size, config.conv_bias)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = _lfm2_mlp(config, layer)

    def state_specs(self) -> tuple[StateSpec, ...]:
        return self.conv.state_specs()

    def forward(self, x, cos, sin, state, attn) -> torch.Tensor:
        mixed = self.conv(self.input_layernorm(x), state, attn.state)
        x, normed = self.post_attention_layernorm.add(x, mixed)
        return x + self.mlp(normed)


def _lfm2_layer(config: Lfm2Config, layer: int) -> nn.Module:
    if config.layer_types[layer] == "conv":
        return Lfm2ConvLayer(config, layer)
    return Lfm2AttentionLayer(config, layer)


class Lfm2ForCausalLM(LlamaForCausalLM):
    layer_class = staticmethod(_lfm2_layer)  # type: ignore[assignment]
    config_class = Lfm2Config
    unsplit_reason = "LFM2's short convolutions are not split over tensor-parallel ranks"
    checkpoint_renames = _NAMES


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    config_class = Lfm2MoeConfig
