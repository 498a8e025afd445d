"""GGUF's block-quantized weight types as the file stores them, and their dequantization in
PyTorch: the ground truth the C++ kernels are tested against, and the torch backend's
`dequantize_blocks`.

A matrix row is a run of blocks; a block holds `weights` weights in `bytes` bytes. Every
type here decodes, per block, into small integer codes q, one float32 scale per 16 weights
and, for the types with a minimum, one float32 offset per 32, and its weights are
w = scale * q (+ offset): the same float32 products and sums as `gguf.quants.dequantize`,
so the same bits.

- Q4_0 / Q5_0 / Q8_0: d (f16) per 32, q = code - 8 / code - 16 / the int8 code
- Q4_1 / Q5_1: d, m (f16) per 32, q = code, offset m
- Q4_K / Q5_K (256 per block): d, dmin (f16), eight 6-bit (scale, min) pairs packed in 12
  bytes, q = 4-bit (5-bit) code; scale = d * sc, offset = -(dmin * m) per 32
- Q6_K (256): q = 6-bit code - 32, sixteen int8 scales (one per 16) times d (f16, last)
- IQ4_NL (32) / IQ4_XS (256): q = a non-linear table's value of the 4-bit code; IQ4_XS has
  a 6-bit scale per 32 (less 32) times d
"""

from dataclasses import dataclass

import torch

__all__ = ["GGUF_BLOCK_TYPES", "BlockType", "dequantize_blocks", "row_weights"]


@dataclass(frozen=True)
class BlockType:
    name: str
    ggml_type: int  # the file's type id (gguf.GGMLQuantizationType), as the C++ kernels take it
    weights: int  # per block
    bytes: int  # per block


GGUF_BLOCK_TYPES = {
    t.name: t
    for t in (
        BlockType("Q4_0", 2, 32, 18),
        BlockType("Q4_1", 3, 32, 20),
        BlockType("Q5_0", 6, 32, 22),
        BlockType("Q5_1", 7, 32, 24),
        BlockType("Q8_0", 8, 32, 34),
        BlockType("Q4_K", 12, 256, 144),
        BlockType("Q5_K", 13, 256, 176),
        BlockType("Q6_K", 14, 256, 210),
        BlockType("IQ4_NL", 20, 32, 18),
        BlockType("IQ4_XS", 23, 256, 136),
    )
}
# IQ4_NL's and IQ4_XS's 16 levels.
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def row_weights(type_name: str, row_bytes: int) -> int:
    """The weights a row of `row_bytes` bytes of blocks holds."""
    kind = GGUF_BLOCK_TYPES[type_name]
    if row_bytes % kind.bytes:
        raise ValueError(f"{row_bytes} bytes are not whole {type_name} blocks of {kind.bytes}")
    return row_bytes // kind.bytes * kind.weights


