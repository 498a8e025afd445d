"""`layer_ops` as Triton kernels, one launch each, for the Triton (CUDA) backend: eager
PyTorch runs each op as several kernels (the norm's casts, reduction and scalings, the
residual add before it, rope's roll, products and sum, the activation and its product),
which at decode batch 1 makes the step launch-bound.

Each kernel computes in float32 and rounds to the tensor's dtype exactly where the eager ops
round, with floating-point contraction off (a fused multiply-add rounds once where torch
rounds twice), so the residual add and the rotary embedding give torch's bits; the norm
differs by its order of summation and its reciprocal square root, the activations by their
exponential: within two units in the last place of a 16-bit dtype.

Falls back to `layer_ops` for what the kernels do not take: tensors off the kernels' device
(CUDA, or the CPU under the Triton interpreter), dtypes other than float32/float16/bfloat16
or mixed ones, rows that are not contiguous, norms of rows wider than `MAX_NORM_SIZE`, and
inside torch.compile, which traces (and fuses) the eager ops instead.
"""

import os

import torch
import triton
import triton.language as tl

from pagefleet_kernels import layer_ops

__all__ = ["act_and_mul", "add_rms_norm", "rms_norm", "rope"]

# The interpreter is chosen when `triton.jit` decorates the kernels, at import: it runs them
# on CPU tensors, compiled kernels need CUDA ones. (The ahead-of-time compile test records
# launches of CPU tensors without the interpreter by setting this to "cpu".)
KERNEL_DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# A norm holds its whole row in registers: 16 warps of 32 threads, 32 floats each, at most.
MAX_NORM_SIZE = 16384
# Elements of one program's tile: rows narrower than this share a program (a row of 64-128
# rotary dimensions alone would leave most of a program's threads idle; the interpreter,
# which runs one program at a time, gains most).
TILE_ELEMENTS = 2048
# Every launch: a multiply and an add stay two roundings (see the module docstring).
_EXACT = {"enable_fp_fusion": False}


@triton.jit
def _round(x, dtype: tl.constexpr):
    """float32 x rounded to dtype, to nearest even as torch rounds. bfloat16 by hand, the
    same integer steps compiled and interpreted: the Triton interpreter's own float32 ->
    bfloat16 cast truncates (and its "rtne" rounds ties away from zero)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        bits = tl.where(x == x, bits, 0x7FC0)  # a NaN stays one (its payload could carry)
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def _program_rows(BLOCK_R: tl.constexpr, num_heads):
    """This program's (token, head) rows of a (T, H, ...) tensor: the flat row index, its
    token (int64, for offsets) and its head."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    return rows, (rows // num_heads).to(tl.int64), rows % num_heads


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # (T, H, N) contiguous
    sum_ptr,  # (T, N) contiguous: round(x + h), ADD only
    x_ptr,  # (T, H, N), N contiguous; H == 1 with ADD
    h_ptr,  # (T, N), N contiguous, ADD only
    weight_ptr,  # (N,)
    num_rows: tl.int32,  # T * H
    num_heads: tl.int32,  # H
    size: tl.int32,  # N
    eps,
    stride_x_t: tl.int64,
    stride_x_h: tl.int64,
    stride_h_t: tl.int64,
    BLOCK_R: tl.constexpr,  # (token, head) rows of a program
    BLOCK_N: tl.constexpr,
    ADD: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
):
    dtype = out_ptr.dtype.element_ty
    rows, token, head = _program_rows(BLOCK_R, num_heads)  # (BLOCK_R,) each
    offs = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    mask = (rows < num_rows)[:, None] & (offs < size)[None, :]  # (BLOCK_R, BLOCK_N)
    x_offs = (token * stride_x_t + head * stride_x_h)[:, None] + offs[None, :]
    s = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)  # (BLOCK_R, BLOCK_N)
    out_offs = rows.to(tl.int64)[:, None] * size + offs[None, :]  # (BLOCK_R, BLOCK_N)
    if ADD:
        h_offs = (token * stride_h_t)[:, None] + offs[None, :]
        h = tl.load(h_ptr + h_offs, mask=mask, other=0.0).to(tl.float32)
        total = _round(s + h, dtype)  # (BLOCK_R, BLOCK_N)
        tl.store(sum_ptr + out_offs, total, mask=mask)
        s = total.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(s * s, axis=1) / size + eps)  # (BLOCK_R,)
    normed = s * inv_rms[:, None]  # (BLOCK_R, BLOCK_N)
    weight = tl.load(weight_ptr + offs, mask=offs < size, other=0.0).to(tl.float32)[None, :]
    if UNIT_OFFSET:  # noqa: SIM108 - Triton's constexpr branch; Gemma: (1 + weight), one rounding
        y = normed * (1.0 + weight)
    else:  # Hugging Face's: the normed value rounded before the weight multiplies it
        y = weight * _round(normed, dtype).to(tl.float32)
    tl.store(out_ptr + out_offs, _round(y, dtype), mask=mask)


