"""MXFP4 weights (the OCP microscaling format gpt-oss checkpoints ship their experts in,
`quantization_config.quant_method == "mxfp4"`), dequantized once at load on the CPU.

A matrix (..., rows, columns) is stored as two uint8 tensors: `*_blocks` (..., rows,
columns / 32, 16), each byte two FP4 E2M1 codes (the low nibble the even column, the high
nibble the odd one), and `*_scales` (..., rows, columns / 32), each a power of two per 32
columns in E8M0 (2^(byte - 127)). E2M1 codes are a sign bit and the eight magnitudes 0,
0.5, 1, 1.5, 2, 3, 4, 6.
"""

import torch

BLOCK = 32  # columns sharing one scale
E8M0_BIAS = 127
# Code -> value: the sign in bit 3, then the magnitude.
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


class Mxfp4FormatError(ValueError):
    """An MXFP4 weight whose blocks and scales do not fit together."""


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks (..., R, G, 16) uint8 and scales (..., R, G) uint8 -> (..., R, G * 32) of
    `dtype` (exact: every value is a code times a power of two, computed in float32)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise Mxfp4FormatError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise Mxfp4FormatError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)}: "
            f"blocks must be (..., groups, {BLOCK // 2}) and scales (..., groups)"
        )
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # (..., G, 16, 2)
    values = table[codes].flatten(-2)  # (..., G, 32): low nibble first
    exponents = scales.to(torch.int32) - E8M0_BIAS
    values = torch.ldexp(values, exponents[..., None])
    return values.flatten(-2).to(dtype)
