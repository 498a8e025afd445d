"""Llama (and Mistral, which is Llama with a sliding window): pre-norm decoder layers of
grouped-query attention with rotary positions and a SwiGLU MLP.

The other families build on these parts: their attention adds a q/k norm or a scale
(`normalize_qk`, `attention_options`), their layer a different MLP (`make_mlp`) or norms.
q/k/v and gate/up are each one fused matmul; the checkpoint's separate projections load
into their parts (`CausalLM.stacked_params_mapping`), a checkpoint that holds them fused
already (Phi-3) into the whole.
"""

import torch
from torch import nn

from pagefleet_serve.model.causal_lm import CausalLM
from pagefleet_serve.model.config import ModelConfig
from pagefleet_serve.model.context import current_context
from pagefleet_serve.model.layers.activation import is_gelu
from pagefleet_serve.model.layers.attention import Attention
from pagefleet_serve.model.layers.fused import FusedAroundAttention
from pagefleet_serve.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagefleet_serve.model.layers.linear_methods import prepare_for_compile
from pagefleet_serve.model.layers.norm import RMSNorm
from pagefleet_serve.model.layers.state import StateSpec
from pagefleet_serve.model.loader.gguf_names import GGUFLayout


class LlamaAttention(nn.Module):
    # Whether the backend's fused decoder layer computes this attention's projections.
    fusable = True
    # Whether q and k turn by their positions (Granite 4.0-H's and Nemotron-H's attention
    # has no positions of its own: the recurrent layers before it order the tokens).
    rotary = True

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.backend = current_context().backend
        self.head_dim = d = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, d, config.num_heads, config.num_kv_heads, config.qkv_bias
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            config.num_heads * d,
            config.hidden_size,
            bias=config.o_bias,
            input_heads=(config.num_heads, config.num_kv_heads, d),
        )
        options = {"scale": d**-0.5, "sliding_window": config.layer_sliding_window(layer)}
        options |= self.attention_options(config)
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, **options)

    def attention_options(self, config: ModelConfig) -> dict:
        """The family's own arguments of its `Attention` (scale, softcap, sinks)."""
        return {}

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q, k, v (T, heads, D) of the normed hidden states: projected, q/k-normed,
        rotated."""
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.q_size, self.kv_size
        qk = qkv[:, : q_size + kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        qk, v = self.normalize_qk(qkv, qk, v)
        # q and k side by side: rotated in one pass, then split (views).
        if self.rotary:
            qk = self.backend.rope(qk, cos, sin)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        return q, k, v

    def normalize_qk(self, qkv: torch.Tensor, qk: torch.Tensor, v: torch.Tensor):
        """q/k (T, heads, D) and v before rope: a family's norms or clamps."""
        return qk, v


class LlamaMLP(nn.Module):
    def __init__(
        self, config: ModelConfig, intermediate_size: int | None = None, reduce_results=True
    ) -> None:
        super().__init__()
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, size)
        self.down_proj = RowParallelLinear(size, config.hidden_size, reduce_results=reduce_results)
        self.gelu = is_gelu(config.hidden_act)
        self.act_and_mul = current_context().backend.act_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x), self.gelu))


class LlamaDecoderLayer(nn.Module):
    attention_class: type[LlamaAttention] = LlamaAttention

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = self.make_norm(config)
        self.self_attn = self.attention_class(config, layer)
        self.post_attention_layernorm = self.make_norm(config)
        self.mlp = self.make_mlp(config, layer)

    keeps_kv = True  # its attention's K/V, in the paged cache

    # The backend's fused form of the work around attention, bound to this layer's weights
    # (see layers.fused); None: the ops run one by one.
    fused: FusedAroundAttention | None = None
    compiled = False

    @property
    def fusable(self) -> bool:
        """Whether the fused kernel computes this layer: a dense MLP and plain attention."""
        return self.self_attn.fusable and isinstance(self.mlp, LlamaMLP)

    def make_norm(self, config: ModelConfig) -> RMSNorm:
        return RMSNorm(config.hidden_size, config.rms_norm_eps)

    def state_specs(self) -> tuple[StateSpec, ...]:
        """Nothing: an attention layer keeps its cache in the paged KV (`CausalLM.state_specs`)."""
        return ()

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        return LlamaMLP(config)

    def forward(self, x, cos, sin, kv_cache, attn) -> torch.Tensor:
        # The fused layer's `attention_inputs` and `attention_outputs` compute what this
        # layer's do, for the rows it takes.
        fused = self.fused
        around = (fused is not None and fused.for_rows(x)) or self
        q, k, v = around.attention_inputs(x, cos, sin)
        return around.attention_outputs(x, self.self_attn.attn(q, k, v, kv_cache, attn))

    # The layer around its attention: pure tensor functions, what compile_around_attention
    # compiles.
    def attention_inputs(self, x, cos, sin):
        return self.self_attn.project(self.input_layernorm(x), cos, sin)

    def attention_outputs(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        x, normed = self.post_attention_layernorm.add(x, self.self_attn.o_proj(attended))
        return x + self.mlp(normed)

    def compile_around_attention(self) -> None:
        """Compile the parts around attention with inductor (each into a few fused
        kernels); attention itself stays eager, it reads per-step metadata. Every layer
        shares the compiled code (the modules' weights are its inputs)."""
        prepare_for_compile(self)
        self.attention_inputs = torch.compile(self.attention_inputs, dynamic=None)
        self.attention_outputs = torch.compile(self.attention_outputs, dynamic=None)
        self.compiled, self.fused = True, None


class LlamaForCausalLM(CausalLM):
    layer_class = LlamaDecoderLayer
    config_class = ModelConfig
    # llama.cpp interleaves q/k rows for its GPT-J style rope (undone at load), and writes
    # Mixtral as `llama`.
    gguf = GGUFLayout(permuted_qk=True, with_experts="MixtralForCausalLM")
