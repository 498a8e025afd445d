"""The batched LoRA operator (`lora_ops.add_lora`) as two Triton kernels for decode-sized
steps, Punica's BGMV: each program takes one row and reads that row's own adapter slot
from the stacked weights, so a batch mixing adapters costs two launches whatever it mixes.
The shrink writes each row's x @ A_s^T (float32) to a scratch buffer, the expand adds
(that) @ B_s^T to the row's output in float32 and rounds once.

A row reads its slot's whole A and B; with many rows the gathered GEMMs of `lora_ops` read
each slot's weights once instead, so steps of more than `MAX_ROWS` rows (prefill chunks)
take that path, as do tensors off the kernels' device, other dtypes, ranks above
`MAX_RANK` and calls inside torch.compile.
"""

import torch
import triton
import triton.language as tl

from pagefleet_kernels import lora_ops
from pagefleet_kernels.metadata import LoRAMapping
from pagefleet_kernels.triton_layer_ops import KERNEL_DEVICE

__all__ = ["add_lora"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_ROWS = 64
MAX_RANK = 512  # the expand holds a row's whole rank (padded) in registers
# A shrink program holds a row's whole rank (padded) and this many (rank x inputs) elements
# of A per iteration.
SHRINK_TILE = 8192
BLOCK_N = 128  # outputs per expand program


@triton.jit
def _lora_shrink_kernel(
    out_ptr,  # (T, R) float32, contiguous
    x_ptr,  # (T, K), K contiguous
    a_ptr,  # (S, R, K), K contiguous
    slots_ptr,  # (T,) int64: each row's slot, -1 for none
    rank: tl.int32,  # R
    fan_in: tl.int32,  # K
    stride_x_t: tl.int64,
    stride_a_s: tl.int64,
    stride_a_r: tl.int64,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row)  # scalar int64
    # A row without an adapter reads and writes nothing: its bounds become 0.
    rank_end = tl.where(slot >= 0, rank, 0)
    inputs_end = tl.where(slot >= 0, fan_in, 0)
    slot = tl.maximum(slot, 0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)  # (BLOCK_R,)
    for k0 in range(0, fan_in, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)  # (BLOCK_K,)
        x_mask = k < inputs_end
        x = tl.load(x_ptr + row * stride_x_t + k, mask=x_mask, other=0.0).to(tl.float32)
        a_offs = slot * stride_a_s + r.to(tl.int64)[:, None] * stride_a_r + k[None, :]
        a_mask = (r < rank_end)[:, None] & x_mask[None, :]  # (BLOCK_R, BLOCK_K)
        a = tl.load(a_ptr + a_offs, mask=a_mask, other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(out_ptr + row * rank + r, acc, mask=r < rank_end)


@triton.jit
def _lora_expand_kernel(
    y_ptr,  # (T, N), N contiguous: added to in place
    shrunk_ptr,  # (T, R) float32, contiguous
    b_ptr,  # (S, N, R), R contiguous
    slots_ptr,  # (T,) int64: each row's slot, -1 for none
    fan_out: tl.int32,  # N
    rank: tl.int32,  # R
    stride_y_t: tl.int64,
    stride_b_s: tl.int64,
    stride_b_n: tl.int64,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,  # R padded: a row's whole rank
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row)  # scalar int64
    # A row without an adapter reads and writes nothing: its bounds become 0.
    rank_end = tl.where(slot >= 0, rank, 0)
    outputs_end = tl.where(slot >= 0, fan_out, 0)
    slot = tl.maximum(slot, 0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    r = tl.arange(0, BLOCK_R)  # (BLOCK_R,)
    r_mask = r < rank_end
    s = tl.load(shrunk_ptr + row * rank + r, mask=r_mask, other=0.0)  # (BLOCK_R,)
    n_mask = n < outputs_end
    b_offs = slot * stride_b_s + n.to(tl.int64)[:, None] * stride_b_n + r[None, :]
    b_mask = n_mask[:, None] & r_mask[None, :]  # (BLOCK_N, BLOCK_R)
    b = tl.load(b_ptr + b_offs, mask=b_mask, other=0.0).to(tl.float32)
    delta = tl.sum(b * s[None, :], axis=1)  # (BLOCK_N,)
    y_offs = row * stride_y_t + n
    y = tl.load(y_ptr + y_offs, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + y_offs, (y + delta).to(y_ptr.dtype.element_ty), mask=n_mask)


def _takes(y, x, lora_a, lora_b) -> bool:
    tensors = (y, x, lora_a, lora_b)
    return (
        y.device.type == KERNEL_DEVICE
        and 0 < y.shape[0] <= MAX_ROWS
        and lora_a.shape[1] <= MAX_RANK
        and y.dtype in _DTYPES
        and all(t.device == y.device and t.dtype == y.dtype and t.stride(-1) == 1 for t in tensors)
        and lora_a.is_contiguous()
        and lora_b.is_contiguous()
        and not torch.compiler.is_compiling()
    )


def add_lora(
    y: torch.Tensor,  # (T, N), added to in place
    x: torch.Tensor,  # (T, K)
    lora_a: torch.Tensor,  # (S, R, K)
    lora_b: torch.Tensor,  # (S, N, R)
    mapping: LoRAMapping,
    parts: tuple[int, ...] = (),  # lora_b's blocks: read whole (see `AddLoRAOp`)
) -> None:
    """`lora_ops.add_lora`, in two launches for up to MAX_ROWS rows (see the module
    docstring for what goes to the PyTorch form instead)."""
    if not _takes(y, x, lora_a, lora_b):
        lora_ops.add_lora(y, x, lora_a, lora_b, mapping)
        return
    rows, fan_out = y.shape
    num_slots, rank, fan_in = lora_a.shape
    if x.shape != (rows, fan_in) or lora_b.shape != (num_slots, fan_out, rank):
        raise ValueError(
            f"add_lora: x {tuple(x.shape)}, lora_a {tuple(lora_a.shape)} and lora_b "
            f"{tuple(lora_b.shape)} do not fit y {tuple(y.shape)}"
        )
    slots = mapping.token_slots
    if slots.shape != (rows,) or slots.dtype != torch.int64 or slots.device != y.device:
        raise ValueError(f"add_lora: token_slots must be ({rows},) int64 on {y.device}")
    shrunk = torch.empty(rows, rank, dtype=torch.float32, device=y.device)
    block_r = triton.next_power_of_2(rank)
    block_k = max(16, min(128, SHRINK_TILE // block_r))
    _lora_shrink_kernel[(rows, 1)](
        shrunk,
        x,
        lora_a,
        slots,
        rank,
        fan_in,
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        BLOCK_R=block_r,
        BLOCK_K=block_k,
    )
    _lora_expand_kernel[(rows, triton.cdiv(fan_out, BLOCK_N))](
        y,
        shrunk,
        lora_b,
        slots,
        fan_out,
        rank,
        y.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        BLOCK_N=BLOCK_N,
        BLOCK_R=block_r,
    )
