"""Triton kernels over the paged KV cache: the GPU twin of `torch_attention`.

Same two functions, same arguments, same layout (see the package docstring), so the engine
picks either as its attention backend and nothing else differs.

- `write_kv_cache`: one program per new token scatters its K/V (all KV heads) into its slot,
  quantizing each (token, head) row to int8 / float8 e4m3 with one float32 scale.
- `paged_attention`: one kernel for the whole mixed batch. A program owns BLOCK_Q query
  tokens of one sequence times the NUM_QUERIES_PER_KV query heads that share one KV head
  (grouped-query attention reads each K/V tile once for the whole group), walks the
  sequence's context through its block table in tiles of TILE_N positions with an online
  softmax, starting at the tile of its first query token's sliding window (when the layer
  has one) and stopping at the causal limit of its last query token. Scores are
  soft-capped (Gemma 2) before the mask when asked; a head's sink logit (gpt-oss) is one
  more term of its softmax's denominator. Batches of decodes only
  also split the context into NUM_SEGMENTS segments (a third grid axis) so that a few
  long decodes still fill the device; a second small kernel merges the segments (and
  there adds the sink, which no segment counts).
  Quantized tiles are dequantized on the fly: the K scale multiplies the score columns, the
  V scale the probability columns, never the K/V tiles themselves.

The Triton backend's layer ops (the norms, rotary embedding and MLP activation around the
attention) are `triton_layer_ops`: one kernel launch each instead of eager PyTorch's several
(see `backend.triton_backend`).
"""

import os

import torch
import triton
import triton.language as tl

from pagefleet_kernels.kv_cache import QMAX, SCALE_DTYPE, is_quantized
from pagefleet_kernels.torch_attention import MIN_AMAX

__all__ = ["SEGMENT_COUNTS", "paged_attention", "prepare", "write_kv_cache"]

_LOG2E = 1.4426950408889634
LOG2E: tl.constexpr = tl.constexpr(_LOG2E)  # the same, for the kernels
_MAX_SEGMENTS = 16
# What `_num_segments` can pick: the decode kernel is compiled once per count.
SEGMENT_COUNTS = tuple(2**i for i in range(_MAX_SEGMENTS.bit_length()))
# The attention kernel runs 8 warps with up to 255 registers a thread: at Triton's default
# 4 warps ptxas spills 64-412 bytes in the head_dim-128 variants, and left to itself it
# caps some variants at 128 registers (two blocks an SM) and spills a few bytes (sm_80 to
# sm_90, measured by tests/kernels/test_kernels_triton_aot.py).
NUM_WARPS = 8
MAX_REGISTERS = 255
_DOT_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _round_half_even(y):
    # Adding and removing 1.5 * 2**23 leaves an fp32 of magnitude < 2**22 rounded to an
    # integer, ties to even, in plain IEEE arithmetic (which the Triton interpreter shares).
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _quantize_rows(x, QMAX: tl.constexpr, IS_FP8: tl.constexpr, MIN_AMAX: tl.constexpr):
    """x: (R, C) fp32 -> codes (R, C) fp32 lying on the code grid, scale (R,) fp32.

    Bit-identical to `torch_attention.quantize_kv`: IEEE divisions, round to nearest even."""
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), MIN_AMAX), QMAX)  # (R,)
    y = tl.math.div_rn(x, scale[:, None])  # (R, C)
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if IS_FP8:
        # e4m3 keeps 3 mantissa bits: the grid step is 2**(exponent - 3), 2**-9 below the
        # smallest normal 2**-6. Rounding here makes the cast below exact on every target.
        exponent = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # (R, C)
        exponent = tl.maximum(exponent, -6)
        step = ((exponent + (127 - 3)) << 23).to(tl.float32, bitcast=True)  # (R, C)
        inv_step = (((3 + 127) - exponent) << 23).to(tl.float32, bitcast=True)  # (R, C)
        y = _round_half_even(y * inv_step) * step
    else:
        y = _round_half_even(y)
    return y, scale


