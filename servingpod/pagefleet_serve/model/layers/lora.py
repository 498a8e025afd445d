"""LoRA adapters on the linear layers: the one place a model meets them.

`add_adapters` wraps each adaptable linear of every decoder layer (q/k/v, o, and a dense
MLP's gate/up and down: `ADAPTED`) in a `LoRALinear`, which adds each row's adapter delta
to the base layer's output through the backend's LoRA operator. Which rows read which
adapter slot is the step's (`StepAdapters.batch`, set by the model runner before each
forward pass; None: no row reads one, and the wrappers add nothing). The base layers and
the model files know nothing of adapters.

The device slots (`LoRAWeights`) follow the fused matmuls: a fused module's slot holds its
parts' A stacked (parts * R, in) and their B block-diagonal (out, parts * R), so that one
shrink and one expand serve the fused matmul. Everything off the blocks, past an adapter's
own rank and in the parts it does not adapt is exactly zero and adds nothing. The
adapter's scale is folded into B once, at load (see `model.lora`).
"""

from dataclasses import dataclass

import torch
from pagefleet_kernels.backend import AddLoRAOp
from pagefleet_kernels.metadata import LoRAMapping
from torch import nn

from pagefleet_serve.model.config import ModelConfig
from pagefleet_serve.model.lora import LoRAAdapter, fused_layout

# The linears adapters reach, by the module that holds them in a decoder layer (a sparse
# layer's MLP has none: its experts are not adapted, see model.lora).
ADAPTED = {
    "qkv_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_up_proj": "mlp",
    "down_proj": "mlp",
}


class LoRAWeights:
    """The adapters resident on the device: per layer and adaptable linear, A (slots,
    parts * R, in) and B (slots, out, parts * R), R = max_rank (see the module docstring)."""

    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.layout = fused_layout(config)
        self.max_rank = max_rank

        def slot_pair(fan_in: int, outs: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
            ranks = len(outs) * max_rank
            return (
                torch.zeros(num_slots, ranks, fan_in, device=device, dtype=dtype),
                torch.zeros(num_slots, sum(outs), ranks, device=device, dtype=dtype),
            )

        self.layers = [
            {module: slot_pair(*shape) for module, shape in self.layout.items()}
            for _ in range(config.num_layers)
        ]
        # The fused modules that a slot's adapter adapts whole (a dense B), per slot; and
        # each module's parts over which every slot's B is block-diagonal (() where one is
        # dense): what the operator may skip (`AddLoRAOp`'s `parts`).
        self._whole: list[set[str]] = [set() for _ in range(num_slots)]
        self.blocks = self._blocks()

    def _blocks(self) -> dict[str, tuple[int, ...]]:
        return {
            module: () if any(module in whole for whole in self._whole) else outs
            for module, (_, outs) in self.layout.items()
        }

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for layer in self.layers for pair in layer.values() for t in pair)

    @torch.inference_mode()
    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Write `adapter` into `slot`, replacing whatever it held."""
        for layer in self.layers:
            for a, b in layer.values():
                a[slot].zero_()
                b[slot].zero_()
        for (index, module, part), (a, b) in adapter.weights.items():
            outs = self.layout[module][1]
            first = 0 if part is None else sum(outs[:part])
            rows = slice(first, first + (sum(outs) if part is None else outs[part]))
            ranks = slice(0 if part is None else part * self.max_rank, None)
            stacked_a, stacked_b = self.layers[index][module]
            stacked_a[slot, ranks][: a.shape[0]] = a
            stacked_b[slot, rows, ranks][:, : b.shape[1]] = b
        self._whole[slot] = {
            module
            for _, module, part in adapter.weights
            if part is None and len(self.layout[module][1]) > 1
        }
        self.blocks = self._blocks()


@dataclass(frozen=True)
class LoRABatch:
    """One forward pass's adapters: the slots' weights and which rows read which slot."""

    weights: LoRAWeights
    mapping: LoRAMapping
    add_lora: AddLoRAOp


class StepAdapters:
    """The adapters of the forward pass about to run, shared by a model's wrappers."""

    batch: LoRABatch | None = None


class LoRALinear(nn.Module):
    """A linear layer plus each row's adapter delta on its output: y + scale * B A x."""

    def __init__(self, base: nn.Module, adapters: StepAdapters, layer: int, module: str) -> None:
        super().__init__()
        self.base_layer = base
        self.adapters = adapters
        self.layer, self.module = layer, module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        batch = self.adapters.batch
        if batch is None:
            return y
        a, b = batch.weights.layers[self.layer][self.module]
        batch.add_lora(y, x, a, b, batch.mapping, batch.weights.blocks[self.module])
        return y


def add_adapters(layers: nn.ModuleList) -> StepAdapters:
    """Wrap the adaptable linears of every decoder layer (`ADAPTED`); the wrappers read
    the returned StepAdapters."""
    adapters = StepAdapters()
    for index, layer in enumerate(layers):
        for name, holder in ADAPTED.items():
            parent = layer.get_submodule(holder)
            base = getattr(parent, name, None)
            if base is not None:
                parent.register_module(name, LoRALinear(base, adapters, index, name))
    return adapters


def base_layer(module: nn.Module) -> nn.Module:
    """The linear layer itself, with or without an adapter wrapper."""
    return module.base_layer if isinstance(module, LoRALinear) else module


def step_adapters(modules) -> StepAdapters | None:
    """The StepAdapters the wrappers among `modules` read, None when none is wrapped."""
    return next((m.adapters for m in modules if isinstance(m, LoRALinear)), None)
