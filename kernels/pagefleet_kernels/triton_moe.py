"""The mixture-of-experts operator (see `pagefleet_kernels.moe`) as a grouped GEMM in
Triton, as vLLM's fused_moe computes it: the (token, expert) pairs are sorted by expert and
each expert's run padded to whole tiles of BLOCK_M rows (`align_by_expert`, a few torch ops
on the device, no host synchronisation), so that every tile of rows belongs to one expert
and one kernel launch multiplies all experts' rows by their own weights, reading each
chosen expert's matrix once per tile column and no other expert's at all. Two launches: the
[gate | up] projection of the gathered token rows, the activation (`triton_layer_ops`),
then the down projection with the routing weight applied, written per pair and summed over
each token's k pairs.

Float32 tiles multiply in full float32 (`input_precision="ieee"`, not TF32). Falls back to
`moe.grouped_fused_moe` for what the kernel does not take (as `triton_layer_ops` does).
"""

import os

import torch
import triton
import triton.language as tl

from pagefleet_kernels import moe, triton_layer_ops
from pagefleet_kernels.triton_layer_ops import _round

__all__ = ["align_by_expert", "fused_moe"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The Triton interpreter multiplies bfloat16 tiles as their integer bits: there they are
# widened to float32 first (exact products, float32 sums, as the tensor cores compute).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_N = 64
BLOCK_K = 32


@triton.jit
def _grouped_gemm_kernel(
    out_ptr,  # (P, N) contiguous, P = T * k pairs
    a_ptr,  # (P // a_row_divisor, K), K contiguous: token rows (first GEMM) or pair rows
    b_ptr,  # (E, N, K), K contiguous: each expert's weight as F.linear takes it
    weights_ptr,  # (P,) routing weights, read with MUL_WEIGHTS
    sorted_pairs_ptr,  # (num_blocks * BLOCK_M,) int64 pair ids by expert, padded with P
    block_experts_ptr,  # (num_blocks,) int64 each tile's expert, -1 past the last
    num_pairs: tl.int32,  # P
    n_size: tl.int32,  # N
    k_size: tl.int32,  # K
    a_row_divisor: tl.int32,  # k for the token rows, 1 for pair rows
    stride_a: tl.int64,
    stride_b_e: tl.int64,
    stride_b_n: tl.int64,
    stride_out: tl.int64,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MUL_WEIGHTS: tl.constexpr,
    PRECISION: tl.constexpr,  # tl.dot's input_precision
    WIDEN: tl.constexpr,  # multiply float32 copies of the tiles (see _INTERPRETED)
):
    dtype = out_ptr.dtype.element_ty
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:  # a tile past the last expert's run
        return
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # (BLOCK_M,)
    valid = pairs < num_pairs  # (BLOCK_M,)
    a_rows = pairs // a_row_divisor  # (BLOCK_M,) int64
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    offs_k = tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    a_ptrs = a_ptr + a_rows[:, None] * stride_a + offs_k[None, :]  # (BLOCK_M, BLOCK_K)
    b_ptrs = (  # (BLOCK_K, BLOCK_N): the weight's rows offs_n, transposed
        b_ptr + expert * stride_b_e + offs_n[None, :].to(tl.int64) * stride_b_n + offs_k[:, None]
    )
    n_mask = offs_n < n_size  # (BLOCK_N,)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # (BLOCK_M, BLOCK_N)
    for k_start in range(0, k_size, BLOCK_K):
        k_mask = offs_k < k_size - k_start  # (BLOCK_K,)
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if WIDEN:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if MUL_WEIGHTS:  # the product rounded, then weighted: the reference's two roundings
        weight = tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
        acc = _round(acc, dtype).to(tl.float32) * weight[:, None]
    out_ptrs = out_ptr + pairs[:, None] * stride_out + offs_n[None, :]  # (BLOCK_M, BLOCK_N)
    tl.store(out_ptrs, _round(acc, dtype), mask=valid[:, None] & n_mask[None, :])


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs, block_experts): the pair ids (t * k + j) grouped by expert, each
    expert's run padded with the id P = T * k to a multiple of `block_m`, and each tile's
    expert (-1 for the tiles past the last run). Sized by the bound P + (experts chosen at
    most) * (block_m - 1), so that nothing waits on the device to learn the real size."""
    flat = topk_ids.flatten()
    num_pairs = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)  # (E,)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)  # (P,)
    experts = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - (counts.cumsum(0) - counts)[experts]
    capacity = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    capacity = triton.cdiv(capacity, block_m) * block_m
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int64, device=flat.device)
    sorted_pairs[(padded_end - padded)[experts] + rank] = order
    block_starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return sorted_pairs, block_experts


def _block_m(num_pairs: int, num_experts: int) -> int:
    """Rows of a tile: about the rows an expert gets (16 at decode, where most experts get
    one or two), at most 64."""
    return min(64, max(16, triton.next_power_of_2(num_pairs // num_experts)))


def _launch(out, a, b, weights, sorted_pairs, block_experts, block_m, a_row_divisor) -> None:
    num_pairs, n_size = out.shape
    widen = _INTERPRETED and out.dtype == torch.bfloat16
    grid = (block_experts.numel(), triton.cdiv(n_size, BLOCK_N))
    _grouped_gemm_kernel[grid](
        out,
        a,
        b,
        out if weights is None else weights,  # not read without MUL_WEIGHTS
        sorted_pairs,
        block_experts,
        num_pairs,
        n_size,
        b.shape[2],
        a_row_divisor,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        MUL_WEIGHTS=weights is not None,
        PRECISION="ieee" if out.dtype == torch.float32 or widen else "tf32",
        WIDEN=widen,
        num_warps=4,
    )


def _takes(x, gate_up, down, topk_weights) -> bool:
    tensors = (x, gate_up, down, topk_weights)
    return (
        x.device.type == triton_layer_ops.KERNEL_DEVICE
        and x.dtype in _DTYPES
        and x.dim() == 2
        and x.shape[0] > 0
        and all(t.device == x.device and t.dtype == x.dtype for t in tensors)
        and all(t.stride(-1) == 1 for t in (x, gate_up, down))
        and gate_up.shape[2] == x.shape[1] == down.shape[1]
        and gate_up.shape[1] == 2 * down.shape[2]
        and not torch.compiler.is_compiling()
    )


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gelu: bool = False,
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: moe.ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """gpt-oss's variant: each pair's expert biases are added to the GEMMs' rows (gathered
    by the pair's expert), its activation is the eager one, and the routing weight is
    applied after the down bias, outside the second GEMM."""
    variant = {"gate_up_bias": gate_up_bias, "down_bias": down_bias, "activation": activation}
    if not _takes(x, gate_up, down, topk_weights):
        return moe.grouped_fused_moe(x, gate_up, down, topk_weights, topk_ids, gelu, **variant)
    num_tokens, top_k = topk_ids.shape
    num_experts, hidden = gate_up.shape[0], x.shape[1]
    num_pairs = num_tokens * top_k
    block_m = _block_m(num_pairs, num_experts)
    sorted_pairs, block_experts = align_by_expert(topk_ids, num_experts, block_m)
    gate_up_rows = torch.empty(num_pairs, gate_up.shape[1], dtype=x.dtype, device=x.device)
    _launch(gate_up_rows, x, gate_up, None, sorted_pairs, block_experts, block_m, top_k)
    pair_experts = topk_ids.flatten()  # (P,) each pair's expert
    if gate_up_bias is not None:
        gate_up_rows += gate_up_bias[pair_experts]
    if activation is None:
        hidden_rows = triton_layer_ops.act_and_mul(gate_up_rows, gelu)  # (P, I)
    else:
        hidden_rows = activation(gate_up_rows)
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    weights = topk_weights.contiguous().flatten()
    if down_bias is None:
        _launch(out, hidden_rows, down, weights, sorted_pairs, block_experts, block_m, 1)
    else:  # (rows @ down + bias) * weight: the weight after the bias
        _launch(out, hidden_rows, down, None, sorted_pairs, block_experts, block_m, 1)
        out = (out + down_bias[pair_experts]) * weights[:, None]
    # Each token's k weighted rows summed in float32 (the reference adds them one by one
    # in expert order: the same sum for k = 2, within a rounding above).
    return out.view(num_tokens, top_k, hidden).float().sum(dim=1).to(x.dtype)
