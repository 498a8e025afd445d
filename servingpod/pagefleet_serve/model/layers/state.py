"""The per-sequence state of a hybrid model's recurrent layers, and how a layer declares it.

A recurrent layer (Gated DeltaNet, a Mamba2 mixer, LFM2's short convolution) keeps for each
sequence a few tensors of fixed size where attention keeps a KV cache that grows with the
context. The contract between such a layer and the engine's state cache:

- `layer.state_specs()`: the layer's named per-sequence tensors (`StateSpec`: name, shape,
  dtype), e.g. Gated DeltaNet's "conv" (conv_dim, kernel - 1) in the model's dtype and
  "recurrent" (value heads, key dim, value dim) in float32.
- The cache holds, per layer and spec, one tensor (num_slots, *shape) of that dtype
  (`allocate`) and gives each running sequence a slot: the same row index in every
  recurrent layer's tensors.
- `layer(x, state, meta)`: x (T, hidden) the forward pass's flattened tokens, `state` the
  layer's tensors by name, `meta` a `pagefleet_kernels.state_batch.StateMetadata` (the
  sequences' query_start_loc and lengths, each one's slot, and whether it continues from
  its slot's state or starts from zeros); returns (T, hidden) and leaves in each
  sequence's rows its state after its last token. A prompt split into chunks over several
  steps, then its decode steps, gives the outputs of the whole sequence in one pass.

Copying a slot's rows into another (a fork for `n > 1`, a prefix checkpoint) copies the
sequence's whole state, since the state after a token depends on nothing else.
"""

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from pagefleet_kernels.state_batch import StateMetadata
from torch import nn

from pagefleet_serve.model.context import current_context

# A layer's state tensors by spec name, each (num_slots, *spec.shape).
LayerState = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class StateSpec:
    """One per-sequence tensor of a recurrent layer."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """The bytes of one sequence's tensor."""
        return math.prod(self.shape) * self.dtype.itemsize


class StatefulLayer(Protocol):
    def state_specs(self) -> tuple[StateSpec, ...]: ...

    def __call__(self, x: torch.Tensor, state: LayerState, meta: StateMetadata) -> torch.Tensor: ...


class RecurrentDecoderLayer(nn.Module):
    """A decoder layer whose mixer is a recurrent layer (a subclass declares its
    `state_specs()`): `forward(x, cos, sin, state, attn)` takes its state tensors where an
    attention layer takes its K/V, and `attn.state` for the step's slots. No fused kernel computes it, and nothing is
    compiled around it: its mixer reads the step's state metadata."""

    fusable = False
    compiled = False
    fused = None
    keeps_kv = False  # its state slots instead (see `CausalLM.kv_layers`)

    def compile_around_attention(self) -> None:
        """Nothing to compile (see the class)."""


def allocate(
    specs: Iterable[StateSpec], num_slots: int, device: torch.device | str
) -> dict[str, torch.Tensor]:
    """A layer's state tensors for `num_slots` sequences (zeros; a sequence that starts
    from zeros never reads its row, so a reused slot needs no clearing)."""
    return {s.name: torch.zeros((num_slots, *s.shape), dtype=s.dtype, device=device) for s in specs}


def bytes_per_sequence(specs: Iterable[StateSpec]) -> int:
    return sum(s.nbytes for s in specs)


def require_one_rank(layer: str) -> None:
    """ValueError when the model is being built over several tensor-parallel ranks: the
    recurrent layers are not split over ranks yet."""
    parallel = current_context().parallel
    if parallel.parallel:
        raise ValueError(
            f"tensor_parallel_size {parallel.size}: the {layer} layers of this model run on "
            f"one rank only; serve it with tensor_parallel_size 1"
        )
