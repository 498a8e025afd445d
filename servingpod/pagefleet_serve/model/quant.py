"""Weights kept quantized: GGUF's Q4_0/Q4_1/Q8_0 blocks and int8 weight-only, as the
loader hands them over.

A `QuantizedWeight` stands in for a float matrix: integer codes (out_features,
in_features) with float scales and zero points per group of `group_size` consecutive
inputs of one output row. The model fuses q/k/v and gate/up by concatenating rows
(`cat_rows`), then the linear layer of the weight's format (`pagefleet_serve.model.layers.linear_methods`)
packs the codes for the kernels that multiply them. 4-bit codes (Q4_0, Q4_1) are stored for
PyTorch's int4 kernels, which compute with w = (code - 8) * scale + zero: Q4_1 stores
w = code * d + m, so scale = d and zero = m + 8 * d; Q4_0 stores w = (code - 8) * d, so
zero = 0.

Every weight is exactly what dequantizing the GGUF gives (the scales are float16 values,
held in float32); only the order of the additions differs from a float matmul.
"""

import warnings
from dataclasses import dataclass

import numpy as np
import torch

GGUF_GROUP = 32  # weights per Q4_0/Q4_1/Q8_0 block
INT4_OFFSET = 8  # the int4 kernel's implicit zero code


@dataclass
class QuantizedWeight:
    """codes (N, K): uint8 in [0, 15] (bits 4) or int8 (bits 8); scale, zero (N, K / group)
    float32, zero None when w = code * scale. A mixture's experts come stacked: (E, N, K)
    codes and (E, N, K / group) scales (`stack`, `experts`)."""

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
        scale = self.scale.repeat_interleave(self.group_size, dim=-1)
        w = codes * scale
        if self.zero is not None:
            w = w + self.zero.repeat_interleave(self.group_size, dim=-1)
        return w

    @staticmethod
    def stack(experts: list["QuantizedWeight"]) -> "QuantizedWeight":
        """Experts' matrices, quantized alike, as one (E, N, K) weight."""
        return QuantizedWeight._joined(experts, torch.stack)

    def experts(self) -> list["QuantizedWeight"]:
        """A stacked weight's experts, each (N, K)."""
        zeros = [None] * len(self.codes) if self.zero is None else list(self.zero)
        return [
            QuantizedWeight(codes, scale, zero, self.bits, self.group_size)
            for codes, scale, zero in zip(self.codes, self.scale, zeros, strict=True)
        ]

    @staticmethod
    def cat_rows(parts: list["QuantizedWeight"]) -> "QuantizedWeight":
        """The row-wise concatenation (fused q/k/v, gate/up) of weights quantized alike."""
        return QuantizedWeight._joined(parts, torch.cat)

    @staticmethod
    def _joined(parts: list["QuantizedWeight"], join) -> "QuantizedWeight":
        first = parts[0]
        kinds = {(p.bits, p.group_size, p.zero is None) for p in parts}
        if len(kinds) > 1:
            raise ValueError(f"cannot join weights quantized differently: {sorted(kinds)}")
        zero = None if first.zero is None else join([p.zero for p in parts])
        return QuantizedWeight(
            join([p.codes for p in parts]),
            join([p.scale for p in parts]),
            zero,
            first.bits,
            first.group_size,
        )


# -- GGUF blocks -> codes and scales -------------------------------------------------------
def _f16(blocks: np.ndarray, start: int) -> torch.Tensor:
    """The float16 at byte `start` of every block, as float32 (exact)."""
    return torch.from_numpy(blocks[..., start : start + 2].copy().view(np.float16)[..., 0]).float()


_LOW_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)


def _nibbles(qs: np.ndarray) -> torch.Tensor:
    """16 bytes per block -> 32 codes: the low nibbles are weights 0-15, the high 16-31.
    Eight bytes at a time, as uint64 words: an eighth of the elementwise work of a pass
    over single bytes, which was most of a GGUF's load."""
    words = np.ascontiguousarray(qs).view(np.uint64)  # (..., 2): a block's 16 bytes
    out = np.empty((*words.shape[:-1], 4), dtype=np.uint64)
    np.bitwise_and(words, _LOW_NIBBLES, out=out[..., :2])
    np.right_shift(words, np.uint64(4), out=out[..., 2:])
    out[..., 2:] &= _LOW_NIBBLES
    return torch.from_numpy(out.view(np.uint8))


# Bytes per 32-weight block of the GGUF types expanded here without the gguf package.
GGUF_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def dequantize_gguf(data: np.ndarray, type_name: str, out: torch.Tensor) -> None:
    """GGUF blocks, (..., blocks' bytes) uint8 of a type in GGUF_BLOCK_BYTES, expanded into
    `out` (..., weights) of any float dtype. Bit for bit what `gguf.quants.dequantize` gives,
    the same float32 product and sum per weight (Q4_0 (q - 8) * d, Q4_1 d * q + m, Q8_0
    q * d), rounded once to `out`'s dtype, in a few whole torch operations that read the
    blocks in place (a float model's load from a Q4 GGUF was mostly gguf's per-row numpy)."""
    blocks = data.reshape(*data.shape[:-1], -1, GGUF_BLOCK_BYTES[type_name])
    with warnings.catch_warnings():  # read, never written: the file is mapped read-only
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        halves = torch.from_numpy(blocks.view(np.float16))  # d (and Q4_1's m) lead a block
        raw = torch.from_numpy(blocks)
    d = halves[..., 0:1].float()
    exact = out.dtype == torch.float32
    w = out.view(*blocks.shape[:-1], GGUF_GROUP)
    if not exact:
        w = torch.empty(w.shape, dtype=torch.float32)
    if type_name == "Q8_0":
        torch.mul(raw[..., 2:].view(torch.int8), d, out=w)
    else:  # 16 bytes: low nibbles are weights 0-15, high nibbles 16-31
        qs = raw[..., 4:] if type_name == "Q4_1" else raw[..., 2:]
        low, high = w[..., : GGUF_GROUP // 2], w[..., GGUF_GROUP // 2 :]
        if type_name == "Q4_1":
            torch.mul(qs & 0x0F, d, out=low)
            torch.mul(qs >> 4, d, out=high)
            w.add_(halves[..., 1:2].float())
        else:
            low.copy_(qs & 0x0F)
            high.copy_(qs >> 4)
            w.sub_(INT4_OFFSET).mul_(d)
    if not exact:
        out.copy_(w.view(out.shape))


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
