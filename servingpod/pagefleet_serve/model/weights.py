"""Checkpoint tensors as the layers' weight loaders receive them: whole, the way the
checkpoint holds them, and read only where a loader takes them.

A loader hands each parameter's `weight_loader(param, weight, shard_id)` the checkpoint's
full tensor: a torch tensor, a `QuantizedWeight` (kept quantized), or a lazy one that has
not been read yet (`LazyWeight`: a safetensors slice, a GGUF tensor's mapped blocks, a
whole tensor whose read is scheduled). The weight loader cuts its rank's part (`cut`:
a lazy tensor reads only those bytes) and writes it into its place (`load_into`), or keeps
a quantized one as it is (`is_kept_quantized`, `load`).
"""

from typing import Protocol, runtime_checkable

import torch

from pagefleet_serve.model.quant import QuantizedWeight

Ranges = list[tuple[int, int]]


@runtime_checkable
class LazyWeight(Protocol):
    """A checkpoint tensor not read yet."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def kept_quantized(self) -> bool:
        """Whether `load` gives a QuantizedWeight (the checkpoint's own codes)."""

    def cut(self, dim: int, ranges: Ranges) -> "LazyWeight":
        """The `ranges` along `dim`, joined; nothing is read."""

    def dequantized(self) -> "LazyWeight":
        """The same tensor, loaded as floats even where it would be kept quantized."""

    def load(self, dtype: torch.dtype) -> "torch.Tensor | QuantizedWeight": ...

    def load_into(self, out: torch.Tensor) -> None:
        """Read the tensor into `out` (of its shape), converted to `out`'s dtype."""


Weight = torch.Tensor | QuantizedWeight | LazyWeight


def take(source, dim: int, ranges: Ranges, cat=torch.cat):
    """The `ranges` of `source` along `dim`, concatenated: a tensor, a numpy array or a
    safetensors slice (which reads only those parts of the file); `cat` joins them."""
    pieces = [source[(slice(None),) * dim + (slice(first, end),)] for first, end in ranges]
    return pieces[0] if len(pieces) == 1 else cat(pieces, dim)


def shape_of(weight: Weight) -> tuple[int, ...]:
    return tuple(weight.shape)


def is_kept_quantized(weight: Weight) -> bool:
    if isinstance(weight, QuantizedWeight):
        return True
    return isinstance(weight, LazyWeight) and weight.kept_quantized


def cut(weight: Weight, dim: int, ranges: Ranges) -> Weight:
    """This rank's part of `weight`."""
    if isinstance(weight, QuantizedWeight):
        return _cut_quantized(weight, dim, ranges)
    if isinstance(weight, torch.Tensor):
        return take(weight, dim, ranges)
    return weight.cut(dim, ranges)


def dequantized(weight: Weight) -> Weight:
    """`weight` as floats (a quantized one expanded; a lazy one loaded as floats)."""
    if isinstance(weight, QuantizedWeight):
        return weight.dequantize()
    if isinstance(weight, torch.Tensor):
        return weight
    return weight.dequantized()


def load(weight: Weight, dtype: torch.dtype) -> torch.Tensor | QuantizedWeight:
    """The tensor (or the QuantizedWeight) itself, read now."""
    if isinstance(weight, (torch.Tensor, QuantizedWeight)):
        return weight
    return weight.load(dtype)


def load_into(weight: Weight, out: torch.Tensor) -> None:
    """Write `weight` (floats, or quantized ones expanded) into `out`."""
    if isinstance(weight, LazyWeight) and out.is_contiguous():
        weight.dequantized().load_into(out)
        return
    out.copy_(load(dequantized(weight), out.dtype))  # into a strided place: by a copy


def _cut_quantized(weight: QuantizedWeight, dim: int, ranges: Ranges) -> QuantizedWeight:
    """Rows, or whole groups of columns (ValueError where a cut would split a group)."""
    group = weight.group_size
    if dim == weight.codes.dim() - 1:
        if any(first % group or end % group for first, end in ranges):
            raise ValueError(f"columns {ranges} would split {group}-weight quantized groups")
        groups = [(first // group, end // group) for first, end in ranges]
    else:
        groups = ranges
    zero = None if weight.zero is None else take(weight.zero, dim, groups)
    return QuantizedWeight(
        take(weight.codes, dim, ranges).contiguous(),
        take(weight.scale, dim, groups).contiguous(),
        zero if zero is None else zero.contiguous(),
        weight.bits,
        group,
    )
