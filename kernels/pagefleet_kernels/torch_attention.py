"""The PyTorch attention backend over the paged KV cache (the CPU path, and every feature
on CUDA too).

Decode rows (one query token) of a batch are computed together, with no Python loop over
sequences; prefill chunks are computed one sequence at a time, each attending causally to
its cached context plus itself.

Quantized caches (int8, float8 e4m3) are written through `quantize_kv` and read through
`dequantize_kv`; the Triton kernels reproduce both bit for bit (see `kv_cache`).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagefleet_kernels.kv_cache import QMAX, SCALE_DTYPE, is_quantized
from pagefleet_kernels.metadata import AttentionMetadata

# Decode rows are attended in at most this many length buckets of at least this many rows;
# neighbouring buckets merge when the padding that adds costs less than one more call,
# which costs about as much as this many (row x context position) elements.
DECODE_BUCKETS = 8
DECODE_BUCKET_MIN_ROWS = 8
DECODE_CALL_COST = 1024

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


def _decode_buckets(order: torch.Tensor, sorted_lens: list[int]) -> list[tuple[torch.Tensor, int]]:
    """Cut rows sorted by context length into buckets: (row positions, longest context)."""
    num = len(sorted_lens)
    num_chunks = min(DECODE_BUCKETS, -(-num // DECODE_BUCKET_MIN_ROWS))
    size = -(-num // num_chunks)
    bounds = [(start, min(start + size, num)) for start in range(0, num, size)]
    merged = [bounds[0]]
    for start, end in bounds[1:]:
        first, last = merged[-1]
        apart = (last - first) * sorted_lens[last - 1] + (end - start) * sorted_lens[end - 1]
        if (end - first) * sorted_lens[end - 1] <= apart + DECODE_CALL_COST:
            merged[-1] = (first, end)
        else:
            merged.append((start, end))
    return [(order[first:last], sorted_lens[last - 1]) for first, last in merged]


@dataclass
class _Plan:
    """What attention needs of the batch layout alone, the same for every layer: built once
    per forward pass (kept in `plan_cache`), not once per layer."""

    # decode buckets: query token indices (b,), block tables (b, M), mask (b, 1, 1, M * bs)
    decodes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    # prefill chunks: first query token, query length, attended key count, block table
    # (1, n), mask (q_len, keys) or None for a whole prompt (plain causal)
    prefills: list[tuple[int, int, int, torch.Tensor, torch.Tensor | None]]


def _build_plan(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    query_lens: list[int],
    block_size: int,
    sliding_window: int | None = None,
    seq_lens_host: list[int] | None = None,
    query_start_loc_host: list[int] | None = None,
) -> _Plan:
    """`seq_lens_host`, `query_start_loc_host`: the host copies, when the caller has them
    (read instead of the device tensors: no synchronisation on CUDA)."""
    device = seq_lens.device
    if seq_lens_host is None:
        seq_lens_host = seq_lens.tolist()
    if query_start_loc_host is None:
        query_start_loc_host = query_start_loc.tolist()
    decodes = []
    decode_rows = [i for i, n in enumerate(query_lens) if n == 1]
    if decode_rows:
        rows = torch.tensor(decode_rows, dtype=torch.long, device=device)
        lens = seq_lens[rows].to(torch.long)
        token_starts = query_start_loc[:-1].to(torch.long)
        # Rows sorted by context length and cut into a few buckets, each padded only to its
        # own longest context: a handful of batched calls, not one per sequence, and little
        # padding when lengths vary.
        order = torch.argsort(lens)
        sorted_lens = sorted(seq_lens_host[i] for i in decode_rows)  # lens[order], on the host
        for bucket, max_len in _decode_buckets(order, sorted_lens):
            bucket_rows, bucket_lens = rows[bucket], lens[bucket]
            max_blocks = (max_len + block_size - 1) // block_size
            first = torch.zeros_like(bucket_lens)  # (b,) each row's first block read
            if sliding_window is not None:
                # Blocks wholly before the window (the query sits at len - 1) are not read.
                first = (bucket_lens - sliding_window).clamp(min=0) // block_size
                num_blocks = (bucket_lens + block_size - 1) // block_size - first
                max_blocks = int(num_blocks.max())
            # Each row's blocks from its own first one; past its end the index is clamped
            # (those positions are masked out).
            index = (first[:, None] + torch.arange(max_blocks, device=device)).clamp(
                max=block_tables.shape[1] - 1
            )
            tables = block_tables[bucket_rows].gather(1, index).to(torch.long)
            positions = first[:, None] * block_size + torch.arange(
                max_blocks * block_size, device=device
            )
            valid = positions < bucket_lens[:, None]
            if sliding_window is not None:
                valid &= positions >= bucket_lens[:, None] - sliding_window
            decodes.append((token_starts[bucket_rows], tables, valid[:, None, None, :]))

    prefills = []
    for i, q_len in enumerate(query_lens):
        if q_len <= 1:
            continue
        ctx_len = seq_lens_host[i]
        n_blocks = (ctx_len + block_size - 1) // block_size
        # Blocks wholly before the first query's window (it sits at ctx_len - q_len) are
        # not read.
        first = 0
        if sliding_window is not None:
            first = max(ctx_len - q_len + 1 - sliding_window, 0) // block_size
        offset = first * block_size
        windowed = sliding_window is not None and sliding_window < ctx_len
        mask = None
        if ctx_len != q_len or windowed:  # query j sits at ctx_len - q_len + j
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
            k_pos = torch.arange(offset, ctx_len, device=device)[None, :]
            mask = k_pos <= q_pos
            if windowed:
                mask &= k_pos > q_pos - sliding_window
        tables = block_tables[i : i + 1, first:n_blocks].to(torch.long)
        prefills.append((query_start_loc_host[i], q_len, ctx_len - offset, tables, mask))
    return _Plan(decodes, prefills)


def _attend(
    q: torch.Tensor,  # (B, Hq, L, D)
    k: torch.Tensor,  # (B, Hkv, S, D)
    v: torch.Tensor,  # (B, Hkv, S, D)
    mask: torch.Tensor | None,  # boolean, broadcast to (B, Hq, L, S); None: L == S, causal
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,  # (B or 1, Hq or Hkv, L or G, 1) float32
) -> torch.Tensor:
    """Attention of one group of rows: SDPA, or the written-out softmax when scores are
    soft-capped or the heads have sinks (neither of which SDPA can do)."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if softcap is None:
        scores = q @ k.transpose(-1, -2) * scale
    else:
        scores = torch.tanh(q @ k.transpose(-1, -2) * (scale / softcap)) * softcap
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf")).float()
    if sinks is None:
        return torch.softmax(scores, dim=-1).to(q.dtype) @ v
    # A sink is one more logit in each row's softmax, with no value: it only takes its
    # share of the denominator.
    sinks = sinks.expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat((scores, sinks), dim=-1), dim=-1)[..., :-1]
    return probs.to(q.dtype) @ v


