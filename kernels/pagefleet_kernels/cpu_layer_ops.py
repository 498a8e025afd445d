"""`layer_ops` in C++ on the CPU (`csrc/layer_ops_cpu.cpp`): each op one pass over its rows
instead of 4-8 eager ops and their dispatch, which at decode batch 1 cost more than the
arithmetic. The results are the eager ops' bits (the norm's sum of squares aside: its order
of addition differs, a float32 rounding).

Falls back to `layer_ops` when the extension was not built for this CPU, for tensors off
the CPU, and inside torch.compile, which traces (and fuses) the eager ops instead.
"""

import torch

from pagefleet_kernels import layer_ops, lora_ops
from pagefleet_kernels.cpu_build import load_extension
from pagefleet_kernels.metadata import LoRAMapping

__all__ = [
    "act_and_mul",
    "add_lora",
    "add_rms_norm",
    "available",
    "decoder_layer",
    "dequantize_int4",
    "int4_matmul",
    "int8_matmul",
    "linear",
    "quantize_activations_int8",
    "quantized_linear",
    "rms_norm",
    "rope",
    "scales_and_shifts",
]

_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _extension():
    return load_extension("pagefleet_layer_ops_cpu")


def available() -> bool:
    return _extension() is not None


def _native(x: torch.Tensor):
    """The extension when it can take x, else None."""
    if x.device.type != "cpu" or x.dtype not in _NATIVE_DTYPES or torch.compiler.is_compiling():
        return None
    return _extension()


def rms_norm(x, weight, eps: float, unit_offset: bool = False):
    ext = _native(x)
    if ext is None or x.dim() != 2 or x.stride(-1) != 1:
        return layer_ops.rms_norm(x, weight, eps, unit_offset)
    return ext.rms_norm(x, weight, eps, unit_offset)


def add_rms_norm(x, h, weight, eps: float, unit_offset: bool = False):
    ext = _native(x)
    if ext is None or x.dim() != 2 or x.stride(-1) != 1 or h.stride(-1) != 1:
        return layer_ops.add_rms_norm(x, h, weight, eps, unit_offset)
    return tuple(ext.add_rms_norm(x, h, weight, eps, unit_offset))


def rope(x, cos, sin):
    ext = _native(x)
    if ext is None or x.stride(-1) != 1:
        return layer_ops.rope(x, cos, sin)
    return ext.rope(x, cos, sin)


def act_and_mul(gate_up, gelu: bool = False):
    ext = _native(gate_up)
    if ext is None or gate_up.dim() != 2 or gate_up.stride(-1) != 1:
        return layer_ops.act_and_mul(gate_up, gelu)
    return ext.act_and_mul(gate_up, gelu)


def dequantize_int4(nibbles, scales_and_zeros, group_size: int):
    ext = _native(scales_and_zeros[0])
    if ext is None:
        return layer_ops.dequantize_int4(nibbles, scales_and_zeros, group_size)
    return ext.dequantize_int4(list(nibbles), list(scales_and_zeros), group_size)


def int4_matmul(x, nibbles, scales_and_shifts, group_size: int, int8_activations: bool = False):
    """x (M, K) times the transpose of a 4-bit weight given as parts, summed in float32,
    returned in x's dtype; None when the extension cannot take x (the caller then
    multiplies another way). A part: its codes as nibbles (see `dequantize_int4`) and each
    output row's float32 (scale, shift) per group, (N, K / group, 2): w = code * scale +
    shift (`scales_and_shifts` turns PyTorch's layout into it). `int8_activations`: x^ (see
    `quantize_activations_int8`) times the weight, with integer dot products."""
    ext = _native(x)
    if ext is None or x.dim() != 2 or x.stride(-1) != 1:
        return None
    return ext.int4_matmul(x, list(nibbles), list(scales_and_shifts), group_size, int8_activations)


