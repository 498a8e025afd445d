"""Gemma 2: norms that scale by (1 + weight) in float32, around both sublayers (the norm of
the attention output, and two more around the MLP: sandwich norms), GeGLU, embeddings
scaled by sqrt(hidden_size), queries scaled by `query_pre_attn_scalar`, and attention and
final logits soft-capped (cap * tanh(x / cap)); sliding-window layers alternate with
global ones."""

from dataclasses import dataclass

import torch

from pagefleet_serve.model.config import ModelConfig
from pagefleet_serve.model.layers.norm import RMSNorm
from pagefleet_serve.model.loader.gguf_names import GGUFLayout
from pagefleet_serve.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

# llama.cpp's names of Gemma's extra norms.
GEMMA_NORMS = (
    ("post_attention_norm", "post_attention_layernorm"),
    ("ffn_norm", "pre_feedforward_layernorm"),
    ("post_ffw_norm", "post_feedforward_layernorm"),
)


@dataclass(frozen=True)
class Gemma2Config(ModelConfig):
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this); None: head_dim
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    # The sliding layers' period in configs older than `layer_types`.
    default_sliding_period = 2

    @classmethod
    def family_fields(cls, hf: dict) -> dict:
        return {
            "hidden_act": hf.get("hidden_activation") or "gelu_pytorch_tanh",
            "query_pre_attn_scalar": hf.get("query_pre_attn_scalar"),
            "attn_logit_softcapping": hf.get("attn_logit_softcapping"),
            "final_logit_softcapping": hf.get("final_logit_softcapping"),
        }

    @classmethod
    def sliding_layer_types(cls, hf: dict) -> list[str]:
        period = hf.get("sliding_window_pattern", cls.default_sliding_period)
        kinds = ("full_attention", "sliding_attention")
        return [kinds[bool((i + 1) % period)] for i in range(hf["num_hidden_layers"])]


def gemma_norm(size: int, config: ModelConfig) -> RMSNorm:
    return RMSNorm(size, config.rms_norm_eps, unit_offset=True)


class Gemma2Attention(LlamaAttention):
    def attention_options(self, config: Gemma2Config) -> dict:
        return {
            "scale": (config.query_pre_attn_scalar or config.head_dim) ** -0.5,
            "softcap": config.attn_logit_softcapping,
        }


class Gemma2DecoderLayer(LlamaDecoderLayer):
    """`post_attention_layernorm` norms the attention output (Hugging Face's names), then
    two more norms surround the MLP."""

    attention_class = Gemma2Attention
    fusable = False  # type: ignore[assignment]

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer)
        self.pre_feedforward_layernorm = self.make_norm(config)
        self.post_feedforward_layernorm = self.make_norm(config)

    def make_norm(self, config: ModelConfig) -> RMSNorm:
        return gemma_norm(config.hidden_size, config)

    def attention_outputs(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        h = self.post_attention_layernorm(self.self_attn.o_proj(attended))
        x, normed = self.pre_feedforward_layernorm.add(x, h)
        return x + self.post_feedforward_layernorm(self.mlp(normed))


class Gemma2ForCausalLM(LlamaForCausalLM):
    layer_class = Gemma2DecoderLayer
    config_class = Gemma2Config
    gguf = GGUFLayout(norm_offset=1.0, tensors=GEMMA_NORMS, query_scale_by_hidden_layers=46)

    def make_norm(self, size: int) -> RMSNorm:
        return gemma_norm(size, self.config)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # The factor rounded to the dtype, as Gemma does.
        return x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if logits is None or cap is None else torch.tanh(logits / cap) * cap
