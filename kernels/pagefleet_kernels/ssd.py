"""Mamba2's selective state space model (state space duality, SSD).

Per head h a (P, N) state S is decayed by exp(dt_t A_h) and fed the token's input through
B_t; C_t reads it, and D skips past it:

    dt_t = clamp(softplus(dt_t + dt_bias), *dt_limit)
    S <- exp(dt_t A) S + dt_t x_t B_t^T
    y_t = S C_t + D x_t

B and C have G groups, each serving H / G consecutive heads.

- x: (T, H, P); dt: (T, H) before its bias and softplus; A: (H,) (-exp(A_log), < 0)
- B, C: (T, G, N); D, dt_bias: (H,) or None; dt_limit: (low, high)
- state: (num_slots, H, P, N), float32 (or the dtype the engine keeps it in), updated in
  place; meta: `state_batch.StateMetadata`

returns y (T, H, P) in x's dtype; everything is computed in float32.

The clamp is applied to every token: mamba_ssm and transformers clamp the chunked scan's dt
but not the decode step's, so a token's output would depend on how its prompt was chunked;
the families served set no limit (0, inf), where both agree.

`ssd_reference` is the recurrence a token at a time (the torch backend's). `ssd` runs the
one-token sequences as one batched step (mamba_ssm's selective_state_update) and each
longer sequence in chunks of `chunk_size` (its mamba_chunk_scan_combined): within a chunk
the outputs are a masked (C B^T) product over the inputs, attention-like; the state passes
from chunk to chunk once per chunk.
"""

from itertools import pairwise

import torch
import torch.nn.functional as F

from pagefleet_kernels.state_batch import StateMetadata, initial_rows

__all__ = ["ssd", "ssd_reference"]


