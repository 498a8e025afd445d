"""A decoder layer's work around its attention as the backend's fused decoder layer
(`KernelBackend.fused_decoder_layer`: the C++ CPU one): two native calls, the ops of
`LlamaDecoderLayer.attention_inputs` and `attention_outputs` in the same order (the same
bits), instead of about ten, each of which costs 5-10 us from Python on a small CPU.

It exists for float32 rows few enough for the quantized layers' own native matmuls (see
`linear_methods.Int4Linear`), when all four matmuls of the layer have one, and for the
layers the kernel implements (`LlamaDecoderLayer.fusable`: a dense MLP, no sandwich norms,
no q/k norms), one rank, float32 norms, not compiled, and a step whose rows read no
adapter.
"""

from typing import Protocol

import torch
from pagefleet_kernels.backend import KernelBackend
from torch import nn

from pagefleet_serve.model.layers.linear_methods import DEQUANTIZE_ROWS_FLOAT32, QuantizedLinear
from pagefleet_serve.model.layers.lora import base_layer, step_adapters


class FusableLayer(Protocol):
    """What the fused kernel reads of a layer (a Llama decoder layer)."""

    fusable: bool
    compiled: bool
    self_attn: nn.Module
    mlp: nn.Module
    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module


class FusedAroundAttention:
    """One layer's fused binding: `attention_inputs(x, cos, sin)` -> q, k, v and
    `attention_outputs(x, attended)` -> the layer's output."""

    def __init__(self, native, adapters) -> None:
        self.native = native
        self.adapters = adapters  # the model's StepAdapters, when its linears have adapters

    def for_rows(self, x: torch.Tensor):
        """The fused layer for rows x, None where they are too many or not float32, or
        where some read an adapter (the fused kernel knows none)."""
        if x.dtype != torch.float32 or x.shape[0] >= DEQUANTIZE_ROWS_FLOAT32:
            return None
        if self.adapters is not None and self.adapters.batch is not None:
            return None
        return self.native


def bind_fused_layer(layer: FusableLayer, backend: KernelBackend) -> FusedAroundAttention | None:
    """The backend's fused layer bound to `layer`'s current weights, None where it has none
    or the layer is not one the kernel computes."""
    fused = backend.fused_decoder_layer
    if fused is None or layer.compiled or not layer.fusable:
        return None
    attn, mlp = layer.self_attn, layer.mlp
    wrapped = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    linears = [base_layer(m) for m in wrapped]
    if any(m.parallel.parallel for m in linears):  # partial sums, all-reduced between ops
        return None
    methods = [m.method for m in linears]
    if not all(isinstance(m, QuantizedLinear) for m in methods):
        return None
    bound = [m.fused_binding() for m in methods]
    norm, post_norm = layer.input_layernorm, layer.post_attention_layernorm
    if None in bound or any(n.weight.dtype != torch.float32 for n in (norm, post_norm)):
        return None
    native = fused.bind_layer(
        norm.weight,
        post_norm.weight,
        norm.eps,
        norm.unit_offset,
        *bound,
        attn.num_heads,
        attn.num_kv_heads,
        attn.head_dim,
        mlp.gelu,
    )
    return FusedAroundAttention(native, step_adapters(wrapped))
