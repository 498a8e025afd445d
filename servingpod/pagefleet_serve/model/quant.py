"""Weights kept quantized: GGUF's Q4_0/Q4_1/Q8_0 blocks and int8 weight-only, multiplied
as they are stored.

A `QuantizedWeight` is what the loader hands over in place of a float matrix: integer
codes (out_features, in_features) with float scales and zero points per group of
`group_size` consecutive inputs of one output row. The model fuses q/k/v and gate/up by
concatenating rows (`cat_rows`), then `QuantizedLinear` packs the codes for PyTorch's
weight-only CPU kernels:

- 4-bit codes (Q4_0, Q4_1): `torch._weight_int4pack_mm_for_cpu`, groups of 32, which
  computes with w = (code - 8) * scale + zero. Q4_1 stores w = code * d + m, so
  scale = d and zero = m + 8 * d; Q4_0 stores w = (code - 8) * d, so zero = 0.
- 8-bit codes with one scale per output row (int8 weight-only): `torch._weight_int8pack_mm`.
- 8-bit codes with a scale per 32 inputs (Q8_0) fit neither directly; a code c in
  [-128, 127] is 16 * hi + lo with hi in [-8, 7] and lo in [0, 15], so the matrix is the sum
  of two 4-bit matrices: hi with scale 16 * d and zero 0, lo with scale d and zero 8 * d.
  Two int4 products read one byte per weight, as int8 would, and compute with the exact
  weights.

Every weight is exactly what dequantizing the GGUF gives (the scales are float16 values,
held in float32); only the order of the additions differs from a float matmul.
"""

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from pagefleet_kernels import layer_ops
from torch import nn

# From this many rows on, 4-bit weights are dequantized and multiplied as float (see
# QuantizedLinear). PyTorch's int4 matmul against dequantize + matmul, bfloat16, two threads
# (int4 / dequantized, ms): a 3072 x 576 Q4_1 matrix 0.79 / 0.84 at 32 rows, 1.69 / 1.28 at
# 64, 68.9 / 24.1 at 2,048; SmolLM2's 49152 x 576 Q8_0 head 30.3 / 47.7 at 32, 70.2 / 48.5
# at 64, 1,864 / 429 at 2,048.
DEQUANTIZE_ROWS = 64
# The same for float32 activations, which torch's int4 matmul takes through a scalar path
# (a 1536 x 576 matrix at one row: 1,129 us against 75 in bfloat16 on an AVX2 machine; 67
# ms at 64 rows). They go to the backend's own `int4_matmul` when it has one (the C++ CPU
# ops: 57 us there, 1.3x faster than the float32 matrix at one row, even at eight) and
# are dequantized from this many rows on, where oneDNN's float GEMM pulls ahead (0.8 ms
# against 0.4 at 32 rows).
DEQUANTIZE_ROWS_FLOAT32 = 16
QUANTIZATIONS = ("auto", "none", "int8")  # auto: a GGUF's own; none: expand; int8: per row
GGUF_GROUP = 32  # weights per Q4_0/Q4_1/Q8_0 block
INT4_OFFSET = 8  # the int4 kernel's implicit zero code


@dataclass
class QuantizedWeight:
    """codes (N, K): uint8 in [0, 15] (bits 4) or int8 (bits 8); scale, zero (N, K / group)
    float32, zero None when w = code * scale."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    bits: int
    group_size: int

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix these codes stand for (what a float model would load)."""
        codes = self.codes.float()
        if self.bits == 4:
            codes = codes - INT4_OFFSET
        scale = self.scale.repeat_interleave(self.group_size, dim=1)
        w = codes * scale
        if self.zero is not None:
            w = w + self.zero.repeat_interleave(self.group_size, dim=1)
        return w

    @staticmethod
    def cat_rows(parts: list["QuantizedWeight"]) -> "QuantizedWeight":
        """The row-wise concatenation (fused q/k/v, gate/up) of weights quantized alike."""
        first = parts[0]
        kinds = {(p.bits, p.group_size, p.zero is None) for p in parts}
        if len(kinds) > 1:
            raise ValueError(f"cannot fuse weights quantized differently: {sorted(kinds)}")
        zero = None if first.zero is None else torch.cat([p.zero for p in parts])
        return QuantizedWeight(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scale for p in parts]),
            zero,
            first.bits,
            first.group_size,
        )

    def permute_rows(self, index: np.ndarray) -> "QuantizedWeight":
        index = torch.from_numpy(index)
        zero = None if self.zero is None else self.zero[index]
        return QuantizedWeight(
            self.codes[index], self.scale[index], zero, self.bits, self.group_size
        )


