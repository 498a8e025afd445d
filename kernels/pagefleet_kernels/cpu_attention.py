"""Paged attention on the CPU through a small C++ kernel that reads K/V in place from the
block pool (`csrc/paged_attention_cpu.cpp`): no gather copy of each sequence's context, and
int8/fp8 codes are dequantized as they are read, so a quantized cache also cuts the bytes
read. The kernel takes the query in the model's dtype and returns its output in it. The
cache write is the kernel module's row copy for an unquantized cache, the torch backend's
(which quantizes) otherwise.

The kernel takes decode rows (one query token). Prefill chunks go to the torch backend,
whose SDPA flash kernel tiles the queries: the C++ kernel walks each query token's context
on its own and measured 3-10x slower there (512 queries over 2048 keys, 256 over 256),
while for decode it reads each K/V row once where the torch backend copies it first.

The C++ backend's layer ops and matmuls are those of `cpu_layer_ops` (see
`backend.cpu_backend`).

The kernel is compiled when the package is installed (`pagefleet_kernels.cpu_build`).
`available()` says whether it was built for this CPU; the engine uses the torch backend
when it was not.
"""

from dataclasses import dataclass

import torch

from pagefleet_kernels import torch_attention
from pagefleet_kernels.cpu_build import load_extension
from pagefleet_kernels.metadata import AttentionMetadata
from pagefleet_kernels.torch_attention import _check_scales

__all__ = ["available", "paged_attention", "prepare", "write_kv_cache"]


def _extension():
    """The compiled module, or None when none was built for this CPU."""
    return load_extension("pagefleet_paged_attention_cpu")


def available() -> bool:
    return _extension() is not None


@dataclass
class _Split:
    """One forward pass's batch cut into its decode rows and its prefill chunks, each
    with its own layout tensors (int64, contiguous: what the kernel reads)."""

    decode_tokens: torch.Tensor  # (n,) query token index of each decode row
    decode: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # tables, seq_lens, starts
    prefill_tokens: torch.Tensor  # (m,) query tokens of the prefill chunks, in order
    prefill: tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]] | None


def _split(
    block_tables, seq_lens, query_start_loc, query_lens: list[int], first: list[int] | None = None
) -> _Split:
    """`first`: query_start_loc's host copy, when the caller has it."""

    def part(rows: list[int]):
        index = torch.tensor(rows, dtype=torch.long)
        lens = [query_lens[i] for i in rows]
        starts = torch.zeros(len(rows) + 1, dtype=torch.int64)
        starts[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)
        tables = block_tables[index].to(torch.int64).contiguous()
        return tables, seq_lens[index].to(torch.int64).contiguous(), starts, lens

    if first is None:
        first = query_start_loc.tolist()
    decode_rows = [i for i, n in enumerate(query_lens) if n == 1]
    prefill_rows = [i for i, n in enumerate(query_lens) if n > 1]
    prefill_tokens = [t for i in prefill_rows for t in range(first[i], first[i] + query_lens[i])]
    return _Split(
        torch.tensor([first[i] for i in decode_rows], dtype=torch.long),
        part(decode_rows)[:3],
        torch.tensor(prefill_tokens, dtype=torch.long),
        part(prefill_rows) if prefill_rows else None,
    )


def prepare(metadata: AttentionMetadata, block_size: int, sliding_windows) -> None:
    """Split the batch once per forward pass, not once per layer."""
    metadata.plan_cache["cpu"] = _split(
        metadata.block_tables,
        metadata.seq_lens,
        metadata.query_start_loc,
        metadata.query_lens,
        metadata.query_start_loc_host,
    )


def write_kv_cache(
    key: torch.Tensor,  # (T, Hkv, D)
    value: torch.Tensor,  # (T, Hkv, D)
    key_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (T,) int64
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> None:
    """The torch backend's `write_kv_cache`: a row copy in C++ when the cache holds the
    rows' own dtype, the torch backend (which quantizes) otherwise."""
    if (
        key_scale is None
        and value_scale is None
        and key.dtype == key_cache.dtype == value.dtype == value_cache.dtype
        and key.stride(-1) == value.stride(-1) == 1
        and key.stride(-2) == value.stride(-2) == key.shape[-1]
    ):
        _extension().write_kv_cache(key, value, key_cache, value_cache, slot_mapping.contiguous())
        return
    torch_attention.write_kv_cache(
        key, value, key_cache, value_cache, slot_mapping, key_scale, value_scale
    )


def _decode(query, caches, split: _Split, scale, sliding_window, softcap, sinks) -> torch.Tensor:
    """The C++ kernel over the batch's decode rows (`query` holds just those, in order),
    computed in float32, returned in the query's dtype."""
    return _extension().paged_attention(
        query.contiguous(),
        *caches,
        *split.decode,
        scale,
        sliding_window or 0,
        softcap or 0.0,
        sinks,
    )


def paged_attention(
    query: torch.Tensor,  # (T, Hq, D)
    key_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    value_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    block_tables: torch.Tensor,  # (B, max_blocks)
    seq_lens: torch.Tensor,  # (B,)
    query_start_loc: torch.Tensor,  # (B + 1,)
    scale: float,
    query_lens: list[int] | None = None,  # unused: the kernel reads query_start_loc
    key_scale: torch.Tensor | None = None,  # (num_blocks, block_size, Hkv) float32
    value_scale: torch.Tensor | None = None,
    *,
    plan_cache: dict | None = None,  # unused: nothing is planned per layer
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # (Hq,)
) -> torch.Tensor:
    """The torch backend's `paged_attention`: decode rows computed in float32 by the C++
    kernel, prefill chunks by the torch backend."""
    _check_scales(key_cache, key_scale, "key_scale")
    _check_scales(value_cache, value_scale, "value_scale")
    if query_lens is None:
        query_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    split = None if plan_cache is None else plan_cache.get("cpu")
    if split is None:
        split = _split(block_tables, seq_lens, query_start_loc, query_lens)
    caches = (key_cache, value_cache, key_scale, value_scale)
    if split.prefill is None:  # a decode-only step (the common one): no gather, no scatter
        return _decode(query, caches, split, scale, sliding_window, softcap, sinks)
    out = torch.empty_like(query)
    if len(split.decode_tokens):
        decoded = _decode(
            query[split.decode_tokens], caches, split, scale, sliding_window, softcap, sinks
        )
        out[split.decode_tokens] = decoded
    if split.prefill is not None:
        tables, lens, starts, prefill_lens = split.prefill
        out[split.prefill_tokens] = torch_attention.paged_attention(
            query[split.prefill_tokens],
            key_cache,
            value_cache,
            tables,
            lens,
            starts,
            scale,
            prefill_lens,
            key_scale,
            value_scale,
            plan_cache=None if plan_cache is None else plan_cache.setdefault("cpu-prefill", {}),
            sliding_window=sliding_window,
            softcap=softcap,
            sinks=sinks,
        )
    return out
