"""LFM2's gated short convolution: B, C and x from one projection, then
out_proj(C * conv(B * x)) with a causal depthwise convolution of `kernel_size` tokens
(config.json's conv_L_cache) and no activation. Per sequence it keeps "conv" (hidden size,
kernel - 1): the last inputs B * x of its window."""

import torch
from pagefleet_kernels.state_batch import StateMetadata
from torch import nn

from pagefleet_serve.model.layers.conv import CausalConv1d
from pagefleet_serve.model.layers.linear import ReplicatedLinear
from pagefleet_serve.model.layers.state import LayerState, StateSpec, require_one_rank


class ShortConv(nn.Module):
    def __init__(self, hidden_size: int, kernel_size: int, bias: bool = False) -> None:
        super().__init__()
        require_one_rank("short convolution")
        self.in_proj = ReplicatedLinear(hidden_size, 3 * hidden_size, bias)
        self.conv = CausalConv1d(hidden_size, kernel_size, bias, silu=False)
        self.out_proj = ReplicatedLinear(hidden_size, hidden_size, bias)

    def state_specs(self) -> tuple[StateSpec, ...]:
        return (self.conv.state_spec("conv"),)

    def forward(self, x: torch.Tensor, state: LayerState, meta: StateMetadata) -> torch.Tensor:
        b, c, inputs = self.in_proj(x).chunk(3, dim=-1)
        return self.out_proj(c * self.conv(b * inputs, state["conv"], meta))
