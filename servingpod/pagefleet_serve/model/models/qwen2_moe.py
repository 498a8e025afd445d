"""Qwen2-MoE (Qwen1.5-MoE): Qwen2's attention (q/k/v biased unless the config says
otherwise) and a mixture whose every token also runs a shared expert, scaled by
sigmoid(its gate); the router's top k never renormalized by llama.cpp."""

from dataclasses import dataclass

import torch
from torch import nn

from pagefleet_serve.model.layers.linear import ReplicatedLinear
from pagefleet_serve.model.layers.moe import MoEBlock, MoEConfig
from pagefleet_serve.model.loader.gguf_names import GGUFLayout
from pagefleet_serve.model.models.llama import LlamaForCausalLM, LlamaMLP
from pagefleet_serve.model.models.mixtral import MoEDecoderLayer
from pagefleet_serve.model.models.qwen2 import QwenSliding


@dataclass(frozen=True)
class Qwen2MoeConfig(QwenSliding, MoEConfig):
    shared_expert_intermediate_size: int = 0  # 0: none

    @classmethod
    def family_fields(cls, hf: dict) -> dict:
        return super().family_fields(hf) | {
            "qkv_bias": bool(hf.get("qkv_bias", True)),
            "o_bias": False,
            "shared_expert_intermediate_size": hf.get("shared_expert_intermediate_size") or 0,
        }


class SharedExpertMoEBlock(MoEBlock):
    def __init__(self, config: Qwen2MoeConfig) -> None:
        super().__init__(config)
        self.shared_expert: LlamaMLP | None = None
        if config.shared_expert_intermediate_size:
            size = config.shared_expert_intermediate_size
            # Its output joins the experts' partial sum, all-reduced once with it.
            self.shared_expert = LlamaMLP(config, size, reduce_results=False)
            self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1)

    def partial_output(self, x: torch.Tensor) -> torch.Tensor:
        y = super().partial_output(x)
        if self.shared_expert is None:
            return y
        return y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen2MoeDecoderLayer(MoEDecoderLayer):
    def make_experts(self, config: Qwen2MoeConfig) -> nn.Module:
        return SharedExpertMoEBlock(config)


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    layer_class = Qwen2MoeDecoderLayer
    config_class = Qwen2MoeConfig
    gguf = GGUFLayout()