@triton.jit
def _store_rows(
    src_ptrs,  # (HEADS_PADDED, HEAD_DIM_PADDED) pointers to this token's K or V
    cache_ptrs,  # (HEADS_PADDED, HEAD_DIM_PADDED) pointers into the cache slot
    scale_ptrs,  # (HEADS_PADDED,) pointers into the scale slot; unused unless QUANTIZED
    head_mask,  # (HEADS_PADDED,)
    mask,  # (HEADS_PADDED, HEAD_DIM_PADDED)
    QUANTIZED: tl.constexpr,
    QMAX: tl.constexpr,
    IS_FP8: tl.constexpr,
    MIN_AMAX: tl.constexpr,
):
    x = tl.load(src_ptrs, mask=mask, other=0.0)  # (HEADS_PADDED, HEAD_DIM_PADDED)
    if QUANTIZED:
        codes, scale = _quantize_rows(x.to(tl.float32), QMAX, IS_FP8, MIN_AMAX)
        tl.store(scale_ptrs, scale, mask=head_mask)
        tl.store(cache_ptrs, codes.to(cache_ptrs.dtype.element_ty), mask=mask)
    else:
        tl.store(cache_ptrs, x.to(cache_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,  # (T, NUM_KV_HEADS, HEAD_DIM)
    value_ptr,  # (T, NUM_KV_HEADS, HEAD_DIM)
    key_cache_ptr,  # (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    value_cache_ptr,  # (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_scale_ptr,  # (num_blocks, BLOCK_SIZE, NUM_KV_HEADS) fp32, QUANTIZED only
    value_scale_ptr,  # (num_blocks, BLOCK_SIZE, NUM_KV_HEADS) fp32, QUANTIZED only
    slot_mapping_ptr,  # (T,) int64
    stride_key_t: tl.int64,
    stride_key_h: tl.int64,
    stride_value_t: tl.int64,
    stride_value_h: tl.int64,
    stride_cache_block: tl.int64,
    stride_cache_slot: tl.int64,
    stride_cache_head: tl.int64,
    stride_scale_block: tl.int64,
    stride_scale_slot: tl.int64,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PADDED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANTIZED: tl.constexpr,
    QMAX: tl.constexpr,
    IS_FP8: tl.constexpr,
    MIN_AMAX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PADDED)  # (HEADS_PADDED,)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)  # (HEAD_DIM_PADDED,)
    head_mask = offs_h < NUM_KV_HEADS  # (HEADS_PADDED,)
    mask = head_mask[:, None] & (offs_d < HEAD_DIM)[None, :]  # (HEADS_PADDED, HEAD_DIM_PADDED)
    cache_offs = (
        block * stride_cache_block
        + offset * stride_cache_slot
        + offs_h[:, None] * stride_cache_head
        + offs_d[None, :]
    )  # (HEADS_PADDED, HEAD_DIM_PADDED)
    scale_offs = block * stride_scale_block + offset * stride_scale_slot + offs_h  # (HEADS_PADDED,)
    key_offs = token * stride_key_t + offs_h[:, None] * stride_key_h + offs_d[None, :]
    value_offs = token * stride_value_t + offs_h[:, None] * stride_value_h + offs_d[None, :]
    _store_rows(
        key_ptr + key_offs,
        key_cache_ptr + cache_offs,
        key_scale_ptr + scale_offs,
        head_mask,
        mask,
        QUANTIZED,
        QMAX,
        IS_FP8,
        MIN_AMAX,
    )
    _store_rows(
        value_ptr + value_offs,
        value_cache_ptr + cache_offs,
        value_scale_ptr + scale_offs,
        head_mask,
        mask,
        QUANTIZED,
        QMAX,
        IS_FP8,
        MIN_AMAX,
    )


@triton.jit
def _find_seq_idx(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose query blocks hold `q_block`; sequence i's blocks start at
    query_start_loc[i] // BLOCK_Q + i (room for one partial block per sequence)."""
    left: tl.int32 = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= q_block:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # (T, NUM_Q_HEADS, HEAD_DIM), NUM_SEGMENTS == 1 only
    partial_out_ptr,  # (T, NUM_Q_HEADS, NUM_SEGMENTS, HEAD_DIM_PADDED) fp32, NUM_SEGMENTS > 1
    segment_max_ptr,  # (T, NUM_Q_HEADS, NUM_SEGMENTS) fp32, log2 domain, NUM_SEGMENTS > 1
    segment_sum_ptr,  # (T, NUM_Q_HEADS, NUM_SEGMENTS) fp32, NUM_SEGMENTS > 1
    query_ptr,  # (T, NUM_Q_HEADS, HEAD_DIM)
    key_cache_ptr,  # (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    value_cache_ptr,  # (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    key_scale_ptr,  # (num_blocks, BLOCK_SIZE, num_kv_heads) fp32, QUANTIZED only
    value_scale_ptr,  # (num_blocks, BLOCK_SIZE, num_kv_heads) fp32, QUANTIZED only
    block_tables_ptr,  # (B, max_blocks) int32/int64
    seq_lens_ptr,  # (B,)
    query_start_loc_ptr,  # (B + 1,)
    sinks_ptr,  # (NUM_Q_HEADS,) each head's sink logit, HAS_SINKS only
    qk_scale,  # softmax scale * log2(e); with SOFTCAP: softmax scale / softcap
    softcap_log2,  # softcap * log2(e), SOFTCAP only
    # Integers annotated: an unannotated 1 would become a constexpr (one more compiled
    # variant, and `num_seqs` is reassigned in `_find_seq_idx`).
    sliding_window: tl.int32,  # keys within this many positions of the query, SLIDING only
    num_seqs: tl.int32,
    stride_query_t: tl.int64,
    stride_query_h: tl.int64,
    stride_out_t: tl.int64,
    stride_out_h: tl.int64,
    stride_cache_block: tl.int64,
    stride_cache_slot: tl.int64,
    stride_cache_head: tl.int64,
    stride_scale_block: tl.int64,
    stride_scale_slot: tl.int64,
    stride_block_table: tl.int64,
    NUM_Q_HEADS: tl.constexpr,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows of a program: BLOCK_Q tokens x NUM_QUERIES_PER_KV heads
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,  # context positions per iteration
    NUM_SEGMENTS: tl.constexpr,
    QUANTIZED: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,  # NUM_SEGMENTS == 1 only: a split decode's merge adds them
    DOT_DTYPE: tl.constexpr,  # the operands' type in tl.dot: the query's dtype
    DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)

    seq_idx = _find_seq_idx(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq_idx)
    q_len = tl.load(query_start_loc_ptr + seq_idx + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + seq_idx)
    if q_block_local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    context_start = seq_len - q_len  # context position of the sequence's first query token

    offs_m = tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)  # (HEAD_DIM_PADDED,)
    d_mask = offs_d < HEAD_DIM  # (HEAD_DIM_PADDED,)
    q_local = q_block_local * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV  # (BLOCK_M,)
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV  # (BLOCK_M,)
    row_mask = (offs_m < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_local < q_len)  # (BLOCK_M,)
    token = (q_start + q_local).to(tl.int64)  # (BLOCK_M,)
    q_pos = context_start + q_local  # (BLOCK_M,)

    # Q : (BLOCK_M, HEAD_DIM_PADDED)
    q_offs = token[:, None] * stride_query_t + head[:, None] * stride_query_h + offs_d[None, :]
    Q = tl.load(query_ptr + q_offs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    Q = Q.to(DOT_DTYPE)

    # Context positions this block's queries see (from the first query's window start to
    # the last query's causal limit), split into segments. Tiles wholly before the window
    # are never read.
    last_pos = context_start + tl.minimum((q_block_local + 1) * BLOCK_Q, q_len) - 1
    num_tiles = tl.cdiv(last_pos + 1, TILE_N)
    first_tile = 0
    if SLIDING:
        first_pos = context_start + q_block_local * BLOCK_Q - sliding_window + 1
        first_tile = tl.maximum(first_pos, 0) // TILE_N
    tiles_per_segment = tl.cdiv(num_tiles - first_tile, NUM_SEGMENTS)
    tile_lo = first_tile + segment * tiles_per_segment
    tile_hi = tl.minimum(tile_lo + tiles_per_segment, num_tiles)

    if HAS_SINKS:  # the sink is the softmax's first term: exp2(sink - M) == 1, no value
        M = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E  # (BLOCK_M,) log2
        L = tl.full([BLOCK_M], 1.0, dtype=tl.float32)  # (BLOCK_M,)
    else:
        M = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # (BLOCK_M,) running max, log2
        L = tl.zeros([BLOCK_M], dtype=tl.float32)  # (BLOCK_M,) running sum of exp2
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)  # (BLOCK_M, HEAD_DIM_PADDED)
    table_ptr = block_tables_ptr + seq_idx.to(tl.int64) * stride_block_table
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * TILE_N + tl.arange(0, TILE_N)  # (TILE_N,) context positions
        n_mask = offs_n <= last_pos  # (TILE_N,)
        physical_block = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
        slot = offs_n % BLOCK_SIZE  # (TILE_N,)
        kv_offs = (
            physical_block.to(tl.int64) * stride_cache_block
            + slot * stride_cache_slot
            + kv_head * stride_cache_head
        )  # (TILE_N,)
        # K : (HEAD_DIM_PADDED, TILE_N), V : (TILE_N, HEAD_DIM_PADDED)
        K = tl.load(
            key_cache_ptr + kv_offs[None, :] + offs_d[:, None],
            mask=d_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        V = tl.load(
            value_cache_ptr + kv_offs[:, None] + offs_d[None, :],
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )

        S = tl.dot(Q, K.to(DOT_DTYPE), input_precision=DOT_PRECISION)  # (BLOCK_M, TILE_N) fp32
        if QUANTIZED:
            scale_offs = (
                physical_block.to(tl.int64) * stride_scale_block
                + slot * stride_scale_slot
                + kv_head
            )
            k_scale = tl.load(key_scale_ptr + scale_offs, mask=n_mask, other=0.0)  # (TILE_N,)
            v_scale = tl.load(value_scale_ptr + scale_offs, mask=n_mask, other=0.0)  # (TILE_N,)
            S = S * (k_scale * qk_scale)[None, :]
        else:
            S = S * qk_scale
        if SOFTCAP:  # softcap * tanh(score / softcap), in the log2 domain
            S = (2.0 * tl.sigmoid(2.0 * S) - 1.0) * softcap_log2
        visible = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])  # (BLOCK_M, TILE_N)
        if SLIDING:
            visible &= offs_n[None, :] > q_pos[:, None] - sliding_window
        S = tl.where(visible, S, float("-inf"))

        # Online softmax; a row that has seen nothing yet keeps max -inf (then exp2 -> 0).
        M_new = tl.maximum(M, tl.max(S, axis=1))  # (BLOCK_M,)
        M_safe = tl.where(M_new > float("-inf"), M_new, 0.0)  # (BLOCK_M,)
        P = tl.math.exp2(S - M_safe[:, None])  # (BLOCK_M, TILE_N)
        alpha = tl.math.exp2(M - M_safe)  # (BLOCK_M,)
        L = L * alpha + tl.sum(P, axis=1)
        acc = acc * alpha[:, None]
        if QUANTIZED:
            P = P * v_scale[None, :]
        acc += tl.dot(P.to(DOT_DTYPE), V.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        M = M_new

    if NUM_SEGMENTS == 1:
        # acc : (BLOCK_M, HEAD_DIM_PADDED)
        # A padding row past the chunk's last query may see nothing (L == 0): never stored.
        out = acc / tl.where(L > 0.0, L, 1.0)[:, None]
        o_offs = token[:, None] * stride_out_t + head[:, None] * stride_out_h + offs_d[None, :]
        tl.store(
            out_ptr + o_offs,
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & d_mask[None, :],
        )
    else:
        row = (token * NUM_Q_HEADS + head) * NUM_SEGMENTS + segment  # (BLOCK_M,)
        tl.store(
            partial_out_ptr + row[:, None] * HEAD_DIM_PADDED + offs_d[None, :],
            acc,
            mask=row_mask[:, None],
        )
        tl.store(segment_max_ptr + row, M, mask=row_mask)
        tl.store(segment_sum_ptr + row, L, mask=row_mask)


@triton.jit
def _merge_segments_kernel(
    out_ptr,  # (T, NUM_Q_HEADS, HEAD_DIM)
    partial_out_ptr,  # (T, NUM_Q_HEADS, NUM_SEGMENTS, HEAD_DIM_PADDED) fp32
    segment_max_ptr,  # (T, NUM_Q_HEADS, NUM_SEGMENTS) fp32, log2 domain
    segment_sum_ptr,  # (T, NUM_Q_HEADS, NUM_SEGMENTS) fp32
    sinks_ptr,  # (NUM_Q_HEADS,) each head's sink logit, HAS_SINKS only
    stride_out_t: tl.int64,
    stride_out_h: tl.int64,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SEGMENTS)  # (NUM_SEGMENTS,)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)  # (HEAD_DIM_PADDED,)
    row = (token * NUM_Q_HEADS + head) * NUM_SEGMENTS + offs_s  # (NUM_SEGMENTS,)
    seg_max = tl.load(segment_max_ptr + row)  # (NUM_SEGMENTS,)
    seg_sum = tl.load(segment_sum_ptr + row)  # (NUM_SEGMENTS,)
    partial = tl.load(partial_out_ptr + row[:, None] * HEAD_DIM_PADDED + offs_d[None, :])
    # partial : (NUM_SEGMENTS, HEAD_DIM_PADDED); segment 0 always saw the first position
    # of the query's window (position 0 without one).
    top = tl.max(seg_max, axis=0)
    if HAS_SINKS:  # counted here once: the segments' softmaxes know no sink
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E  # log2
        top = tl.maximum(top, sink)
        denominator = tl.math.exp2(sink - top)
    else:
        denominator = 0.0
    weight = tl.math.exp2(seg_max - top)  # (NUM_SEGMENTS,), empty -> 0
    denominator += tl.sum(seg_sum * weight, axis=0)
    out = tl.sum(partial * weight[:, None], axis=0) / denominator
    tl.store(
        out_ptr + token * stride_out_t + head * stride_out_h + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


# -- launchers ---------------------------------------------------------------------------
def _check_cache(key_cache, value_cache, key_scale, value_scale, num_kv_heads, head_dim) -> None:
    if key_cache.dim() != 4 or key_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"key_cache must be (num_blocks, block_size, {num_kv_heads}, {head_dim}), "
            f"got {tuple(key_cache.shape)}"
        )
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise ValueError("value_cache must have key_cache's shape and dtype")
    if value_cache.stride() != key_cache.stride() or key_cache.stride(3) != 1:
        raise ValueError("key_cache and value_cache need equal strides and contiguous heads")
    if is_quantized(key_cache.dtype):
        for name, scale in (("key_scale", key_scale), ("value_scale", value_scale)):
            if scale is None or scale.shape != key_cache.shape[:3] or scale.dtype != SCALE_DTYPE:
                raise ValueError(
                    f"a {key_cache.dtype} cache needs {name} of shape "
                    f"{tuple(key_cache.shape[:3])} and dtype {SCALE_DTYPE}"
                )
            if scale.stride() != key_scale.stride() or scale.stride(2) != 1:
                raise ValueError("key_scale and value_scale need equal strides, heads contiguous")
        if (
            key_cache.dtype == torch.float8_e4m3fn
            and key_cache.is_cuda
            and torch.cuda.get_device_capability(key_cache.device) < (8, 9)
        ):
            raise ValueError("an fp8 KV cache needs compute capability 8.9+; use int8")
    elif key_scale is not None or value_scale is not None:
        raise ValueError(f"a {key_cache.dtype} cache takes no scales")


def _scale_args(key_scale, value_scale, key_cache):
    """Scale pointers and strides; an unquantized cache passes itself (never read)."""
    if key_scale is None:
        return key_cache, key_cache, 0, 0
    return key_scale, value_scale, key_scale.stride(0), key_scale.stride(1)


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
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError(
            f"key and value must both be (T, Hkv, D) with contiguous D, got "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be ({num_tokens},), got {tuple(slot_mapping.shape)}")
    _check_cache(key_cache, value_cache, key_scale, value_scale, num_kv_heads, head_dim)
    if num_tokens == 0:
        return
    quantized = is_quantized(key_cache.dtype)
    k_scale, v_scale, stride_scale_block, stride_scale_slot = _scale_args(
        key_scale, value_scale, key_cache
    )
    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        k_scale,
        v_scale,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        stride_scale_block,
        stride_scale_slot,
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=key_cache.shape[1],
        QUANTIZED=quantized,
        QMAX=QMAX.get(key_cache.dtype, 1.0),
        IS_FP8=key_cache.dtype == torch.float8_e4m3fn,
        MIN_AMAX=MIN_AMAX,
    )


def _dot_dtype(dtype: torch.dtype):
    # The Triton interpreter multiplies bfloat16 tiles as their raw uint16 bits; on the CPU
    # they go through float32 instead. Compiled kernels use the query's dtype.
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        return tl.float32
    return _DOT_DTYPES[dtype]


def _tile_shape(group: int, decode_only: bool, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_Q, TILE_N) of an attention launch.

    Decodes: 16 rows hold one token's group; prefill chunks: 64 rows of tokens x group.
    float32 multiplies on the FMA units ("ieee"), each thread holding whole rows of its
    operands: 16 rows and 16 positions for decodes and chunks alike, or ptxas spills
    registers at head_dim 128."""
    if dtype == torch.float32:
        rows, tile_n = 16, 16
    else:
        rows, tile_n = (16, 64) if decode_only else (64, 32)
    block_m = max(rows, triton.next_power_of_2(group))
    return block_m, block_m // group, tile_n


def _num_segments(num_programs: int, max_context: int, tile_n: int, device: torch.device) -> int:
    """Split decodes' contexts until the grid has about two programs per SM, keeping at
    least four tiles per segment."""
    sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 4
    )
    segments = 1
    while (
        segments < _MAX_SEGMENTS
        and num_programs * segments < 2 * sms
        and max_context >= 2 * segments * 4 * tile_n
    ):
        segments *= 2
    return segments


def prepare(metadata, block_size: int, sliding_windows: set[int | None]) -> None:
    """Nothing to build ahead: each launch finds its sequences from query_start_loc."""


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
    num_segments: int | None = None,  # decode-only batches; None: chosen from the grid size
    plan_cache: dict | None = None,  # the torch backend's per-pass cache; a launch needs none
    sliding_window: int | None = None,  # a query at p sees keys p - window + 1 .. p
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap) (Gemma 2)
    sinks: torch.Tensor | None = None,  # (Hq,) one more softmax logit per head (gpt-oss)
) -> torch.Tensor:
    """Causal attention of each sequence's query chunk over its paged context."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2] if key_cache.dim() == 4 else 0
    if query.dtype not in _DOT_DTYPES:
        raise ValueError(f"query must be float32, float16 or bfloat16, got {query.dtype}")
    if query.stride(2) != 1 or num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"query must be (T, Hq, D) with contiguous D and Hq a multiple of the cache's "
            f"KV heads, got query {tuple(query.shape)}, cache {tuple(key_cache.shape)}"
        )
    _check_cache(key_cache, value_cache, key_scale, value_scale, num_kv_heads, head_dim)
    if sinks is not None and (
        sinks.shape != (num_q_heads,)
        or sinks.stride(0) != 1
        or sinks.dtype not in _DOT_DTYPES
        or sinks.device != query.device
    ):
        raise ValueError(
            f"sinks must be ({num_q_heads},) contiguous, float32, float16 or bfloat16, on "
            f"{query.device}, got "
            f"{tuple(sinks.shape)} {sinks.dtype} on {sinks.device}"
        )
    num_seqs = block_tables.shape[0]
    if (
        block_tables.dim() != 2
        or seq_lens.shape != (num_seqs,)
        or query_start_loc.shape != (num_seqs + 1,)
        or block_tables.stride(1) != 1
    ):
        raise ValueError(
            f"block_tables (B, max_blocks) row-major, seq_lens (B,), query_start_loc (B + 1,) "
            f"expected, got {tuple(block_tables.shape)}, {tuple(seq_lens.shape)}, "
            f"{tuple(query_start_loc.shape)}"
        )
    if query_lens is None:
        query_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    if len(query_lens) != num_seqs or sum(query_lens) != num_tokens:
        raise ValueError(f"query_lens must give {num_seqs} lengths summing to {num_tokens}")
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out

    group = num_q_heads // num_kv_heads
    decode_only = max(query_lens) == 1
    block_m, block_q, tile_n = _tile_shape(group, decode_only, query.dtype)
    block_size = key_cache.shape[1]
    if num_segments is None:
        num_segments = 1
        if decode_only:
            max_context = block_tables.shape[1] * block_size
            if sliding_window is not None:  # what a decode reads at most
                max_context = min(max_context, sliding_window + tile_n)
            num_segments = _num_segments(num_seqs * num_kv_heads, max_context, tile_n, query.device)
    elif num_segments != 1 and (not decode_only or num_segments & (num_segments - 1)):
        raise ValueError("num_segments > 1 must be a power of two and needs a decode-only batch")

    head_dim_padded = max(16, triton.next_power_of_2(head_dim))
    if num_segments > 1:
        partial_out = torch.empty(
            num_tokens,
            num_q_heads,
            num_segments,
            head_dim_padded,
            dtype=torch.float32,
            device=query.device,
        )
        segment_max = torch.empty(
            num_tokens, num_q_heads, num_segments, dtype=torch.float32, device=query.device
        )
        segment_sum = torch.empty_like(segment_max)
    else:
        partial_out = segment_max = segment_sum = out  # never read or written
    k_scale, v_scale, stride_scale_block, stride_scale_slot = _scale_args(
        key_scale, value_scale, key_cache
    )
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_segments)
    _paged_attention_kernel[grid](
        out,
        partial_out,
        segment_max,
        segment_sum,
        query,
        key_cache,
        value_cache,
        k_scale,
        v_scale,
        block_tables,
        seq_lens,
        query_start_loc,
        query if sinks is None else sinks,  # not read without sinks
        scale * _LOG2E if softcap is None else scale / softcap,
        (softcap or 1.0) * _LOG2E,
        sliding_window or 1,
        num_seqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        stride_scale_block,
        stride_scale_slot,
        block_tables.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_QUERIES_PER_KV=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=tile_n,
        NUM_SEGMENTS=num_segments,
        QUANTIZED=is_quantized(key_cache.dtype),
        SLIDING=sliding_window is not None,
        SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None and num_segments == 1,
        DOT_DTYPE=_dot_dtype(query.dtype),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=NUM_WARPS,
        maxnreg=MAX_REGISTERS,
    )
    if num_segments > 1:
        _merge_segments_kernel[(num_tokens, num_q_heads)](
            out,
            partial_out,
            segment_max,
            segment_sum,
            query if sinks is None else sinks,
            out.stride(0),
            out.stride(1),
            NUM_Q_HEADS=num_q_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_PADDED=head_dim_padded,
            NUM_SEGMENTS=num_segments,
            HAS_SINKS=sinks is not None,
        )
    return out
