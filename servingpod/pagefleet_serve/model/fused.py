"""A decoder layer's work around its attention as the backend's fused decoder layer
(`KernelBackend.fused_decoder_layer`: the C++ CPU one): two native calls, the ops of
`LlamaDecoderLayer.attention_inputs` and `attention_outputs` in the same order (the same
bits), instead of about ten, each of which costs 5-10 us from Python on a small CPU.

It exists for float32 rows few enough for the quantized layers' own native matmuls (see
`linear.Int4Linear`), when all four matmuls of the layer have one, and for the layers the
kernel implements: no sandwich norms, no q/k norms, float32 norms, not compiled.
"""

from typing import TYPE_CHECKING

import torch
from pagefleet_kernels.backend import KernelBackend

from pagefleet_serve.model.linear import DEQUANTIZE_ROWS_FLOAT32, QuantizedLinear

if TYPE_CHECKING:
    from pagefleet_serve.model.llama import LlamaDecoderLayer


class FusedAroundAttention:
    """One layer's fused binding: `attention_inputs(x, cos, sin)` -> q, k, v and
    `attention_outputs(x, attended)` -> the layer's output."""

    def __init__(self, native) -> None:
        self.native = native

    def for_rows(self, x: torch.Tensor):
        """The fused layer for rows x, None where they are too many or not float32."""
        if x.dtype != torch.float32 or x.shape[0] >= DEQUANTIZE_ROWS_FLOAT32:
            return None
        return self.native


def bind_fused_layer(
    layer: "LlamaDecoderLayer", backend: KernelBackend
) -> FusedAroundAttention | None:
    """The backend's fused layer bound to `layer`'s current weights, None where it has none
    or the layer is not one the kernel computes."""
    fused = backend.fused_decoder_layer
    attn, mlp = layer.self_attn, layer.mlp
    if fused is None or layer.compiled or layer.sandwich_norms or attn.qk_norm:
        return None
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if not all(isinstance(m, QuantizedLinear) for m in linears):
        return None
    bound = [m.fused_binding() for m in linears]
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
    return FusedAroundAttention(native)
