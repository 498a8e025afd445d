"""The gated RMSNorm at the output of the recurrent layers: an RMSNorm and a SiLU gate z, in
the order the family defines (mamba_ssm's `norm_before_gate`):

- norm, then gate (Gated DeltaNet of Qwen3-Next and Qwen3.5): weight * norm(x) * silu(z),
  each value head normed on its own (`size` = the head dim);
- gate, then norm (Mamba2, Nemotron-H, Granite 4.0-H): weight * norm(x * silu(z)), each of
  the mixer's groups of `group_size` channels normed on its own.

Both in float32, cast back to x's dtype before the weight as transformers does."""

import torch
import torch.nn.functional as F
from torch import nn

from pagefleet_serve.model.context import current_context
from pagefleet_serve.model.layers.linear import default_weight_loader, parameter


class GatedRMSNorm(nn.Module):
    def __init__(
        self, size: int, eps: float, norm_before_gate: bool, group_size: int | None = None
    ) -> None:
        super().__init__()
        self.weight = parameter((size,), default_weight_loader, current_context().dtype)
        self.eps, self.norm_before_gate = eps, norm_before_gate
        self.group_size = size if group_size is None else group_size

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """x, z (rows, size) -> (rows, size)."""
        dtype = x.dtype
        h = x.float()
        gate = F.silu(z.float())
        if self.norm_before_gate:
            return ((self.weight * self._norm(h).to(dtype)) * gate).to(dtype)
        return self.weight * self._norm(h * gate).to(dtype)

    def _norm(self, h: torch.Tensor) -> torch.Tensor:
        grouped = h.view(*h.shape[:-1], -1, self.group_size)
        normed = grouped * torch.rsqrt(grouped.square().mean(-1, keepdim=True) + self.eps)
        return normed.view(h.shape)
