"""Mixtral: Llama's layers with a mixture of experts in place of every MLP, the router's
top k always renormalized. Its checkpoints name the experts `block_sparse_moe.experts.{e}.
w1/w2/w3` (gate, down, up); transformers' later layout (`mlp.experts...`) loads alike.

`MoEDecoderLayer` is the decoder layer of every mixture family: the experts on its sparse
layers (`MoEConfig.layer_is_sparse`), a dense MLP on the others."""

import re
from dataclasses import dataclass

from torch import nn

from pagefleet_serve.model.layers.moe import MoEBlock, MoEConfig
from pagefleet_serve.model.loader.gguf_names import GGUFLayout
from pagefleet_serve.model.models.llama import LlamaDecoderLayer, LlamaForCausalLM

_EXPERT = re.compile(r"\.experts\.(\d+)\.w([123])\.")
_PROJECTIONS = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


@dataclass(frozen=True)
class MixtralConfig(MoEConfig):
    @classmethod
    def family_fields(cls, hf: dict) -> dict:
        return super().family_fields(hf) | {"norm_topk_prob": True}


class MoEDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: MoEConfig, layer: int) -> nn.Module:
        if config.layer_is_sparse(layer):
            return self.make_experts(config)
        return super().make_mlp(config, layer)

    def make_experts(self, config: MoEConfig) -> nn.Module:
        return MoEBlock(config)


class MixtralForCausalLM(LlamaForCausalLM):
    layer_class = MoEDecoderLayer
    config_class = MixtralConfig
    gguf = GGUFLayout(permuted_qk=True)

    def checkpoint_name(self, name: str) -> str | None:
        name = super().checkpoint_name(name)
        if name is None:
            return None
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return _EXPERT.sub(lambda m: f".experts.{m[1]}.{_PROJECTIONS[m[2]]}.", name)
