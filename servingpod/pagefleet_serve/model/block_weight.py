"""GGUF matrices kept in the file's own blocks: the K-quants (Q4_K, Q5_K, Q6_K), IQ4_NL and
IQ4_XS, and in a file that holds any of those its other block types as well (a Q4_K_M
file's Q8_0 or Q5_0 fallbacks), as the loader hands them over.

A `BlockWeight` stands in for a float matrix (N, K), or stacked experts (E, N, K): one or
more parts of whole output rows, each the blocks of one type as the file lays them out,
(N_p, K / weights * bytes) uint8 (`pagefleet_kernels.gguf_blocks`). A fused q/k/v or
gate/up of a mixed file (Q4_K_M's v is Q6_K on some layers) is several parts; the kernels
multiply each part into its columns of the output. The weights are exactly
`gguf.quants.dequantize`'s: nothing is requantized or reordered.
"""

from dataclasses import dataclass

import numpy as np
import torch
from pagefleet_kernels.gguf_blocks import GGUF_BLOCK_TYPES, dequantize_blocks, row_weights

# Block types held as a BlockWeight (the K-quants and the IQ4s: the ones Q4_0/Q4_1/Q8_0's
# 4-bit layouts cannot hold).
BLOCK_KEPT_TYPES = ("Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")


@dataclass
class BlockWeight:
    """parts: (blocks, type name) of consecutive output rows, blocks (N_p, row bytes) or
    (E, N_p, row bytes) uint8."""

    parts: tuple[tuple[torch.Tensor, str], ...]

    @staticmethod
    def from_gguf(data: np.ndarray, type_name: str) -> "BlockWeight":
        """A GGUF tensor's raw blocks (..., row bytes), copied out of the mapped file."""
        if type_name not in GGUF_BLOCK_TYPES:
            raise ValueError(
                f"GGUF type {type_name} is not a block type kept quantized "
                f"({', '.join(GGUF_BLOCK_TYPES)} are)"
            )
        return BlockWeight(((torch.from_numpy(np.array(data, dtype=np.uint8)), type_name),))

    @property
    def shape(self) -> torch.Size:
        blocks, type_name = self.parts[0]
        rows = sum(b.shape[-2] for b, _ in self.parts)
        weights = row_weights(type_name, blocks.shape[-1])
        return torch.Size((*blocks.shape[:-2], rows, weights))

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b, _ in self.parts)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float matrix these blocks stand for, bit for bit gguf's (in float32)."""
        return torch.cat([dequantize_blocks(b, t, dtype) for b, t in self.parts], dim=-2)

    @staticmethod
    def cat_rows(parts: list["BlockWeight"]) -> "BlockWeight":
        """The row-wise concatenation (fused q/k/v, gate/up): neighbours of one type are
        joined into one part."""
        joined: list[tuple[torch.Tensor, str]] = []
        for blocks, type_name in (p for weight in parts for p in weight.parts):
            if joined and joined[-1][1] == type_name:
                joined[-1] = (torch.cat((joined[-1][0], blocks), dim=-2), type_name)
            else:
                joined.append((blocks, type_name))
        return BlockWeight(tuple(joined))

    def experts(self) -> list["BlockWeight"]:
        """A stacked weight's experts, each (N, K)."""
        count = self.parts[0][0].shape[0]
        return [BlockWeight(tuple((b[e], t) for b, t in self.parts)) for e in range(count)]

    def cut(self, dim: int, ranges: list[tuple[int, int]]) -> "BlockWeight":
        """Rows of a one-part weight, or whole blocks of its columns (ValueError where a
        cut would split a block)."""
        (blocks, type_name), *others = self.parts
        if others:
            raise ValueError("a fused weight of several block types is not cut")
        if dim == blocks.dim() - 1:
            kind = GGUF_BLOCK_TYPES[type_name]
            if any(first % kind.weights or end % kind.weights for first, end in ranges):
                raise ValueError(
                    f"columns {ranges} would split {kind.weights}-weight {type_name} blocks"
                )
            ranges = [
                (first // kind.weights * kind.bytes, end // kind.weights * kind.bytes)
                for first, end in ranges
            ]
        pieces = [blocks.narrow(dim, first, end - first) for first, end in ranges]
        return BlockWeight(((torch.cat(pieces, dim).contiguous(), type_name),))
