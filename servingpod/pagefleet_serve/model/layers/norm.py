"""RMSNorm through the kernel backend, normalized in float32 and cast back before the
weight, as Hugging Face does; Gemma's (1 + weight) is applied in float32 (`unit_offset`)."""

import torch
from torch import nn

from pagefleet_serve.model.context import current_context
from pagefleet_serve.model.layers.linear import parameter
from pagefleet_serve.model.weights import Weight, cut, load_into


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        context = current_context()
        self.weight = parameter((size,), self.weight_loader, context.dtype)
        self.eps = eps
        self.unit_offset = unit_offset
        self.backend = context.backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.rms_norm(x, self.weight, self.eps, self.unit_offset)

    def add(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + h, the norm of x + h): a residual add and the norm after it, in one op."""
        return self.backend.add_rms_norm(x, h, self.weight, self.eps, self.unit_offset)

    def weight_loader(self, param: nn.Parameter, weight: Weight, shard_id=None) -> None:
        load_into(weight, param.data)


class ShardedRMSNorm(RMSNorm):
    """An RMSNorm over a whole projection whose columns are split over the tensor-parallel
    ranks (OLMoE's q and k norms): a rank holds the weights of its columns `rows`, and the
    mean square sums over the ranks, in float32."""

    def __init__(self, size: int, eps: float, rows: tuple[int, int]) -> None:
        super().__init__(rows[1] - rows[0], eps)
        self.size, self.rows = size, rows
        self.parallel = current_context().parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.parallel.parallel:
            return super().forward(x)
        square = self.parallel.all_reduce(x.float().square().sum(-1, keepdim=True))
        normed = x.float() * torch.rsqrt(square / self.size + self.eps)
        return self.weight * normed.to(x.dtype)

    def weight_loader(self, param: nn.Parameter, weight: Weight, shard_id=None) -> None:
        load_into(cut(weight, 0, [self.rows]) if self.parallel.parallel else weight, param.data)
