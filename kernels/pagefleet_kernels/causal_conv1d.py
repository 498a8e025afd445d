"""The causal depthwise convolution of Mamba2, Gated DeltaNet (over q, k and v) and LFM2's
short convolution, with its rolling state: channel c of token t is
sum_j weight[c, j] * x[t - K + 1 + j, c] (+ bias[c], then SiLU where asked), the inputs
before a sequence's first token of this pass read from its conv state.

- x: (T, C) the flattened batch (see `state_batch`)
- weight: (C, K), bias: (C,) or None
- conv_state: (num_slots, C, K - 1): a sequence's last K - 1 inputs, oldest first (the
  layout of causal-conv1d and Mamba's caches), updated in place
- meta: `state_batch.StateMetadata`; silu: apply SiLU to the output

returns (T, C) in x's dtype, computed in float32. `causal_conv1d_reference` is the
definition, a token at a time through the window (the torch backend's); `causal_conv1d`
the vectorised path: the one-token sequences' windows as one (S, C, K) product, each
longer sequence's K shifted slices of its inputs with the state in front.
"""

from itertools import pairwise

import torch
import torch.nn.functional as F

from pagefleet_kernels.state_batch import StateMetadata, initial_rows

__all__ = ["causal_conv1d", "causal_conv1d_reference"]


def _finish(y: torch.Tensor, bias: torch.Tensor | None, silu: bool) -> torch.Tensor:
    if bias is not None:
        y = y + bias.float()
    return F.silu(y) if silu else y


def causal_conv1d_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    meta: StateMetadata,
    silu: bool,
) -> torch.Tensor:
    out = torch.empty_like(x)
    w = weight.float()
    for i, (start, end) in enumerate(pairwise(meta.starts)):
        slot = int(meta.state_indices[i])
        window = conv_state[slot].float()  # (C, K - 1), oldest first
        if not bool(meta.has_initial_state[i]):
            window = torch.zeros_like(window)
        for t in range(start, end):
            window = torch.cat([window, x[t].float()[:, None]], dim=1)  # (C, K)
            out[t] = _finish((window * w).sum(1), bias, silu).to(x.dtype)
            window = window[:, 1:]
        if end > start:
            conv_state[slot] = window.to(conv_state.dtype)
    return out


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    meta: StateMetadata,
    silu: bool,
) -> torch.Tensor:
    split = meta.split()
    out = torch.empty_like(x)
    w = weight.float()
    width = w.shape[1]
    if split.step_rows.numel():
        previous = initial_rows(conv_state, split.step_slots, split.step_initial, torch.float32)
        window = torch.cat([previous, x[split.step_rows].float()[:, :, None]], dim=2)
        y = torch.einsum("sck,ck->sc", window, w)
        conv_state.index_copy_(0, split.step_slots, window[:, :, 1:].to(conv_state.dtype))
        out[split.step_rows] = _finish(y, bias, silu).to(x.dtype)
    for start, end, i in split.chunks:
        slot = meta.state_indices[i : i + 1]
        previous = initial_rows(conv_state, slot, meta.has_initial_state[i : i + 1], torch.float32)
        inputs = torch.cat([previous[0].T, x[start:end].float()])  # (K - 1 + L, C)
        length = end - start
        y = inputs[:length] * w[:, 0]
        for j in range(1, width):
            y.addcmul_(inputs[j : j + length], w[:, j])
        conv_state[slot] = inputs[length:].T.to(conv_state.dtype)[None]
        out[start:end] = _finish(y, bias, silu).to(x.dtype)
    return out