def prepare(metadata: AttentionMetadata, block_size: int, sliding_windows: set[int | None]) -> None:
    """Build the plan of every window the model uses, once per forward pass."""
    for window in sliding_windows:
        key = "torch" if window is None else ("torch", window)
        metadata.plan_cache[key] = _build_plan(
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            metadata.query_lens,
            block_size,
            window,
            metadata.seq_lens_host,
            metadata.query_start_loc_host,
        )


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
    *,
    plan_cache: dict | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # (Hq,)
) -> torch.Tensor:
    """Causal attention of each sequence's query chunk over its paged context.

    The query tokens of sequence i sit at the last `q_len_i` positions of its context
    (`seq_lens[i]` tokens, written to the cache before this call). `plan_cache`: a dict
    shared by the calls of one forward pass (every layer, the same batch), where the
    layout-only work (buckets, block tables, masks) is kept after the first call.
    `sliding_window`: a query at position p sees keys p - sliding_window + 1 .. p only
    (Mistral's, Hugging Face's convention); blocks wholly before that are not read.
    `softcap` (Gemma 2): scores become softcap * tanh(scores / softcap) before the mask.
    `sinks` (gpt-oss): a learned logit per query head, one more term of each query's
    softmax denominator (attended to, it contributes no value).
    """
    block_size = key_cache.shape[1]
    _check_scales(key_cache, key_scale, "key_scale")
    _check_scales(value_cache, value_scale, "value_scale")
    if query_lens is None:
        query_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    # Layers with and without a window (Gemma alternates them) keep a plan each.
    plan_key = "torch" if sliding_window is None else ("torch", sliding_window)
    plan = None if plan_cache is None else plan_cache.get(plan_key)
    if plan is None:
        plan = _build_plan(
            block_tables, seq_lens, query_start_loc, query_lens, block_size, sliding_window
        )
        if plan_cache is not None:
            plan_cache[plan_key] = plan
    out = torch.empty_like(query)
    head_dim = query.shape[-1]
    sink_logits = None if sinks is None else sinks.float()

    def context(tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, M) block ids -> K, V: (B, M * block_size, Hkv, D) in the query's dtype."""
        k_scale = None if key_scale is None else _gather(key_scale, tables)
        v_scale = None if value_scale is None else _gather(value_scale, tables)
        return (
            dequantize_kv(_gather(key_cache, tables), k_scale, query.dtype),
            dequantize_kv(_gather(value_cache, tables), v_scale, query.dtype),
        )

    for token_idx, tables, mask in plan.decodes:
        k, v = context(tables)  # (b, S, Hkv, D)
        b, num_kv_heads = k.shape[0], k.shape[2]
        # The query heads sharing a KV head become that head's query rows (one position,
        # so one mask for all): no GQA expansion of K and V.
        o = _attend(
            query[token_idx].view(b, num_kv_heads, -1, head_dim),  # (b, Hkv, G, D)
            k.transpose(1, 2),  # (b, Hkv, S, D)
            v.transpose(1, 2),
            mask,  # (b, 1, 1, S)
            scale,
            softcap,
            None if sink_logits is None else sink_logits.view(1, num_kv_heads, -1, 1),
        )
        out[token_idx] = o.reshape(b, -1, head_dim)

    for start, q_len, num_keys, tables, mask in plan.prefills:
        k, v = context(tables)
        k, v = k[0, :num_keys], v[0, :num_keys]  # (S, Hkv, D)
        q = query[start : start + q_len]
        # 4-D with a batch of one: the CPU takes its flash kernel for that shape (3-D falls
        # back to the much slower unfused math). No mask: a whole prompt, plain causal.
        o = _attend(
            q.transpose(0, 1)[None],  # (1, Hq, L, D)
            k.transpose(0, 1)[None],  # (1, Hkv, S, D)
            v.transpose(0, 1)[None],
            mask,
            scale,
            softcap,
            None if sink_logits is None else sink_logits.view(1, -1, 1, 1),
        )
        out[start : start + q_len] = o[0].transpose(0, 1)
    return out