@triton.jit
def _rope_kernel(
    out_ptr,  # (T, H, HEAD_DIM) contiguous
    x_ptr,  # (T, H, HEAD_DIM), HEAD_DIM contiguous
    cos_ptr,  # (T, HEAD_DIM), HEAD_DIM contiguous
    sin_ptr,  # (T, HEAD_DIM) like cos, its first half negated
    num_rows: tl.int32,  # T * H
    num_heads: tl.int32,  # H
    stride_x_t: tl.int64,
    stride_x_h: tl.int64,
    stride_table_t: tl.int64,  # cos's and sin's
    BLOCK_R: tl.constexpr,  # (token, head) rows of a program
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
):
    dtype = out_ptr.dtype.element_ty
    rows, token, head = _program_rows(BLOCK_R, num_heads)  # (BLOCK_R,) each
    offs = tl.arange(0, HEAD_DIM_PADDED)  # (HEAD_DIM_PADDED,)
    mask = (rows < num_rows)[:, None] & (offs < HEAD_DIM)[None, :]  # (BLOCK_R, HEAD_DIM_PADDED)
    x_rows = x_ptr + (token * stride_x_t + head * stride_x_h)[:, None]  # (BLOCK_R, 1)
    x = tl.load(x_rows + offs[None, :], mask=mask, other=0.0)  # (BLOCK_R, HEAD_DIM_PADDED)
    # roll(x, HEAD_DIM / 2): the other half of each row
    rotated = tl.load(x_rows + ((offs + HEAD_DIM // 2) % HEAD_DIM)[None, :], mask=mask, other=0.0)
    table_offs = (token * stride_table_t)[:, None] + offs[None, :]  # (BLOCK_R, HEAD_DIM_PADDED)
    cos = tl.load(cos_ptr + table_offs, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + table_offs, mask=mask, other=0.0).to(tl.float32)
    # Each product rounded to the dtype, then their sum: torch's three roundings.
    a = _round(x.to(tl.float32) * cos, dtype).to(tl.float32)
    b = _round(rotated.to(tl.float32) * sin, dtype).to(tl.float32)
    out_offs = rows.to(tl.int64)[:, None] * HEAD_DIM + offs[None, :]
    tl.store(out_ptr + out_offs, _round(a + b, dtype), mask=mask)


@triton.jit
def _act_and_mul_kernel(
    out_ptr,  # (T, I) contiguous
    gate_up_ptr,  # (T, 2I) = [gate | up], 2I contiguous
    num_rows: tl.int32,  # T
    size: tl.int32,  # I
    stride_gate_up_t: tl.int64,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GELU: tl.constexpr,
):
    dtype = out_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    mask = (rows < num_rows)[:, None] & (offs < size)[None, :]  # (BLOCK_R, BLOCK_N)
    gate_offs = rows.to(tl.int64)[:, None] * stride_gate_up_t + offs[None, :]
    g = tl.load(gate_up_ptr + gate_offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + gate_offs + size, mask=mask, other=0.0).to(tl.float32)
    # torch's formulas with exp of a non-positive argument only (no overflow to inf).
    if GELU:  # 0.5 g (1 + tanh(y)), and 1 + tanh(y) = 2 / (1 + exp(-2y))
        y = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        e = tl.exp(-2.0 * tl.abs(y))
        # for y < 0, 2e / (1 + e): no cancellation of 1 + tanh(y) near -1
        act = 0.5 * g * tl.where(y >= 0, 2.0 / (1.0 + e), 2.0 * e / (1.0 + e))
    else:  # g * sigmoid(g)
        e = tl.exp(-tl.abs(g))
        act = tl.where(g >= 0, g / (1.0 + e), g * e / (1.0 + e))
    out = _round(act, dtype).to(tl.float32) * up  # the activation rounded, then the product
    out_offs = rows.to(tl.int64)[:, None] * size + offs[None, :]
    tl.store(out_ptr + out_offs, _round(out, dtype), mask=mask)


# -- launchers ---------------------------------------------------------------------------
def _takes(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: on their device, one dtype of theirs for all,
    rows contiguous, not empty, and not traced by torch.compile."""
    first = tensors[0]
    return (
        first.device.type == KERNEL_DEVICE
        and first.dtype in _DTYPES
        and first.numel() > 0
        and all(
            t.device == first.device and t.dtype == first.dtype and t.stride(-1) == 1
            for t in tensors
        )
        and not torch.compiler.is_compiling()
    )


def _tile(size: int) -> tuple[int, int, int]:
    """(rows, padded row size, warps) of a program over rows of `size` elements: whole rows
    (a norm needs them), as many as make TILE_ELEMENTS, 16 elements a thread (32 for the
    widest norms)."""
    block_n = triton.next_power_of_2(size)
    block_r = max(1, TILE_ELEMENTS // block_n)
    return block_r, block_n, min(16, block_r * block_n // 512)


def _launch_norm(x, h, weight, eps: float, unit_offset: bool):
    """The norm of each (token, head) row of x (T, H, N) or (T, N); with h (T, N), of x + h,
    whose rounded value is returned too."""
    rows = x if x.dim() == 3 else x.unsqueeze(1)  # (T, H, N)
    tokens, heads, size = rows.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device) if h is not None else out
    block_r, block_n, num_warps = _tile(size)
    _rms_norm_kernel[(triton.cdiv(tokens * heads, block_r),)](
        out,
        total,
        rows,
        rows if h is None else h,
        weight,
        tokens * heads,
        heads,
        size,
        eps,
        rows.stride(0),
        rows.stride(1),
        0 if h is None else h.stride(0),
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        ADD=h is not None,
        UNIT_OFFSET=unit_offset,
        num_warps=num_warps,
        **_EXACT,
    )
    return total, out


def _norm_takes(x, weight) -> bool:
    return (
        _takes(x, weight)
        and x.dim() in (2, 3)
        and weight.shape == x.shape[-1:]
        and x.shape[-1] <= MAX_NORM_SIZE
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> torch.Tensor:
    if not _norm_takes(x, weight):
        return layer_ops.rms_norm(x, weight, eps, unit_offset)
    return _launch_norm(x, None, weight, eps, unit_offset)[1]


def add_rms_norm(
    x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    if not (_norm_takes(x, weight) and _takes(x, h) and x.dim() == 2 and h.shape == x.shape):
        return layer_ops.add_rms_norm(x, h, weight, eps, unit_offset)
    return _launch_norm(x, h, weight, eps, unit_offset)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) with any token and head strides (q and k as one view of the fused q/k/v
    rows); cos and sin (T, D) with equal strides."""
    if not (
        _takes(x, cos, sin)
        and x.dim() == 3
        and x.shape[2] % 2 == 0
        and cos.shape == (x.shape[0], x.shape[2])
        and sin.shape == cos.shape
        and sin.stride() == cos.stride()
    ):
        return layer_ops.rope(x, cos, sin)
    tokens, heads, head_dim = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block_r, head_dim_padded, num_warps = _tile(head_dim)
    _rope_kernel[(triton.cdiv(tokens * heads, block_r),)](
        out,
        x,
        cos,
        sin,
        tokens * heads,
        heads,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        BLOCK_R=block_r,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        num_warps=num_warps,
        **_EXACT,
    )
    return out


def act_and_mul(gate_up: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    if not (_takes(gate_up) and gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0):
        return layer_ops.act_and_mul(gate_up, gelu)
    tokens, size = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(tokens, size, dtype=gate_up.dtype, device=gate_up.device)
    # Rows wider than a tile are split across programs (no reduction needs them whole).
    block_r, block_n, num_warps = _tile(min(size, TILE_ELEMENTS))
    grid = (triton.cdiv(tokens, block_r), triton.cdiv(size, block_n))
    _act_and_mul_kernel[grid](
        out,
        gate_up,
        tokens,
        size,
        gate_up.stride(0),
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        GELU=gelu,
        num_warps=num_warps,
        **_EXACT,
    )
    return out
