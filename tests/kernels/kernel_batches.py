"""Random paged batches for the kernel tests: a block pool with shuffled block ids, each
sequence's context written through the torch backend, and the query chunk at its end."""

from dataclasses import dataclass

import torch
from pagefleet_kernels import torch_attention
from pagefleet_kernels.kv_cache import SCALE_DTYPE, is_quantized

CACHE_DTYPES = {"auto": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}

# Triton kernel vs the torch backend on the same cache (codes and scales identical): the
# difference is summation order and the rounding of the query dtype. (atol, rtol)
KERNEL_TOLERANCE = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.5e-2, 1e-2),
}
# A quantized cache vs the unquantized one, both through the torch backend, inputs ~ N(0, 1):
# the error of the stored K/V themselves. (atol, rtol)
QUANTIZATION_TOLERANCE = {"int8": (3e-2, 3e-2), "fp8": (1.5e-1, 1e-1)}


@dataclass
class PagedBatch:
    query: torch.Tensor  # (T, Hq, D)
    key: torch.Tensor  # (sum of contexts, Hkv, D), every context token's key
    value: torch.Tensor  # (sum of contexts, Hkv, D)
    slot_mapping: torch.Tensor  # (sum of contexts,) the slot of each of those tokens
    key_cache: torch.Tensor  # (num_blocks, block_size, Hkv, D)
    value_cache: torch.Tensor
    key_scale: torch.Tensor | None  # (num_blocks, block_size, Hkv)
    value_scale: torch.Tensor | None
    block_tables: torch.Tensor  # (B, max_blocks) int64, padded with 0
    seq_lens: torch.Tensor  # (B,)
    query_start_loc: torch.Tensor  # (B + 1,)
    query_lens: list[int]
    scale: float

    def attention(self, backend, **kwargs) -> torch.Tensor:
        return backend.paged_attention(
            self.query,
            self.key_cache,
            self.value_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.scale,
            self.query_lens,
            self.key_scale,
            self.value_scale,
            **kwargs,
        )


def make_batch(
    query_lens: list[int],
    context_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    cache: str = "auto",
    device: torch.device | str = "cpu",
    seed: int = 0,
    extra_blocks: int = 3,
) -> PagedBatch:
    """Sequence i has `context_lens[i]` tokens, the last `query_lens[i]` of which query."""
    assert all(0 < q <= c for q, c in zip(query_lens, context_lens, strict=True))
    generator = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_needed) + extra_blocks
    block_ids = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()  # 0: padding
    tables, used = [], 0
    for n in blocks_needed:
        tables.append(block_ids[used : used + n])
        used += n
    width = max(blocks_needed)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    slots = [
        t[p // block_size] * block_size + p % block_size
        for t, c in zip(tables, context_lens, strict=True)
        for p in range(c)
    ]

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    key = randn(len(slots), num_kv_heads, head_dim)
    value = randn(len(slots), num_kv_heads, head_dim)
    query = randn(sum(query_lens), num_q_heads, head_dim)
    cache_dtype = CACHE_DTYPES[cache] or dtype
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.zeros(shape, dtype=cache_dtype)
    value_cache = torch.zeros(shape, dtype=cache_dtype)
    key_scale = value_scale = None
    if is_quantized(cache_dtype):
        key_scale = torch.zeros(shape[:3], dtype=SCALE_DTYPE)
        value_scale = torch.zeros(shape[:3], dtype=SCALE_DTYPE)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    torch_attention.write_kv_cache(
        key, value, key_cache, value_cache, slot_mapping, key_scale, value_scale
    )
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
    query_start_loc[1:] = torch.cumsum(torch.tensor(query_lens), 0)

    def to(t):
        return None if t is None else t.to(device)

    return PagedBatch(
        to(query),
        to(key),
        to(value),
        to(slot_mapping),
        to(key_cache),
        to(value_cache),
        to(key_scale),
        to(value_scale),
        to(block_tables),
        torch.tensor(context_lens, dtype=torch.int64, device=device),
        to(query_start_loc),
        list(query_lens),
        head_dim**-0.5,
    )


def naive_attention(batch: PagedBatch, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A loop per sequence over the raw (never cached) K/V, in float32; `sinks` (Hq,): one
    more logit per head in every softmax, with no value (gpt-oss)."""
    out = torch.empty(batch.query.shape, dtype=torch.float32)
    group = batch.query.shape[1] // batch.key.shape[1]
    kv_start = 0
    for i, q_len in enumerate(batch.query_lens):
        ctx = int(batch.seq_lens[i])
        q0 = int(batch.query_start_loc[i])
        q = batch.query[q0 : q0 + q_len].float().cpu()  # (L, Hq, D)
        k = batch.key[kv_start : kv_start + ctx].float().cpu().repeat_interleave(group, dim=1)
        v = batch.value[kv_start : kv_start + ctx].float().cpu().repeat_interleave(group, dim=1)
        scores = torch.einsum("lhd,shd->hls", q, k) * batch.scale  # (Hq, L, S)
        q_pos = torch.arange(ctx - q_len, ctx)
        scores.masked_fill_(torch.arange(ctx)[None, :] > q_pos[:, None], float("-inf"))
        if sinks is None:
            probs = scores.softmax(-1)
        else:
            sink = sinks.float().cpu().view(-1, 1, 1).expand(-1, q_len, 1)
            probs = torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1]
        out[q0 : q0 + q_len] = torch.einsum("hls,shd->lhd", probs, v)
        kv_start += ctx
    return out
