"""Sliding-window attention in the torch backend, against a naive per-query loop: decodes
and prefill chunks in one batch, contexts shorter and longer than the window. KV blocks
wholly before a sequence's window hold NaN, so reading them would poison the output: they
must be skipped, not just masked."""

from __future__ import annotations

import math

import torch
from pagefleet_kernels import torch_attention

BLOCK_SIZE = 4
WINDOW = 8
NUM_KV_HEADS, NUM_Q_HEADS, HEAD_DIM = 2, 4, 8
# (context length including this step's tokens, query length)
BATCH = [(30, 1), (9, 1), (25, 7), (6, 6), (20, 20), (3, 1)]


def naive(q, k, v, q_positions, scale):
    """q: (L, Hq, D); k, v: (S, Hkv, D) of one sequence; each query sees its window."""
    group = NUM_Q_HEADS // NUM_KV_HEADS
    out = torch.empty_like(q)
    for i, p in enumerate(q_positions):
        lo = max(0, p - WINDOW + 1)
        keys = k[lo : p + 1].repeat_interleave(group, dim=1)  # (n, Hq, D)
        values = v[lo : p + 1].repeat_interleave(group, dim=1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q[i], keys) * scale, dim=-1)
        out[i] = torch.einsum("hn,nhd->hd", weights, values)
    return out


def test_sliding_window_reads_only_the_window():
    generator = torch.Generator().manual_seed(0)
    num_blocks = 64
    key_cache = torch.zeros(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    value_cache = torch.zeros_like(key_cache)
    free = torch.randperm(num_blocks, generator=generator).tolist()
    max_blocks = max(math.ceil(ctx / BLOCK_SIZE) for ctx, _ in BATCH)
    block_tables = torch.zeros(len(BATCH), max_blocks, dtype=torch.int32)
    dense, outside = [], []
    for i, (ctx, q_len) in enumerate(BATCH):
        blocks = [free.pop() for _ in range(math.ceil(ctx / BLOCK_SIZE))]
        block_tables[i, : len(blocks)] = torch.tensor(blocks)
        k = torch.randn(ctx, NUM_KV_HEADS, HEAD_DIM, generator=generator)
        v = torch.randn(ctx, NUM_KV_HEADS, HEAD_DIM, generator=generator)
        slots = torch.tensor(
            [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(ctx)]
        )
        torch_attention.write_kv_cache(k, v, key_cache, value_cache, slots)
        dense.append((k, v))
        first_key = max(0, ctx - q_len - WINDOW + 1)  # of the first query
        outside += blocks[: first_key // BLOCK_SIZE]
    assert outside, "the batch must have blocks wholly before a window"
    key_cache[outside] = float("nan")
    value_cache[outside] = float("nan")

    query_lens = [q_len for _, q_len in BATCH]
    query = torch.randn(sum(query_lens), NUM_Q_HEADS, HEAD_DIM, generator=generator)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    seq_lens = torch.tensor([ctx for ctx, _ in BATCH], dtype=torch.int32)
    scale = HEAD_DIM**-0.5
    out = torch_attention.paged_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        query_lens,
        plan_cache={},
        sliding_window=WINDOW,
    )
    assert torch.isfinite(out).all()
    for i, (ctx, q_len) in enumerate(BATCH):
        start = int(query_start_loc[i])
        k, v = dense[i]
        expected = naive(query[start : start + q_len], k, v, range(ctx - q_len, ctx), scale)
        torch.testing.assert_close(out[start : start + q_len], expected, atol=1e-5, rtol=1e-5)
