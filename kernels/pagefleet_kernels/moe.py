"""The mixture-of-experts operator in PyTorch: the router's choice (`route`), the readable
ground truth (`fused_moe`: a loop over the experts, gathering each one's tokens and
scattering its output back) and the CPU path (`grouped_fused_moe`: the (token, expert)
pairs sorted by expert once, each expert's two matmuls on its own rows only, in one pass
over the experts that were chosen).

Every implementation (these, and `triton_moe`'s grouped GEMM) takes the same arguments:

- x: (T, H) the normed hidden states
- gate_up: (E, 2I, H) each expert's [gate | up] projection, as `F.linear` takes it
- down: (E, H, I) each expert's down projection
- topk_weights: (T, k) each token's routing weights, in x's dtype
- topk_ids: (T, k) int64 the experts they weight, in [0, E)
- gelu: GeGLU instead of SwiGLU

and, keyword-only, gpt-oss's variant (None: absent):

- gate_up_bias: (E, 2I) and down_bias: (E, H), each expert's biases, added after its
  matmuls (before the routing weight)
- activation: a `ClampedSwiGLU` in place of SwiGLU / GeGLU

and returns (T, H): sum over j of topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]), the
contributions of one token added in ascending expert order (transformers' order).

A tensor-parallel rank holding a slice of the experts can run the same operator on its
slice with the ids of other ranks' experts mapped out of it (the loops only visit experts
they hold rows for); that split is not made yet.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagefleet_kernels import layer_ops

__all__ = ["ClampedSwiGLU", "expert_load", "fused_moe", "grouped_fused_moe", "route"]

# softmax / sigmoid: the scores of every expert, then the k best; top_k_softmax (gpt-oss):
# the k largest logits, then a softmax over just those.
ROUTER_SCORINGS = ("softmax", "sigmoid", "top_k_softmax")


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation of [gate | up]: gate clamped above at `limit`, up to
    [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float
    limit: float

    def __post_init__(self) -> None:
        if not self.limit > 0:
            raise ValueError(f"ClampedSwiGLU limit must be > 0, got {self.limit}")

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


# Up to this many rows an expert's matmul goes to the backend's few-row `linear` (the C++
# one reads the weight as it lies; MKL's GEMM is faster from about a dozen rows: see
# pagefleet_serve.model.linear.FEW_ROWS_NATIVE, the dense layers' same bound).
FEW_ROWS = 8


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax"
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits (T, E) -> (weights (T, k) float32, ids (T, k) int64): the scores in
    float32 (softmax over the experts, or each one's sigmoid), the k best, renormalized to
    sum to one when the architecture says so (Mixtral always, Qwen and OLMoE by
    `norm_topk_prob`)."""
    logits = router_logits.float()
    if scoring == "top_k_softmax":
        top, ids = torch.topk(logits, top_k, dim=-1)
        return top.softmax(dim=-1), ids
    scores = logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def expert_load(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E,) int64: how many of this step's tokens chose each expert."""
    return torch.bincount(topk_ids.flatten(), minlength=num_experts)


def _activate(gate_up: torch.Tensor, gelu: bool, activation, act_and_mul) -> torch.Tensor:
    """(rows, 2I) -> (rows, I): the variant's activation, else the backend's SwiGLU/GeGLU."""
    return act_and_mul(gate_up, gelu) if activation is None else activation(gate_up)


def _add_bias(y: torch.Tensor, bias: torch.Tensor | None, expert: int) -> torch.Tensor:
    """An expert's bias added after its matmul (not fused into it: transformers' order)."""
    return y if bias is None else y + bias[expert]


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
    activation: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """The ground truth: for each expert, the tokens that chose it (gathered), its MLP, the
    output weighted and added back into those tokens' rows."""
    out = torch.zeros_like(x)
    for expert in range(gate_up.shape[0]):
        tokens, slot = torch.where(topk_ids == expert)
        if tokens.numel() == 0:
            continue
        h = _add_bias(F.linear(x[tokens], gate_up[expert]), gate_up_bias, expert)
        h = _activate(h, gelu, activation, layer_ops.act_and_mul)
        y = _add_bias(F.linear(h, down[expert]), down_bias, expert)
        out.index_add_(0, tokens, y * topk_weights[tokens, slot, None])
    return out


def grouped_fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor | Sequence[torch.Tensor],
    down: torch.Tensor | Sequence[torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gelu: bool = False,
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: ClampedSwiGLU | None = None,
    linear=None,
    act_and_mul=layer_ops.act_and_mul,
    few_rows: int | None = FEW_ROWS,
) -> torch.Tensor:
    """The pairs sorted by expert (stable: a token's rows stay in order), their rows
    gathered once, each chosen expert's MLP on its contiguous run of rows, the weighted
    outputs scattered back in one `index_add_` (in the sorted order: each token's
    contributions in ascending expert order, as `fused_moe` adds them).

    `linear(rows, weight)`: the backend's matmul of up to `few_rows` rows (None: any
    number) by one expert's weight (the C++ CPU one, of a weight as it lies), returning None
    where it takes no such rows; `act_and_mul` the backend's. The experts' weights may also
    be sequences of per-expert matrices in the layout `linear` reads (oneDNN's prepacked
    ones, see `pagefleet_serve.model.llama.MoEExperts.prepack`)."""
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.flatten()
    order = torch.argsort(flat_ids, stable=True)  # (T * k,) pair indices by expert
    tokens = order // top_k
    rows = x[tokens]  # (T * k, H)
    out = torch.empty_like(rows)
    counts = torch.bincount(flat_ids, minlength=len(gate_up)).tolist()

    def matmul(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        takes = linear is not None and (few_rows is None or a.shape[0] <= few_rows)
        y = linear(a, weight) if takes else None
        if y is not None:
            return y
        if a.shape[0] == 1 and a.dtype != torch.float32 and a.is_cpu:
            # One 16-bit row goes to a matrix-vector routine several times slower than a
            # two-row product (as `pagefleet_serve.model.linear.Linear` finds).
            return F.linear(a.expand(2, -1), weight)[:1]
        return F.linear(a, weight)

    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        hidden = _add_bias(matmul(rows[start:end], gate_up[expert]), gate_up_bias, expert)
        hidden = _activate(hidden, gelu, activation, act_and_mul)
        out[start:end] = _add_bias(matmul(hidden, down[expert]), down_bias, expert)
        start = end
    out.mul_(topk_weights.flatten()[order, None])
    return torch.zeros_like(x).index_add_(0, tokens, out)
