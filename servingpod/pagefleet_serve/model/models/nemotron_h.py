"""Nemotron-H (NVIDIA, transformers' `nemotron_h`): pre-norm blocks of one mixer each, by
the config's layer types (`hybrid_override_pattern`'s letters in older configs): a Mamba2
mixer (M), attention without positions (*), or an MLP alone (-: up, ReLU squared, down).
The embedding, the final norm and the blocks are under `backbone.`, as Mamba2's.

Each kind keeps its own: a Mamba2 block its state slot's rows, an attention block K/V in
the paged cache, an MLP block nothing (`keeps_kv` false and no state: the engine allots
it no cache). The mixture-of-experts blocks (E) of Nemotron 3 are not served."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagefleet_serve.model.config import ModelConfig
from pagefleet_serve.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagefleet_serve.model.layers.mamba2 import MixerShape
from pagefleet_serve.model.layers.norm import RMSNorm
from pagefleet_serve.model.layers.state import RecurrentDecoderLayer, StateSpec
from pagefleet_serve.model.models.llama import LlamaAttention
from pagefleet_serve.model.models.mamba2 import Mamba2ForCausalLM, json_float
from pagefleet_serve.model_uri import UnsupportedModelError

# config.json's layer types (and the pattern's letters) -> ours.
_KINDS = {
    "mamba": "mamba",
    "linear_attention": "mamba",
    "M": "mamba",
    "attention": "attention",
    "full_attention": "attention",
    "*": "attention",
    "mlp": "mlp",
    "-": "mlp",
}

# transformers' defaults of the mixers' shape.
_TRANSFORMERS_MIXER = MixerShape(128, 64, 8, 128, 4, 128, False, True, (0.0, float("inf")))


@dataclass(frozen=True)
class NemotronHConfig(ModelConfig):
    layer_types: tuple[str, ...] = ()  # "mamba", "attention" or "mlp", per layer
    mlp_bias: bool = False
    mamba: MixerShape = _TRANSFORMERS_MIXER

    @classmethod
    def from_hf(cls, hf: dict, rope_scaling, eos_ids, architecture) -> "ModelConfig":
        # Newer config.json files derive the layer count from the types and write none.
        hf = {"num_hidden_layers": len(_kinds(hf)), **hf}
        return super().from_hf(hf, rope_scaling, eos_ids, architecture)

    @classmethod
    def family_fields(cls, hf: dict) -> dict:
        kinds = _kinds(hf)
        unknown = sorted({k for k in kinds if k not in _KINDS})
        if unknown:
            raise UnsupportedModelError(
                f"Nemotron-H layer types {unknown} are not served (its mixture-of-experts "
                f"blocks are not); served: Mamba2, attention and MLP blocks"
            )
        if hf.get("mlp_hidden_act", "relu2") != "relu2":
            raise UnsupportedModelError(
                f"Nemotron-H mlp_hidden_act {hf['mlp_hidden_act']!r} is not served (relu2 only)"
            )
        return {
            "layer_types": tuple(_KINDS[k] for k in kinds),
            "rms_norm_eps": float(hf.get("layer_norm_epsilon", 1e-5)),
            "mlp_bias": bool(hf.get("mlp_bias", False)),
            "o_bias": False,
            "qkv_bias": False,
            "mamba": MixerShape(
                hf["mamba_num_heads"],
                hf["mamba_head_dim"],
                hf.get("n_groups", 8),
                hf.get("ssm_state_size", 128),
                hf.get("conv_kernel", 4),
                hf.get("chunk_size", 128),
                bool(hf.get("use_bias", False)),
                bool(hf.get("use_conv_bias", True)),
                tuple(map(json_float, hf.get("time_step_limit") or (0, "inf"))),
            ),
        }


def _kinds(hf: dict) -> list[str] | str:
    return hf.get("layer_types") or hf.get("layers_block_type") or hf["hybrid_override_pattern"]


class ReluSquaredMLP(nn.Module):
    """down(relu(up(x))^2); `up` and `down` (the checkpoint's up_proj and down_proj: the
    name up_proj would load as the gated MLPs' half)."""

    def __init__(self, config: NemotronHConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.up = ColumnParallelLinear(config.hidden_size, size, config.mlp_bias)
        self.down = RowParallelLinear(size, config.hidden_size, config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)).square())


class NemotronHAttention(LlamaAttention):
    fusable = False
    rotary = False


class NemotronHBlock(RecurrentDecoderLayer):
    """x + mixer(norm(x)), whichever the mixer (one class, as transformers has it); its
    cache is its state rows, its K/V, or None."""

    def __init__(self, config: NemotronHConfig, layer: int) -> None:
        super().__init__()
        self.kind = config.layer_types[layer]
        self.keeps_kv = self.kind == "attention"
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mixer: nn.Module
        if self.kind == "mamba":
            self.mixer = config.mamba.mixer(config.hidden_size, config.rms_norm_eps)
        elif self.kind == "attention":
            self.mixer = NemotronHAttention(config, layer)
        else:
            self.mixer = ReluSquaredMLP(config)

    @property
    def self_attn(self) -> nn.Module:
        """The attention mixer, by the name `CausalLM` looks for it."""
        return self.mixer

    def state_specs(self) -> tuple[StateSpec, ...]:
        return self.mixer.state_specs() if self.kind == "mamba" else ()

    def forward(self, x, cos, sin, cache, attn) -> torch.Tensor:
        h = self.norm(x)
        if self.kind == "mamba":
            return x + self.mixer(h, cache, attn.state)
        if self.kind == "attention":
            q, k, v = self.mixer.project(h, cos, sin)
            return x + self.mixer.o_proj(self.mixer.attn(q, k, v, cache, attn))
        return x + self.mixer(h)


class NemotronHForCausalLM(Mamba2ForCausalLM):
    layer_class = NemotronHBlock
    config_class = NemotronHConfig
    unsplit_reason = "Nemotron-H's Mamba2 mixers are not split over tensor-parallel ranks"
    unused_prefixes = ("mtp.",)
    checkpoint_renames = ((".mixer.up_proj.", ".mixer.up."), (".mixer.down_proj.", ".mixer.down."))
