"""PyTorch reference attention over the paged KV cache (the CPU path).

Decode rows (one query token) of a batch are computed together, with no Python loop over
sequences; prefill chunks are computed one sequence at a time, each attending causally to
its cached context plus itself.
"""

import torch
import torch.nn.functional as F


def write_kv_cache(
    key: torch.Tensor,  # (T, Hkv, D)
    value: torch.Tensor,  # (T, Hkv, D)
    key_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    value_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    slot_mapping: torch.Tensor,  # (T,) int64
) -> None:
    """Scatter this step's K/V into their slots."""
    num_kv_heads, head_dim = key_cache.shape[2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(
        0, slot_mapping, value.to(value_cache.dtype)
    )


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """(num_blocks, bs, H, D) x (B, M) -> (B, M * bs, H, D), the sequences' contexts."""
    num_seqs, max_blocks = block_tables.shape
    _, block_size, num_heads, head_dim = cache.shape
    return cache[block_tables].view(num_seqs, max_blocks * block_size, num_heads, head_dim)


def paged_attention(
    query: torch.Tensor,  # (T, Hq, D)
    key_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    value_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    block_tables: torch.Tensor,  # (B, max_blocks)
    seq_lens: torch.Tensor,  # (B,)
    query_start_loc: torch.Tensor,  # (B + 1,)
    scale: float,
    query_lens: list[int] | None = None,  # host copy of the per-sequence query lengths
) -> torch.Tensor:
    """Causal attention of each sequence's query chunk over its paged context.

    The query tokens of sequence i sit at the last `q_len_i` positions of its context
    (`seq_lens[i]` tokens, written to the cache before this call).
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if query_lens is None:
        query_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    out = torch.empty_like(query)

    decode_rows = [i for i, n in enumerate(query_lens) if n == 1]
    if decode_rows:
        rows = torch.tensor(decode_rows, dtype=torch.long, device=query.device)
        token_idx = query_start_loc[:-1].to(torch.long)[rows]
        lens = seq_lens[rows].to(torch.long)
        # Only gather as many blocks as the longest of these contexts needs.
        block_size = key_cache.shape[1]
        max_blocks = int((lens.max().item() + block_size - 1) // block_size)
        tables = block_tables[rows, :max_blocks].to(torch.long)
        k = _gather(key_cache, tables).to(query.dtype)  # (Bd, S, Hkv, D)
        v = _gather(value_cache, tables).to(query.dtype)
        q = query[token_idx].view(-1, num_kv_heads, group, head_dim)  # (Bd, Hkv, G, D)
        scores = torch.einsum("bhgd,bshd->bhgs", q, k) * scale  # (Bd, Hkv, G, S)
        positions = torch.arange(k.shape[1], device=query.device)
        invalid = positions[None, :] >= lens[:, None]  # (Bd, S)
        scores.masked_fill_(invalid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("bhgs,bshd->bhgd", probs, v)
        out[token_idx] = o.reshape(-1, num_q_heads, head_dim)

    starts = query_start_loc.tolist()
    lens_host = seq_lens.tolist()
    for i, q_len in enumerate(query_lens):
        if q_len <= 1:
            continue
        ctx_len = lens_host[i]
        start = starts[i]
        block_size = key_cache.shape[1]
        n_blocks = (ctx_len + block_size - 1) // block_size
        table = block_tables[i, :n_blocks].to(torch.long)
        k = key_cache[table].reshape(-1, num_kv_heads, head_dim)[:ctx_len].to(query.dtype)
        v = value_cache[table].reshape(-1, num_kv_heads, head_dim)[:ctx_len].to(query.dtype)
        q = query[start : start + q_len]
        # Query token j sits at context position ctx_len - q_len + j.
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=query.device)
        mask = torch.arange(ctx_len, device=query.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),  # (Hq, L, D)
            k.transpose(0, 1).repeat_interleave(group, dim=0),  # (Hq, S, D)
            v.transpose(0, 1).repeat_interleave(group, dim=0),
            attn_mask=mask,
            scale=scale,
        )
        out[start : start + q_len] = o.transpose(0, 1)
    return out
