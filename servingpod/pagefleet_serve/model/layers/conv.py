"""The causal depthwise convolution of the recurrent layers (Mamba2's and Gated DeltaNet's
over their projected inputs, LFM2's short convolution), with its rolling state: a
sequence's last kernel_size - 1 inputs (see `pagefleet_kernels.causal_conv1d`)."""

import torch
from pagefleet_kernels.state_batch import StateMetadata
from torch import nn

from pagefleet_serve.model.context import current_context
from pagefleet_serve.model.layers.linear import default_weight_loader, parameter
from pagefleet_serve.model.layers.state import StateSpec


class CausalConv1d(nn.Module):
    """`channels` convolved each on its own over `kernel_size` tokens, then SiLU where
    `silu`. The weight is (channels, 1, kernel_size), as checkpoints store nn.Conv1d's."""

    def __init__(self, channels: int, kernel_size: int, bias: bool, silu: bool) -> None:
        super().__init__()
        context = current_context()
        self.recurrent = context.backend.recurrent
        self.channels, self.kernel_size, self.silu = channels, kernel_size, silu
        self.weight = parameter((channels, 1, kernel_size), default_weight_loader, context.dtype)
        self.bias = parameter((channels,), default_weight_loader, context.dtype) if bias else None

    def state_spec(self, name: str = "conv") -> StateSpec:
        """The rolling window of one sequence: its last kernel_size - 1 inputs."""
        return StateSpec(name, (self.channels, self.kernel_size - 1), self.weight.dtype)

    def forward(
        self, x: torch.Tensor, conv_state: torch.Tensor, meta: StateMetadata
    ) -> torch.Tensor:
        """x (T, channels) -> (T, channels); conv_state (num_slots, channels, kernel - 1)."""
        return self.recurrent.causal_conv1d(
            x, self.weight[:, 0], self.bias, conv_state, meta, self.silu
        )