def dequantize_blocks(
    blocks: torch.Tensor, type_name: str, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """(..., row bytes) uint8 blocks of `type_name` -> (..., row weights) in `dtype`, computed
    in float32 and rounded once."""
    kind = GGUF_BLOCK_TYPES[type_name]
    flat = blocks.reshape(-1, kind.bytes)
    q, scale, offset = _DECODE[type_name](flat)
    # q (n, groups of 16, 16) as float32 (exact); the scales and offsets broadcast over it.
    n = flat.shape[0]
    w = scale.view(n, -1, 1) * q.float().view(n, scale.shape[1], -1)
    if offset is not None:
        w = (w.view(n, offset.shape[1], -1) + offset.view(n, -1, 1)).view(n, -1)
    shape = (*blocks.shape[:-1], row_weights(type_name, blocks.shape[-1]))
    return w.reshape(shape).to(dtype)


# -- decoders: blocks (n, bytes) uint8 -> q (n, weights) integers, scale (n, weights / 16)
# float32, offset (n, weights / 32) float32 or None. A 32-weight type's one scale is
# repeated for both halves.
def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of each block, as float32 (n, 1)."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes a block -> 32 codes: low nibbles are weights 0-15, high ones 16-31."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """4 bytes (a little-endian uint32) -> 32 bits, bit j for weight j, as uint8 (n, 32)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh[:, :, None] >> shifts) & 1).flatten(1)


def _twice(d: torch.Tensor) -> torch.Tensor:
    return d.expand(-1, 2)


def _q4_0(b):
    return _nibbles(b[:, 2:18]).to(torch.int16) - 8, _twice(_f16(b, 0)), None


def _q4_1(b):
    return _nibbles(b[:, 4:20]), _twice(_f16(b, 0)), _f16(b, 2)


def _q5_0(b):
    q = _nibbles(b[:, 6:22]) | (_high_bits(b[:, 2:6]) << 4)
    return q.to(torch.int16) - 16, _twice(_f16(b, 0)), None


def _q5_1(b):
    return _nibbles(b[:, 8:24]) | (_high_bits(b[:, 4:8]) << 4), _twice(_f16(b, 0)), _f16(b, 2)


def _q8_0(b):
    return b[:, 2:34].contiguous().view(torch.int8), _twice(_f16(b, 0)), None


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's eight 6-bit scales and mins, packed in bytes 4-15."""
    s = b[:, 4:16]
    low, mid, high = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((low & 0x3F, (high & 0x0F) | ((low >> 2) & 0x30)), dim=-1)
    mn = torch.cat((mid & 0x3F, (high >> 4) | ((mid >> 2) & 0x30)), dim=-1)
    return sc, mn


def _k_low(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K's 128 bytes -> 256 codes: for each 32 bytes, their low nibbles (32 weights), then
    their high ones."""
    chunks = qs.view(-1, 4, 1, 32)
    return torch.cat((chunks & 0x0F, chunks >> 4), dim=2).flatten(1)


def _k_scale_offset(b: torch.Tensor):
    sc, mn = _k_scales(b)
    scale = _f16(b, 0) * sc.float()
    return scale.repeat_interleave(2, dim=1), -(_f16(b, 2) * mn.float())


def _q4_k(b):
    return _k_low(b[:, 16:144]), *_k_scale_offset(b)


def _q5_k(b):
    shifts = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
    high = (b[:, None, 16:48] >> shifts) & 1  # (n, 8 sub-blocks, 32): bit j of sub-block j
    return _k_low(b[:, 48:176]) | (high.flatten(1) << 4), *_k_scale_offset(b)


def _q6_k(b):
    ql = b[:, 0:128].reshape(-1, 2, 1, 64)
    low = torch.cat((ql & 0x0F, ql >> 4), dim=2).flatten(1)  # per 128: 64 low, 64 high
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    high = ((b[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3).flatten(1)
    q = (low | (high << 4)).to(torch.int16) - 32
    scale = _f16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()
    return q, scale, None


_IQ4 = torch.tensor(IQ4_VALUES, dtype=torch.int16)


def _iq4_nl(b):
    return _IQ4[_nibbles(b[:, 2:18]).long()], _twice(_f16(b, 0)), None


def _iq4_xs(b):
    low = b[:, 4:8]
    low = torch.stack((low & 0x0F, low >> 4), dim=-1).flatten(1)  # (n, 8)
    high = b[:, 2:4].contiguous().view(torch.int16).int()  # a uint16, read as int16 bits
    high = (high >> torch.arange(0, 16, 2, dtype=torch.int32)) & 3
    scale = (low.int() | (high << 4)) - 32
    codes = _nibbles(b[:, 8:136].reshape(-1, 8, 16)).flatten(1)
    d = _f16(b, 0) * scale.float()
    return _IQ4[codes.long()], d.repeat_interleave(2, dim=1), None


_DECODE = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "IQ4_NL": _iq4_nl,
    "IQ4_XS": _iq4_xs,
}
