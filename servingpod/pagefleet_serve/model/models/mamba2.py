"""Mamba2 (the state-space model alone, transformers' `mamba2`): every layer is a pre-norm
Mamba2 mixer (`layers.mamba2`) on the residual stream, with no attention and no MLP; the
final norm is config.json's `norm_f`.

No layer keeps K/V: a sequence's whole past is its state slot's rows (each layer's
convolution window and SSM state), of one size at any context length."""

from dataclasses import dataclass

import torch

from pagefleet_serve.model.config import ModelConfig
from pagefleet_serve.model.layers.mamba2 import Mamba2Mixer
from pagefleet_serve.model.layers.norm import RMSNorm
from pagefleet_serve.model.layers.state import RecurrentDecoderLayer, StateSpec
from pagefleet_serve.model.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class Mamba2Config(ModelConfig):
    # The mixer's: num_heads and head_dim (ModelConfig's) are its SSM heads.
    n_groups: int = 1
    state_size: int = 128
    conv_kernel: int = 4
    chunk_size: int = 256
    use_bias: bool = False
    use_conv_bias: bool = True
    time_step_limit: tuple[float, float] = (0.0, float("inf"))

    @classmethod
    def from_hf(cls, hf: dict, rope_scaling, eos_ids, architecture) -> "ModelConfig":
        # config.json names the SSM's heads `num_heads`, and no MLP.
        hf = {
            "num_attention_heads": hf["num_heads"],
            "intermediate_size": hf["num_heads"] * hf["head_dim"],
            **hf,
        }
        return super().from_hf(hf, rope_scaling, eos_ids, architecture)

    @classmethod
    def family_fields(cls, hf: dict) -> dict:
        return {
            "num_kv_heads": hf["num_heads"],
            "rms_norm_eps": float(hf.get("layer_norm_epsilon", 1e-5)),
            "n_groups": hf.get("n_groups", 1),
            "state_size": hf.get("state_size", 128),
            "conv_kernel": hf.get("conv_kernel", 4),
            "chunk_size": hf.get("chunk_size", 256),
            "use_bias": bool(hf.get("use_bias", False)),
            "use_conv_bias": bool(hf.get("use_conv_bias", True)),
            "time_step_limit": tuple(map(json_float, hf.get("time_step_limit") or (0, "inf"))),
        }


def json_float(value) -> float:
    """A float of config.json: transformers writes infinity as {"__float__": "Infinity"}
    (JSON has no such number)."""
    return float(value["__float__"] if isinstance(value, dict) else value)


class Mamba2Layer(RecurrentDecoderLayer):
    """x + mixer(norm(x)); its cache is its state rows, `attn.state` the step's slots."""

    def __init__(self, config: Mamba2Config, layer: int) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mixer = Mamba2Mixer(
            config.hidden_size,
            config.num_heads,
            config.head_dim,
            config.n_groups,
            config.state_size,
            config.conv_kernel,
            config.chunk_size,
            config.rms_norm_eps,
            config.use_bias,
            config.use_conv_bias,
            config.time_step_limit,
        )

    def state_specs(self) -> tuple[StateSpec, ...]:
        return self.mixer.state_specs()

    def forward(self, x, cos, sin, state, attn) -> torch.Tensor:
        return x + self.mixer(self.norm(x), state, attn.state)


class Mamba2ForCausalLM(LlamaForCausalLM):
    layer_class = Mamba2Layer
    config_class = Mamba2Config
    unsplit_reason = "Mamba2's mixers are not split over tensor-parallel ranks"

    def checkpoint_name(self, name: str) -> str | None:
        name = name.removeprefix("backbone.")
        if name.startswith("embeddings."):
            return "embed_tokens." + name.removeprefix("embeddings.")
        if name.startswith("norm_f."):
            return "norm." + name.removeprefix("norm_f.")
        return super().checkpoint_name(name)
