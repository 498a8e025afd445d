"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with a mixture of experts on its
sparse layers; llama.cpp renormalizes its top k."""

from dataclasses import dataclass

from pagefleet_serve.model.layers.moe import MoEConfig
from pagefleet_serve.model.loader.gguf_names import GGUFLayout
from pagefleet_serve.model.models.llama import LlamaForCausalLM
from pagefleet_serve.model.models.mixtral import MoEDecoderLayer
from pagefleet_serve.model.models.qwen2 import QwenSliding
from pagefleet_serve.model.models.qwen3 import Qwen3Attention


@dataclass(frozen=True)
class Qwen3MoeConfig(QwenSliding, MoEConfig):
    pass


class Qwen3MoeDecoderLayer(MoEDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    layer_class = Qwen3MoeDecoderLayer
    config_class = Qwen3MoeConfig
    gguf = GGUFLayout(config=(("norm_topk_prob", True),))