# -- GGUF blocks -> codes and scales -------------------------------------------------------
def _f16(blocks: np.ndarray, start: int) -> torch.Tensor:
    """The float16 at byte `start` of every block, as float32 (exact)."""
    return torch.from_numpy(blocks[..., start : start + 2].copy().view(np.float16)[..., 0]).float()


def _nibbles(qs: np.ndarray) -> torch.Tensor:
    """16 bytes per block -> 32 codes: the low nibbles are weights 0-15, the high 16-31."""
    qs = torch.from_numpy(qs.copy())
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def from_gguf(data: np.ndarray, type_name: str) -> QuantizedWeight:
    """A GGUF tensor's raw blocks, (N, K / 32 * block bytes) uint8, as a QuantizedWeight."""
    rows = data.shape[0]
    if type_name == "Q4_0":  # d (f16), 16 bytes of nibbles; w = (q - 8) * d
        blocks = data.reshape(rows, -1, 18)
        codes, scale, zero = _nibbles(blocks[..., 2:]), _f16(blocks, 0), None
    elif type_name == "Q4_1":  # d, m (f16), 16 bytes of nibbles; w = q * d + m
        blocks = data.reshape(rows, -1, 20)
        scale, minimum = _f16(blocks, 0), _f16(blocks, 2)
        codes, zero = _nibbles(blocks[..., 4:]), minimum + INT4_OFFSET * scale
    elif type_name == "Q8_0":  # d (f16), 32 int8; w = q * d
        blocks = data.reshape(rows, -1, 34)
        scale, zero = _f16(blocks, 0), None
        codes = torch.from_numpy(blocks[..., 2:].copy().view(np.int8))
        return QuantizedWeight(codes.reshape(rows, -1), scale, zero, 8, GGUF_GROUP)
    else:
        raise ValueError(f"GGUF type {type_name} is not kept quantized (Q4_0, Q4_1, Q8_0 are)")
    return QuantizedWeight(codes.reshape(rows, -1), scale, zero, 4, GGUF_GROUP)


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric int8 with one scale per output row (weight-only, round to nearest)."""
    w = weight.float()
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0
    codes = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight(codes, scale, None, 8, w.shape[1])


# -- the layer ----------------------------------------------------------------------------
def _pack_int4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int):
    """uint8 codes in [0, 15] (N, K) -> the CPU kernel's packed matrix, its (K / group, N, 2)
    scales and zeros, and the codes as nibbles (N, K / 2) for `dequantize_int4` (in each
    group, byte j holds input j low and input j + group / 2 high)."""
    packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    zero = torch.zeros_like(scale) if zero is None else zero
    halves = codes.view(codes.shape[0], -1, group).split(group // 2, dim=-1)
    nibbles = (halves[0] | (halves[1] << 4)).flatten(1).contiguous()
    return packed, torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous(), nibbles


class QuantizedLinear(nn.Module):
    """y = x W^T (+ bias) with W kept in its quantized form (CPU only).

    PyTorch's int4 matmul reads the packed weight directly, which at a decode step's few
    rows is what makes 4-bit weights fast (a 3072 x 576 matrix at one row: 51 us against 112
    for bfloat16), but from 64 rows up it runs 2.2-2.5x slower than a bfloat16 matmul. From
    `DEQUANTIZE_ROWS` rows on (a prefill chunk, a wide decode batch), the 4-bit weight is
    therefore dequantized into the activations' dtype (`pagefleet_kernels.layer_ops.
    dequantize_int4`, one C++ pass on the CPU backend) and multiplied as a float matrix.
    That keeps the codes a second time as plain nibbles: 4-bit weights take one byte per
    weight instead of half a byte, still half of bfloat16's. Float32 rows, which PyTorch's
    int4 matmul takes through a slow scalar path, go to the backend's own `int4_matmul` (the
    C++ CPU ops) below `DEQUANTIZE_ROWS_FLOAT32` rows instead.

    With `int8_activations` every product of the 4-bit weight takes x^, the activations
    rounded to int8 with one scale per 32 inputs (`layer_ops.quantize_activations_int8`),
    instead of x: the C++ matmul then multiplies the codes with integer dot products (as
    llama.cpp's Q4 x Q8 kernels do), 1.4-1.7x faster than converting each weight to float,
    and the other paths (wide batches, other backends) round x first, so every batch size
    computes with the same x^."""

    int8_activations = False
    _native: tuple | None = None  # see _native_int4

    def __init__(
        self, weight: QuantizedWeight, bias: torch.Tensor | None = None, ops=layer_ops
    ) -> None:
        super().__init__()
        self.ops = ops  # the backend's layer ops, for dequantize_int4
        self.out_features, self.in_features = weight.shape
        self.group_size = weight.group_size
        # 4-bit parts, each (packed codes, scales and zeros, nibbles); a Q8_0 matrix is two.
        parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        if weight.bits == 4:
            parts.append(_pack_int4(weight.codes, weight.scale, weight.zero, self.group_size))
        elif weight.group_size != self.in_features:  # int8 codes per group (Q8_0)
            codes = weight.codes.to(torch.int16)
            hi, lo = torch.div(codes, 16, rounding_mode="floor"), codes % 16
            parts.append(
                _pack_int4(
                    (hi + INT4_OFFSET).to(torch.uint8), 16 * weight.scale, None, self.group_size
                )
            )
            parts.append(
                _pack_int4(
                    lo.to(torch.uint8), weight.scale, INT4_OFFSET * weight.scale, self.group_size
                )
            )
        self.num_int4_parts = len(parts)
        # Buffers, not parameters, and not in the state dict: built from the checkpoint's
        # codes at load, never loaded by name. The backend's own matmul (where it has one)
        # reads each output row's (scale, shift) pairs side by side: scales_and_shifts_i.
        own_layout = getattr(ops, "scales_and_shifts", None)
        for i, (packed, scales_and_zeros, nibbles) in enumerate(parts):
            self.register_buffer(f"packed_{i}", packed, persistent=False)
            self.register_buffer(f"scales_and_zeros_{i}", scales_and_zeros, persistent=False)
            self.register_buffer(f"nibbles_{i}", nibbles, persistent=False)
            if own_layout is not None:
                shifts = own_layout(scales_and_zeros)
                self.register_buffer(f"scales_and_shifts_{i}", shifts, persistent=False)
        if weight.bits == 8 and parts and getattr(ops, "int8_matmul", None) is not None:
            # The backend's own matmul takes Q8_0's codes as they are: a group's 32 codes
            # at once, instead of the two 4-bit parts (one byte per weight more).
            self.register_buffer("group_codes", weight.codes.contiguous(), persistent=False)
            self.register_buffer("group_scales", weight.scale.contiguous(), persistent=False)
        if not parts:  # int8 with one scale per row
            self.register_buffer("int8_codes", weight.codes, persistent=False)
            self.register_buffer("int8_scale", weight.scale[:, 0].contiguous(), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.num_int4_parts:
            y = self._int4(flat)
        else:
            y = torch._weight_int8pack_mm(flat, self.int8_codes, self.int8_scale)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def _int4(self, flat: torch.Tensor) -> torch.Tensor:
        """flat times the 4-bit weight: dequantized for wide batches, else the backend's
        own matmul for float32 rows, else PyTorch's int4 matmul (one pass per part)."""
        float32 = flat.dtype == torch.float32
        wide = flat.shape[0] >= (DEQUANTIZE_ROWS_FLOAT32 if float32 else DEQUANTIZE_ROWS)
        if float32 and not wide and (y := self._native_int4(flat)) is not None:
            return y
        if self.int8_activations:
            round_int8 = getattr(self.ops, "quantize_activations_int8", None)
            flat = (round_int8 or layer_ops.quantize_activations_int8)(flat)
        if wide:
            return F.linear(flat, self.dequantized().to(flat.dtype))
        y = None
        for i in range(self.num_int4_parts):
            part = torch._weight_int4pack_mm_for_cpu(
                flat,
                getattr(self, f"packed_{i}"),
                self.group_size,
                getattr(self, f"scales_and_zeros_{i}"),
            )
            y = part if y is None else y.add_(part)
        return y

    def round_activations_to_int8(self) -> None:
        """From now on, multiply x^ (see the class) instead of x."""
        self.int8_activations = True
        self._native = None

    def _apply(self, fn, recurse=True):  # .to() and the like: new buffers, a new binding
        self._native = None
        return super()._apply(fn, recurse)

    def _native_int4(self, flat: torch.Tensor) -> torch.Tensor | None:
        """The backend's own 4-bit (or Q8_0) matmul of float32 rows, None where it has none.
        The function and its arguments after x are looked up once (a decode step makes 121
        of these calls, and module attribute lookups cost about a microsecond each)."""
        if self._native is None:
            self._native = self._bind_native()
        if not self._native:
            return None
        matmul, args = self._native
        return matmul(flat, *args)

    def fused_binding(self):
        """The layer as the backend's C++ `quantized_linear`, what its fused decoder layer
        multiplies with (the same matmul as `_native_int4`, bias included); None where the
        backend has none or this layer has no C++ matmul."""
        make = getattr(self.ops, "quantized_linear", None)
        if make is None:
            return None
        if self._native is None:
            self._native = self._bind_native()
        if not self._native:
            return None
        matmul, (weights, scales, group_size, int8) = self._native
        if matmul is self.ops.int8_matmul:
            weights = {"codes": weights, "scales": scales}
        else:
            weights = {"nibbles": weights, "scales_and_shifts": scales}
        return make(**weights, bias=self.bias, group_size=group_size, int8_activations=int8)

    def _bind_native(self) -> tuple:
        """(the backend's matmul, its arguments after x), or () where it has none."""
        codes = getattr(self, "group_codes", None)
        if codes is not None and self.group_scales.dtype == torch.float32:
            args = (codes, self.group_scales, self.group_size, self.int8_activations)
            return self.ops.int8_matmul, args
        matmul = getattr(self.ops, "int4_matmul", None)
        shifts = getattr(self, "scales_and_shifts_0", None)
        if matmul is None or shifts is None or shifts.dtype != torch.float32:
            return ()
        parts = range(self.num_int4_parts)
        nibbles = [getattr(self, f"nibbles_{i}") for i in parts]
        shifts = [getattr(self, f"scales_and_shifts_{i}") for i in parts]
        return matmul, (nibbles, shifts, self.group_size, self.int8_activations)

    def dequantized(self) -> torch.Tensor:
        """The 4-bit weight (its parts summed) as a float matrix in the scales' dtype."""
        parts = range(self.num_int4_parts)
        return self.ops.dequantize_int4(
            [getattr(self, f"nibbles_{i}") for i in parts],
            [getattr(self, f"scales_and_zeros_{i}") for i in parts],
            self.group_size,
        )

    def extra_repr(self) -> str:
        kind = "int8 per row" if not self.num_int4_parts else f"{self.num_int4_parts} x int4"
        if self.int8_activations:
            kind += ", int8 activations"
        return f"in={self.in_features}, out={self.out_features}, {kind}"


def as_linear_weight(weight: torch.Tensor | QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """A float matrix for layers that are not kept quantized (e.g. the embedding table)."""
    if isinstance(weight, QuantizedWeight):
        return weight.dequantize().to(dtype)
    return weight
