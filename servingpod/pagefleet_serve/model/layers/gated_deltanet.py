"""Gated DeltaNet, the linear attention of Qwen3-Next and Qwen3.5 (Yang et al., "Gated Delta
Networks"): per token, q, k and v from a causal convolution over their projections, a decay
g = -exp(A_log) softplus(a + dt_bias) and a write strength beta = sigmoid(b) per value
head; the gated delta rule over a (key dim, value dim) state per value head
(`pagefleet_kernels.gated_delta_rule`, q and k L2-normed, q scaled by key dim^-1/2); a
gated RMSNorm per value head, norm then gate z; the output projection.

Per sequence it keeps "conv" (2 key dims + value dim channels, kernel - 1), the
convolution's window, and "recurrent" (value heads, key dim, value dim).

`GatedDeltaNet` projects as Qwen3.5 does (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a);
`InterleavedGatedDeltaNet` as Qwen3-Next does (in_proj_qkvz and in_proj_ba, each key head's
q, k, its value heads' v and z, then their b and a, side by side)."""

import torch
import torch.nn.functional as F
from pagefleet_kernels.state_batch import StateMetadata
from torch import nn

from pagefleet_serve.model.context import current_context
from pagefleet_serve.model.layers.conv import CausalConv1d
from pagefleet_serve.model.layers.gated_norm import GatedRMSNorm
from pagefleet_serve.model.layers.linear import ReplicatedLinear, default_weight_loader, parameter
from pagefleet_serve.model.layers.state import LayerState, StateSpec, require_one_rank


class GatedDeltaNet(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel_size: int,
        eps: float,
        state_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        require_one_rank("Gated DeltaNet")
        if num_v_heads % num_k_heads:
            raise ValueError(
                f"linear_num_value_heads ({num_v_heads}) must be a multiple of "
                f"linear_num_key_heads ({num_k_heads})"
            )
        context = current_context()
        self.recurrent = context.backend.recurrent
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.state_dtype = state_dtype
        self.make_projections(hidden_size)
        self.conv1d = CausalConv1d(2 * self.key_dim + self.value_dim, conv_kernel_size, False, True)
        self.dt_bias = parameter((num_v_heads,), default_weight_loader, context.dtype)
        self.A_log = parameter((num_v_heads,), default_weight_loader, context.dtype)
        self.norm = GatedRMSNorm(head_v_dim, eps, norm_before_gate=True)
        self.out_proj = ReplicatedLinear(self.value_dim, hidden_size)

    def make_projections(self, hidden_size: int) -> None:
        self.in_proj_qkv = ReplicatedLinear(hidden_size, 2 * self.key_dim + self.value_dim)
        self.in_proj_z = ReplicatedLinear(hidden_size, self.value_dim)
        self.in_proj_b = ReplicatedLinear(hidden_size, self.num_v_heads)
        self.in_proj_a = ReplicatedLinear(hidden_size, self.num_v_heads)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x (T, hidden) -> q|k|v (T, conv channels), z (T, value dim), b and a (T, Hv)."""
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    def state_specs(self) -> tuple[StateSpec, ...]:
        recurrent = (self.num_v_heads, self.head_k_dim, self.head_v_dim)
        return self.conv1d.state_spec("conv"), StateSpec("recurrent", recurrent, self.state_dtype)

    def forward(self, x: torch.Tensor, state: LayerState, meta: StateMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        qkv, z, b, a = self.project(x)
        qkv = self.conv1d(qkv, state["conv"], meta)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = self.recurrent.gated_delta_rule(
            q.reshape(tokens, self.num_k_heads, self.head_k_dim),
            k.reshape(tokens, self.num_k_heads, self.head_k_dim),
            v.reshape(tokens, self.num_v_heads, self.head_v_dim),
            g,
            b.sigmoid(),
            state["recurrent"],
            meta,
            self.head_k_dim**-0.5,
        )
        out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(out.reshape(tokens, self.value_dim))


class InterleavedGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's projections: per key head, [q, k, v of its value heads, z of them] in
    in_proj_qkvz and [b of its value heads, a of them] in in_proj_ba."""

    def make_projections(self, hidden_size: int) -> None:
        self.in_proj_qkvz = ReplicatedLinear(hidden_size, 2 * self.key_dim + 2 * self.value_dim)
        self.in_proj_ba = ReplicatedLinear(hidden_size, 2 * self.num_v_heads)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        tokens, per_key = x.shape[0], self.num_v_heads // self.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(tokens, self.num_k_heads, -1)
        values = per_key * self.head_v_dim
        q, k, v, z = qkvz.split([self.head_k_dim, self.head_k_dim, values, values], dim=-1)
        b, a = self.in_proj_ba(x).view(tokens, self.num_k_heads, 2 * per_key).chunk(2, dim=-1)
        qkv = torch.cat([t.reshape(tokens, -1) for t in (q, k, v)], dim=-1)
        return qkv, z.reshape(tokens, -1), b.reshape(tokens, -1), a.reshape(tokens, -1)
