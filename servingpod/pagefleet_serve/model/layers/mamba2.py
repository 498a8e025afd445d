"""The Mamba2 mixer (Dao and Gu, "Transformers are SSMs"), as Mamba2, Nemotron-H, Granite
4.0-H and Falcon-H1 use it: in_proj gives a gate z, the SSM's inputs x, B, C and dt per
head; x, B and C go through a causal convolution and SiLU; the selective state space model
(`pagefleet_kernels.ssd`: A = -exp(A_log), dt through dt_bias, softplus and the
`time_step_limit`, the D skip); a gated RMSNorm, gate then norm, over each of the n_groups
groups of channels; the output projection.

Per sequence it keeps "conv" (intermediate + 2 n_groups state_size channels, kernel - 1)
and "ssm" (heads, head dim, state size)."""

from dataclasses import dataclass

import torch
from pagefleet_kernels.state_batch import StateMetadata
from torch import nn

from pagefleet_serve.model.context import current_context
from pagefleet_serve.model.layers.conv import CausalConv1d
from pagefleet_serve.model.layers.gated_norm import GatedRMSNorm
from pagefleet_serve.model.layers.linear import ReplicatedLinear, default_weight_loader, parameter
from pagefleet_serve.model.layers.state import LayerState, StateSpec, require_one_rank


@dataclass(frozen=True)
class MixerShape:
    """A hybrid family's Mamba2 mixers, as its configuration names them (see `Mamba2Mixer`)."""

    heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    chunk_size: int
    use_bias: bool
    use_conv_bias: bool
    time_step_limit: tuple[float, float]

    def mixer(self, hidden_size: int, eps: float) -> "Mamba2Mixer":
        return Mamba2Mixer(
            hidden_size,
            self.heads,
            self.head_dim,
            self.n_groups,
            self.state_size,
            self.conv_kernel,
            self.chunk_size,
            eps,
            self.use_bias,
            self.use_conv_bias,
            self.time_step_limit,
        )


class Mamba2Mixer(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        n_groups: int,
        state_size: int,
        conv_kernel_size: int,
        chunk_size: int,
        eps: float,
        use_bias: bool = False,
        use_conv_bias: bool = True,
        time_step_limit: tuple[float, float] = (0.0, float("inf")),
        state_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        require_one_rank("Mamba2")
        if num_heads % n_groups:
            raise ValueError(f"n_groups ({n_groups}) must divide the heads ({num_heads})")
        context = current_context()
        self.recurrent = context.backend.recurrent
        self.num_heads, self.head_dim = num_heads, head_dim
        self.n_groups, self.state_size = n_groups, state_size
        self.chunk_size, self.time_step_limit = chunk_size, tuple(time_step_limit)
        self.state_dtype = state_dtype
        self.intermediate = num_heads * head_dim
        conv_dim = self.intermediate + 2 * n_groups * state_size
        self.in_proj = ReplicatedLinear(
            hidden_size, self.intermediate + conv_dim + num_heads, use_bias
        )
        self.conv1d = CausalConv1d(conv_dim, conv_kernel_size, use_conv_bias, silu=True)
        self.dt_bias = parameter((num_heads,), default_weight_loader, context.dtype)
        self.A_log = parameter((num_heads,), default_weight_loader, context.dtype)
        self.D = parameter((num_heads,), default_weight_loader, context.dtype)
        self.norm = GatedRMSNorm(
            self.intermediate, eps, norm_before_gate=False, group_size=self.intermediate // n_groups
        )
        self.out_proj = ReplicatedLinear(self.intermediate, hidden_size, use_bias)

    def state_specs(self) -> tuple[StateSpec, ...]:
        ssm = (self.num_heads, self.head_dim, self.state_size)
        return self.conv1d.state_spec("conv"), StateSpec("ssm", ssm, self.state_dtype)

    def forward(self, x: torch.Tensor, state: LayerState, meta: StateMetadata) -> torch.Tensor:
        tokens, conv_dim = x.shape[0], self.conv1d.channels
        gate, xbc, dt = self.in_proj(x).split([self.intermediate, conv_dim, self.num_heads], -1)
        xbc = self.conv1d(xbc, state["conv"], meta)
        bc = self.n_groups * self.state_size
        inputs, B, C = xbc.split([self.intermediate, bc, bc], dim=-1)
        y = self.recurrent.ssd(
            inputs.reshape(tokens, self.num_heads, self.head_dim),
            dt,
            -self.A_log.float().exp(),
            B.reshape(tokens, self.n_groups, self.state_size),
            C.reshape(tokens, self.n_groups, self.state_size),
            self.D,
            self.dt_bias,
            state["ssm"],
            meta,
            self.time_step_limit,
            self.chunk_size,
        )
        return self.out_proj(self.norm(y.reshape(tokens, self.intermediate), gate))
