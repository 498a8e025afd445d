"""The gated delta rule: the linear attention of Gated DeltaNet (Qwen3-Next, Qwen3.5).

Per value head a (Dk, Dv) state S is decayed, corrected towards each token's value by the
delta rule, and read by its query:

    S <- exp(g_t) S
    S <- S + beta_t k_t (v_t - S^T k_t)^T
    o_t = S^T q_t

with q and k L2-normalised (`l2norm_qk`, as the families ask) and q scaled by `scale`.
Each query/key head serves Hv / Hk consecutive value heads.

- q, k: (T, Hk, Dk); v: (T, Hv, Dv); g: (T, Hv) the log decay (<= 0); beta: (T, Hv)
- state: (num_slots, Hv, Dk, Dv), float32 (or the dtype the engine keeps it in), updated in
  place; meta: `state_batch.StateMetadata`

returns (T, Hv, Dv) in v's dtype; everything is computed in float32.

`gated_delta_rule_reference` is the recurrence above a token at a time (the torch
backend's). `gated_delta_rule` runs the one-token sequences as one batched step of it
(flash-linear-attention's fused_recurrent form) and each longer sequence in chunks of
`CHUNK` tokens (its chunk_gated_delta_rule form): within a chunk the delta rule's corrections
form a unit lower-triangular system (the UT transform), solved for all chunks at once;
only the chunk-to-chunk pass over the state is sequential.
"""

from itertools import pairwise

import torch
import torch.nn.functional as F

from pagefleet_kernels.state_batch import StateMetadata, initial_rows

__all__ = ["CHUNK", "gated_delta_rule", "gated_delta_rule_reference"]

CHUNK = 64
L2_EPS = 1e-6  # flash-linear-attention's and transformers' l2norm epsilon


def _queries_and_keys(
    q: torch.Tensor, k: torch.Tensor, heads: int, scale: float, l2norm_qk: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k in float32, normalised, q scaled, repeated to the value heads: (T, Hv, Dk)."""
    q, k = q.float(), k.float()
    if l2norm_qk:
        q = q * torch.rsqrt(q.square().sum(-1, keepdim=True) + L2_EPS)
        k = k * torch.rsqrt(k.square().sum(-1, keepdim=True) + L2_EPS)
    q = q * scale
    if heads != k.shape[1]:
        q = q.repeat_interleave(heads // k.shape[1], dim=1)
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
    return q, k


def gated_delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    meta: StateMetadata,
    scale: float,
    l2norm_qk: bool = True,
) -> torch.Tensor:
    q, k = _queries_and_keys(q, k, v.shape[1], scale, l2norm_qk)
    values, decay, beta = v.float(), g.float().exp(), beta.float()
    out = torch.empty_like(v)
    for i, (start, end) in enumerate(pairwise(meta.starts)):
        slot = int(meta.state_indices[i])
        s = state[slot].float()  # (Hv, Dk, Dv)
        if not bool(meta.has_initial_state[i]):
            s = torch.zeros_like(s)
        for t in range(start, end):
            s = s * decay[t, :, None, None]
            predicted = torch.einsum("hk,hkv->hv", k[t], s)
            delta = (values[t] - predicted) * beta[t, :, None]
            s = s + k[t, :, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hk,hkv->hv", q[t], s).to(v.dtype)
        if end > start:
            state[slot] = s.to(state.dtype)
    return out


def _step(q, k, v, decay, beta, s: torch.Tensor) -> torch.Tensor:
    """One token of S sequences at once: q, k (S, H, Dk), v (S, H, Dv), decay and beta
    (S, H), s (S, H, Dk, Dv) updated in place; returns o (S, H, Dv)."""
    s.mul_(decay[:, :, None, None])
    predicted = torch.einsum("shk,shkv->shv", k, s)
    delta = (v - predicted) * beta[:, :, None]
    s.add_(k[:, :, :, None] * delta[:, :, None, :])
    return torch.einsum("shk,shkv->shv", q, s)


def _chunked(q, k, v, g, beta, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q, k (L, H, Dk), v (L, H, Dv), g and beta (L, H) in float32, from
    state s (H, Dk, Dv); returns (o (L, H, Dv), the state after its last token).

    In a chunk from state S0, with G_t the decay from the chunk's start to t inclusive, the
    corrected values u_t = beta_t (v_t - G_t S0^T k_t - sum_{j<t} G_t/G_j (k_t.k_j) u_j)
    solve (I + A) U = diag(beta) V - diag(beta G) K S0, A strictly lower; then
    O = diag(G) Q S0 + (Q K^T o G_t/G_j, j <= t) U and the next S0 = G_C S0 + sum_j
    (G_C/G_j) k_j u_j^T. The system's inverse does not depend on S0: it is applied to V and
    to diag(beta G) K for every chunk at once."""
    length, heads = g.shape
    size = min(CHUNK, length)
    chunks = -(-length // size)
    pad = chunks * size - length

    def chunked(x: torch.Tensor) -> torch.Tensor:  # (L, H, ...) -> (H, n, C, ...)
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, 0, 0, pad))
        return x.reshape(chunks, size, heads, *x.shape[2:]).movedim(2, 0)

    q, k, v, g, beta = (chunked(x) for x in (q, k, v, g, beta))
    log_decay = g.cumsum(-1)  # (H, n, C)
    causal = torch.ones(size, size, dtype=torch.bool, device=g.device).tril()
    # G_t / G_j for j <= t (0 above the diagonal, never an overflowing exp)
    relative = (log_decay[..., :, None] - log_decay[..., None, :]).masked_fill(~causal, -torch.inf)
    relative = relative.exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * relative  # I + its strictly lower part
    decay = log_decay.exp()
    new_values, state_keys = (
        torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        for rhs in (v * beta[..., None], k_beta * decay[..., None])
    )
    scores = (q @ k.transpose(-1, -2)) * relative
    q_decayed = q * decay[..., None]
    k_to_end = k * (log_decay[..., -1:] - log_decay).exp()[..., None]
    chunk_decay = decay[..., -1, None, None]  # (H, n, 1, 1)
    out = torch.empty_like(v)
    for c in range(chunks):
        u = new_values[:, c] - state_keys[:, c] @ s
        out[:, c] = q_decayed[:, c] @ s + scores[:, c] @ u
        s = s * chunk_decay[:, c] + k_to_end[:, c].transpose(-1, -2) @ u
    out = out.reshape(heads, chunks * size, -1)[:, :length].transpose(0, 1)
    return out, s


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    meta: StateMetadata,
    scale: float,
    l2norm_qk: bool = True,
) -> torch.Tensor:
    split = meta.split()
    q, k = _queries_and_keys(q, k, v.shape[1], scale, l2norm_qk)
    out = torch.empty_like(v)
    if split.step_rows.numel():
        rows = split.step_rows
        s = initial_rows(state, split.step_slots, split.step_initial, torch.float32)
        o = _step(q[rows], k[rows], v[rows].float(), g[rows].float().exp(), beta[rows].float(), s)
        state.index_copy_(0, split.step_slots, s.to(state.dtype))
        out[rows] = o.to(v.dtype)
    for start, end, i in split.chunks:
        slot = meta.state_indices[i : i + 1]
        s = initial_rows(state, slot, meta.has_initial_state[i : i + 1], torch.float32)[0]
        o, s = _chunked(
            q[start:end],
            k[start:end],
            v[start:end].float(),
            g[start:end].float(),
            beta[start:end].float(),
            s,
        )
        state[slot] = s.to(state.dtype)[None]
        out[start:end] = o.to(v.dtype)
    return out
