"""A decoder layer's elementwise work around its matmuls, in eager PyTorch: the ground truth
and the implementation on every device without a native one. `cpu_layer_ops` computes the
same in one C++ pass each, `triton_layer_ops` in one Triton kernel each (the same bits, the
norm's reduction order and the activations' exponential aside).

They are the torch backend's layer ops (`backend.torch_backend`), so that backend stays
pure PyTorch end to end.
"""

import torch
import torch.nn.functional as F

__all__ = [
    "act_and_mul",
    "add_rms_norm",
    "dequantize_int4",
    "quantize_activations_int8",
    "rms_norm",
    "rope",
]


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> torch.Tensor:
    """x (rows, n) normalized in float32, then, as Hugging Face does, cast back to x's dtype
    before the weight multiplies it; Gemma's (1 + weight) is applied in float32."""
    normed = F.rms_norm(x.float(), weight.shape, eps=eps)
    if unit_offset:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream plus a layer's output, and that sum normalized."""
    x = x + h
    return x, rms_norm(x, weight, eps, unit_offset)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, H, D); cos (T, D); sin (T, D) with its first half negated (as the model's
    `_rope` makes it), so that Hugging Face's rotate-half, cat(-x2, x1) * sin, is one roll
    times it: the same products exactly (a negation rounds nothing), in two fewer ops."""
    rotated = x.roll(x.shape[-1] // 2, dims=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def act_and_mul(gate_up: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """gate_up (T, 2I) = [gate | up] -> act(gate) * up: SiLU, or GELU with the tanh
    approximation (Gemma)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
    return gate * up


def dequantize_int4(
    nibbles: list[torch.Tensor], scales_and_zeros: list[torch.Tensor], group_size: int
) -> torch.Tensor:
    """The (N, K) matrix, in the scales' dtype, of one or more 4-bit parts summed (a Q8_0
    matrix is two). A part's codes are nibbles (N, K / 2): in each group, byte j holds input
    j in its low nibble and input j + group / 2 in its high one (GGUF's order); its scales
    and zeros are (K / group, N, 2), as PyTorch's int4 matmul takes them.
    w = (code - 8) * scale + zero, in float32, rounded once."""
    total = None
    for packed, sz in zip(nibbles, scales_and_zeros, strict=True):
        halves = packed.view(packed.shape[0], -1, group_size // 2)
        codes = torch.cat((halves & 0x0F, halves >> 4), dim=-1)  # (N, K / group, group)
        scale, zero = sz.float().permute(1, 0, 2).unbind(-1)  # (N, K / group) each
        part = ((codes.float() - 8.0) * scale[..., None] + zero[..., None]).flatten(1)
        total = part if total is None else total + part
    return total.to(scales_and_zeros[0].dtype)


def quantize_activations_int8(x: torch.Tensor, group_size: int = 32) -> torch.Tensor:
    """x (float32) with each group of `group_size` consecutive inputs rounded to int8 codes
    under one scale, returned as code * scale (x^): d = max |x| / 127, code = round(x * (1 /
    d)) to nearest even (0 where d is 0). llama.cpp rounds the activations of its Q4/Q8
    matmuls the same way (its Q8_0/Q8_1 blocks); the C++ 4-bit matmul computes the same
    codes and multiplies them with integer dot products."""
    groups = x.view(*x.shape[:-1], -1, group_size)
    scale = groups.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale != 0, 1 / scale, torch.zeros_like(scale))
    return (torch.round(groups * inverse) * scale).view_as(x)
