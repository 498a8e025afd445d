"""PyTorch reference attention over the paged KV cache (the CPU path).

Decode rows (one query token) of a batch are computed together, with no Python loop over
sequences; prefill chunks are computed one sequence at a time, each attending causally to
its cached context plus itself.

Quantized caches (int8, float8 e4m3) are written through `quantize_kv` and read through
`dequantize_kv`; the Triton kernels reproduce both bit for bit (see `kv_cache`).
"""

import torch
import torch.nn.functional as F

from pagefleet_kernels.kv_cache import QMAX, SCALE_DTYPE, is_quantized

# Decode rows are attended in at most this many length buckets of at least this many rows.
DECODE_BUCKETS = 8
DECODE_BUCKET_MIN_ROWS = 8

# A row of zeros still gets a finite scale (its codes are all 0).
MIN_AMAX = 1e-6


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., D) -> codes (..., D) of `cache_dtype` and scales (...,) float32, one per row.

    Rounding is to nearest, ties to even, for both int8 and e4m3."""
    qmax = QMAX[cache_dtype]
    x = x.float()
    scale = x.abs().amax(dim=-1).clamp(min=MIN_AMAX) / qmax
    y = (x / scale[..., None]).clamp(-qmax, qmax)
    if cache_dtype == torch.int8:
        y = torch.round(y)
    return y.to(cache_dtype), scale.to(SCALE_DTYPE)


def dequantize_kv(
    codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """codes (..., D) with scales (...,) -> values (..., D) of `dtype`; scale None: a cast."""
    if scale is None:
        return codes.to(dtype)
    return (codes.float() * scale[..., None]).to(dtype)


def _check_scales(cache: torch.Tensor, scale: torch.Tensor | None, name: str) -> None:
    if is_quantized(cache.dtype) != (scale is not None):
        raise ValueError(
            f"{name}: a {cache.dtype} cache {'needs' if scale is None else 'takes no'} scales"
        )


def write_kv_cache(
    key: torch.Tensor,  # (T, Hkv, D)
    value: torch.Tensor,  # (T, Hkv, D)
    key_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    value_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    slot_mapping: torch.Tensor,  # (T,) int64
    key_scale: torch.Tensor | None = None,  # (num_blocks, block_size, Hkv) float32
    value_scale: torch.Tensor | None = None,  # (num_blocks, block_size, Hkv) float32
) -> None:
    """Scatter this step's K/V into their slots, quantizing when the cache is int8/fp8."""
    num_kv_heads, head_dim = key_cache.shape[2:]
    for x, cache, scale, name in (
        (key, key_cache, key_scale, "key_scale"),
        (value, value_cache, value_scale, "value_scale"),
    ):
        _check_scales(cache, scale, name)
        if scale is None:
            codes = x.to(cache.dtype)
        else:
            codes, row_scale = quantize_kv(x, cache.dtype)
            scale.view(-1, num_kv_heads)[slot_mapping] = row_scale
        # Index assignment rather than index_copy_, which has no float8 kernel on the CPU.
        cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = codes


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """(num_blocks, bs, H, ...) x (B, M) -> (B, M * bs, H, ...), the sequences' contexts."""
    # index_select over whole blocks (rows of a 2-D view) copies at memory speed; plain
    # advanced indexing of the 4-D cache is several times slower on the CPU.
    num_seqs, max_blocks = block_tables.shape
    rows = torch.index_select(cache.view(cache.shape[0], -1), 0, block_tables.reshape(-1))
    return rows.view(num_seqs, max_blocks * cache.shape[1], *cache.shape[2:])


def paged_attention(
    query: torch.Tensor,  # (T, Hq, D)
    key_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    value_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    block_tables: torch.Tensor,  # (B, max_blocks)
    seq_lens: torch.Tensor,  # (B,)
    query_start_loc: torch.Tensor,  # (B + 1,)
    scale: float,
    query_lens: list[int] | None = None,  # host copy of the per-sequence query lengths
    key_scale: torch.Tensor | None = None,  # (num_blocks, block_size, Hkv) float32
    value_scale: torch.Tensor | None = None,  # (num_blocks, block_size, Hkv) float32
) -> torch.Tensor:
    """Causal attention of each sequence's query chunk over its paged context.

    The query tokens of sequence i sit at the last `q_len_i` positions of its context
    (`seq_lens[i]` tokens, written to the cache before this call).
    """
    block_size = key_cache.shape[1]
    _check_scales(key_cache, key_scale, "key_scale")
    _check_scales(value_cache, value_scale, "value_scale")
    if query_lens is None:
        query_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    out = torch.empty_like(query)

    def context(tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, M) block ids -> K, V: (B, M * block_size, Hkv, D) in the query's dtype."""
        k_scale = None if key_scale is None else _gather(key_scale, tables)
        v_scale = None if value_scale is None else _gather(value_scale, tables)
        return (
            dequantize_kv(_gather(key_cache, tables), k_scale, query.dtype),
            dequantize_kv(_gather(value_cache, tables), v_scale, query.dtype),
        )

    decode_rows = [i for i, n in enumerate(query_lens) if n == 1]
    if decode_rows:
        rows = torch.tensor(decode_rows, dtype=torch.long, device=query.device)
        lens = seq_lens[rows].to(torch.long)
        # Rows sorted by context length and cut into a few buckets, each padded only to its
        # own longest context: a handful of batched calls, not one per sequence, and little
        # padding when lengths vary.
        order = torch.argsort(lens)
        num_buckets = min(DECODE_BUCKETS, -(-len(decode_rows) // DECODE_BUCKET_MIN_ROWS))
        for bucket in order.chunk(num_buckets):
            bucket_rows, bucket_lens = rows[bucket], lens[bucket]
            max_blocks = int((bucket_lens.max().item() + block_size - 1) // block_size)
            k, v = context(block_tables[bucket_rows, :max_blocks].to(torch.long))  # (b, S, Hkv, D)
            token_idx = query_start_loc[:-1].to(torch.long)[bucket_rows]
            valid = torch.arange(k.shape[1], device=query.device)[None, :] < bucket_lens[:, None]
            o = F.scaled_dot_product_attention(
                query[token_idx][:, :, None, :],  # (b, Hq, 1, D)
                k.transpose(1, 2),  # (b, Hkv, S, D)
                v.transpose(1, 2),
                attn_mask=valid[:, None, None, :],  # (b, 1, 1, S)
                scale=scale,
                enable_gqa=True,
            )
            out[token_idx] = o[:, :, 0]

    starts = query_start_loc.tolist()
    lens_host = seq_lens.tolist()
    for i, q_len in enumerate(query_lens):
        if q_len <= 1:
            continue
        ctx_len = lens_host[i]
        start = starts[i]
        n_blocks = (ctx_len + block_size - 1) // block_size
        k, v = context(block_tables[i : i + 1, :n_blocks].to(torch.long))
        k, v = k[0, :ctx_len], v[0, :ctx_len]  # (S, Hkv, D)
        q = query[start : start + q_len]
        # Query token j sits at context position ctx_len - q_len + j.
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=query.device)
        mask = torch.arange(ctx_len, device=query.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),  # (Hq, L, D)
            k.transpose(0, 1),  # (Hkv, S, D)
            v.transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[start : start + q_len] = o.transpose(0, 1)
    return out