def time_steps(
    dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_limit: tuple[float, float]
) -> torch.Tensor:
    """(T, H) float32 dt after its bias, softplus and limits."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    return F.softplus(dt).clamp(dt_limit[0], dt_limit[1])


def _skip(y: torch.Tensor, x: torch.Tensor, D: torch.Tensor | None) -> torch.Tensor:
    return y if D is None else y + D.float()[:, None] * x


def ssd_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    state: torch.Tensor,
    meta: StateMetadata,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    chunk_size: int = 256,  # the definition runs a token at a time: no chunks
) -> torch.Tensor:
    heads, groups = x.shape[1], B.shape[1]
    dt = time_steps(dt, dt_bias, dt_limit)
    inputs = x.float()
    B = B.float().repeat_interleave(heads // groups, dim=1)  # (T, H, N)
    C = C.float().repeat_interleave(heads // groups, dim=1)
    out = torch.empty_like(x)
    for i, (start, end) in enumerate(pairwise(meta.starts)):
        slot = int(meta.state_indices[i])
        s = state[slot].float()  # (H, P, N)
        if not bool(meta.has_initial_state[i]):
            s = torch.zeros_like(s)
        for t in range(start, end):
            decay = (dt[t] * A.float()).exp()
            s = s * decay[:, None, None] + (dt[t, :, None] * inputs[t])[:, :, None] * B[t, :, None]
            out[t] = _skip((s * C[t, :, None]).sum(-1), inputs[t], D).to(x.dtype)
        if end > start:
            state[slot] = s.to(state.dtype)
    return out


def _step(x, dt, A, B, C, s: torch.Tensor) -> torch.Tensor:
    """One token of S sequences: x (S, H, P), dt (S, H), B and C (S, G, N), s (S, H, P, N)
    updated in place; returns S C (S, H, P) without the skip."""
    groups, heads = B.shape[1], x.shape[1]
    s.mul_((dt * A).exp()[:, :, None, None])
    grouped = s.view(s.shape[0], groups, heads // groups, *s.shape[2:])  # (S, G, R, P, N)
    inputs = (dt[:, :, None] * x).view(x.shape[0], groups, heads // groups, -1)
    grouped.add_(inputs[..., None] * B[:, :, None, None, :])
    return torch.einsum("sgrpn,sgn->sgrp", grouped, C).reshape(x.shape)


def _chunked(x, dt, A, B, C, s: torch.Tensor, chunk_size: int):
    """One sequence: x (L, H, P), dt (L, H) after softplus, B and C (L, G, N), in float32,
    from state s (H, P, N); returns (S C over its tokens (L, H, P), the final state).

    Heads are grouped as (G, R) so that B and C are never repeated per head. Within a chunk,
    with a_t = cumulative dt A from its start to t inclusive: y_t = sum_{j<=t}
    exp(a_t - a_j) dt_j (C_t.B_j) x_j + exp(a_t) S0 C_t, and the next S0 =
    exp(a_last) S0 + sum_j exp(a_last - a_j) dt_j x_j B_j^T."""
    length, heads, dim = x.shape
    groups = B.shape[1]
    size = min(chunk_size, length)
    chunks = -(-length // size)
    pad = chunks * size - length

    def chunked(t: torch.Tensor) -> torch.Tensor:  # (L, K, ...) -> (K, n, Q, ...)
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, 0, 0, pad))
        return t.reshape(chunks, size, *t.shape[1:]).movedim(2, 0)

    x, dt, B, C = chunked(x), chunked(dt), chunked(B), chunked(C)
    log_decay = (dt * A[:, None, None]).cumsum(-1)  # (H, n, Q)
    causal = torch.ones(size, size, dtype=torch.bool, device=x.device).tril()
    relative = (log_decay[..., :, None] - log_decay[..., None, :]).masked_fill(~causal, -torch.inf)
    weights = relative.exp() * dt[..., None, :]  # (H, n, Q, Q): exp(a_t - a_j) dt_j
    scores = C @ B.transpose(-1, -2)  # (G, n, Q, Q)
    repeat = heads // groups
    grouped_weights = weights.view(groups, repeat, chunks, size, size) * scores[:, None]
    x = x.reshape(groups, repeat, chunks, size, dim)
    out = grouped_weights @ x  # (G, R, n, Q, P)
    to_end = ((log_decay[..., -1:] - log_decay).exp() * dt).view(groups, repeat, chunks, size)
    # each chunk's contribution to the state at its end: (G, R, n, P, N)
    contributions = (x * to_end[..., None]).transpose(-1, -2) @ B[:, None]
    from_start = log_decay.exp().view(groups, repeat, chunks, size, 1)
    chunk_decay = log_decay[..., -1].exp().view(groups, repeat, chunks, 1, 1)
    s = s.view(groups, repeat, dim, -1)
    for c in range(chunks):
        out[:, :, c] += (C[:, None, c] @ s.transpose(-1, -2)) * from_start[:, :, c]
        s = s * chunk_decay[:, :, c] + contributions[:, :, c]
    out = out.reshape(heads, chunks * size, dim)[:, :length].transpose(0, 1)
    return out, s.reshape(heads, dim, -1)


def ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    state: torch.Tensor,
    meta: StateMetadata,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    chunk_size: int = 256,
) -> torch.Tensor:
    split = meta.split()
    dt = time_steps(dt, dt_bias, dt_limit)
    A = A.float()
    out = torch.empty_like(x)
    if split.step_rows.numel():
        rows = split.step_rows
        s = initial_rows(state, split.step_slots, split.step_initial, torch.float32)
        inputs = x[rows].float()
        y = _step(inputs, dt[rows], A, B[rows].float(), C[rows].float(), s)
        state.index_copy_(0, split.step_slots, s.to(state.dtype))
        out[rows] = _skip(y, inputs, D).to(x.dtype)
    for start, end, i in split.chunks:
        slot = meta.state_indices[i : i + 1]
        s = initial_rows(state, slot, meta.has_initial_state[i : i + 1], torch.float32)[0]
        inputs = x[start:end].float()
        y, s = _chunked(
            inputs, dt[start:end], A, B[start:end].float(), C[start:end].float(), s, chunk_size
        )
        state[slot] = s.to(state.dtype)[None]
        out[start:end] = _skip(y, inputs, D).to(x.dtype)
    return out
