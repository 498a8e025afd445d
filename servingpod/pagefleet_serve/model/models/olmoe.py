"""OLMoE: a mixture of experts on every layer, whose q and k norms span the whole q and k
projections (not each head), after which q, k and v are clamped to [-clip_qkv,
clip_qkv]."""

from dataclasses import dataclass

import torch

from pagefleet_serve.model.layers.moe import MoEConfig
from pagefleet_serve.model.layers.norm import ShardedRMSNorm
from pagefleet_serve.model.models.llama import LlamaAttention, LlamaForCausalLM
from pagefleet_serve.model.models.mixtral import MoEDecoderLayer


@dataclass(frozen=True)
class OlmoeConfig(MoEConfig):
    clip_qkv: float | None = None

    @classmethod
    def family_fields(cls, hf: dict) -> dict:
        return super().family_fields(hf) | {"clip_qkv": hf.get("clip_qkv")}


class OlmoeAttention(LlamaAttention):
    fusable = False

    def __init__(self, config: OlmoeConfig, layer: int) -> None:
        super().__init__(config, layer)
        q_rows, kv_rows = self.qkv_proj.q_rows, self.qkv_proj.kv_rows
        q_whole, kv_whole = self.qkv_proj.total_q, self.qkv_proj.total_kv
        self.q_norm = ShardedRMSNorm(q_whole, config.rms_norm_eps, q_rows)
        self.k_norm = ShardedRMSNorm(kv_whole, config.rms_norm_eps, kv_rows)
        self.clip_qkv = config.clip_qkv

    def normalize_qk(self, qkv: torch.Tensor, qk: torch.Tensor, v: torch.Tensor):
        q_size, kv_size = self.q_size, self.kv_size
        q = self.q_norm(qkv[:, :q_size])
        k = self.k_norm(qkv[:, q_size : q_size + kv_size])
        qk = torch.cat((q, k), dim=1).view_as(qk)
        if self.clip_qkv is not None:
            qk, v = qk.clamp(-self.clip_qkv, self.clip_qkv), v.clamp(-self.clip_qkv, self.clip_qkv)
        return qk, v


class OlmoeDecoderLayer(MoEDecoderLayer):
    attention_class = OlmoeAttention


class OlmoeForCausalLM(LlamaForCausalLM):
    layer_class = OlmoeDecoderLayer
    config_class = OlmoeConfig
    whole_qk_norm = True