def int8_matmul(x, codes, scales, group_size: int, int8_activations: bool = False):
    """x (M, K) times the transpose of W given as int8 codes (N, K) with one float32 scale
    per group of inputs, (N, K / group) (GGUF's Q8_0: w = code * scale), in float32, returned
    in x's dtype; None when the extension cannot take x. `int8_activations` as for
    `int4_matmul`."""
    ext = _native(x)
    if ext is None or x.dim() != 2 or x.stride(-1) != 1:
        return None
    return ext.int8_matmul(x, codes, scales, group_size, int8_activations)


def scales_and_shifts(scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """PyTorch's int4 scales and zeros, (K / group, N, 2) for w = (code - 8) * scale + zero,
    as `int4_matmul` reads them: (N, K / group, 2) float32 for w = code * scale + shift."""
    scale, zero = scales_and_zeros.float().unbind(-1)
    return torch.stack((scale, zero - 8 * scale), dim=-1).transpose(0, 1).contiguous()


def quantize_activations_int8(x, group_size: int = 32):
    ext = _native(x)
    if ext is None or x.dtype != torch.float32 or x.dim() != 2 or group_size != 32:
        return layer_ops.quantize_activations_int8(x, group_size)
    return ext.quantize_activations_int8(x)


def linear(x, weight):
    """x (M, K) times the transpose of a float32 weight (N, K) as it lies, for a few rows
    (weight-bandwidth-bound: see `pagefleet_serve.model.linear.PrepackedLinear`); None when
    the extension cannot take them (the caller then multiplies another way)."""
    ext = _native(x)
    if ext is None or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return None
    if x.dim() != 2 or x.stride(-1) != 1 or not weight.is_contiguous():
        return None
    return ext.linear(x, weight)


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    mapping: LoRAMapping,
    parts: tuple[int, ...] = (),
) -> None:
    """`lora_ops.add_lora` in one call for float32 (a step calls it four times a layer, and
    the eager form's gathers, two matmuls and scatter cost more than their arithmetic at
    decode sizes): each rank row of a slot's A and each output row of its B read once for
    all of the slot's rows, and B's zeros outside the blocks of `parts` not read. Other
    dtypes go to `lora_ops.add_lora_padded`."""
    ext = _native(y)
    tensors = (y, x, lora_a, lora_b)
    if (
        ext is None
        or any(t.dtype != torch.float32 or t.device != y.device for t in tensors)
        or y.stride(-1) != 1
        or x.stride(-1) != 1
        or not (lora_a.is_contiguous() and lora_b.is_contiguous())
    ):
        lora_ops.add_lora_padded(y, x, lora_a, lora_b, mapping)
        return
    ext.add_lora(y, x, lora_a, lora_b, mapping.token_slots, list(parts))


def quantized_linear(
    *,
    nibbles=(),
    scales_and_shifts=(),
    codes=None,
    scales=None,
    bias=None,
    group_size: int,
    int8_activations: bool = False,
):
    """A quantized linear layer bound once for `decoder_layer`: 4-bit parts (the arguments
    of `int4_matmul`) or Q8_0 codes with their scales (those of `int8_matmul`), and a bias
    added after the product; None when the extension cannot be built."""
    ext = _extension()
    if ext is None:
        return None
    return ext.QuantizedLinear(
        list(nibbles), list(scales_and_shifts), codes, scales, bias, group_size, int8_activations
    )


def decoder_layer(
    input_norm,
    post_attention_norm,
    eps: float,
    unit_offset: bool,
    qkv,
    o,
    gate_up,
    down,
    heads: int,
    kv_heads: int,
    head_dim: int,
    gelu: bool,
):
    """A decoder layer's work around its attention as two C++ calls, for float32 rows whose
    four matmuls are `quantized_linear` bindings: `attention_inputs(x, cos, sin)` -> q, k, v
    and `attention_outputs(x, attended)` -> the layer's output, each the ops of
    `LlamaDecoderLayer`'s methods of those names in the same order (the same bits). None
    when the extension cannot be built."""
    ext = _extension()
    if ext is None:
        return None
    return ext.DecoderLayer(
        input_norm,
        post_attention_norm,
        eps,
        unit_offset,
        qkv,
        o,
        gate_up,
        down,
        heads,
        kv_heads,
        head_dim,
        gelu,
    )
