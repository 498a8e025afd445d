"""The contract between the model and an attention backend.

Per forward pass the model builds one `AttentionMetadata` (the batch layout), calls the
backend's `prepare` once, then per layer `write_kv_cache` and `paged_attention`; the
norms, rotary embedding and MLP activation around them are the backend's `layer_ops` (the
functions of `pagefleet_kernels.layer_ops`, eager with the torch backend, `cpu_layer_ops`
in C++ with the CPU one, `triton_layer_ops` with the Triton one). Tensor layouts are those
of the package docstring. `torch_attention` (PyTorch, every feature, the ground truth), `cpu_attention`
(C++ decode attention and layer ops on the CPU) and `triton_attention` (CUDA) are the
backends.
"""

from dataclasses import dataclass, field
from types import ModuleType
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64
    block_tables: torch.Tensor  # (B, max_blocks) int64 (the kernels also take int32)
    seq_lens: torch.Tensor  # (B,) int64, context length including this step's tokens
    query_start_loc: torch.Tensor  # (B + 1,) int64
    query_lens: list[int]  # host copy
    # Shared by every layer's attention call of this forward pass: the backend keeps work
    # that depends on the batch layout alone here (see AttentionBackend.prepare).
    plan_cache: dict = field(default_factory=dict)
    # Host copies, when the caller has them: a backend that needs these values on the host
    # reads them here, not from the device tensors (on CUDA a synchronisation each).
    seq_lens_host: list[int] | None = None
    query_start_loc_host: list[int] | None = None


class AttentionBackend(Protocol):
    layer_ops: ModuleType  # rms_norm, add_rms_norm, rope, act_and_mul of layer_ops

    def prepare(
        self, metadata: AttentionMetadata, block_size: int, sliding_windows: set[int | None]
    ) -> None:
        """Once per forward pass, before the first layer: build whatever depends on the
        batch layout alone (for each sliding window the model's layers use; None: none)
        into `metadata.plan_cache`, so that no layer rebuilds it."""

    def write_kv_cache(
        self,
        key: torch.Tensor,  # (T, Hkv, D)
        value: torch.Tensor,  # (T, Hkv, D)
        key_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # (T,) int64
        key_scale: torch.Tensor | None = None,  # (num_blocks, block_size, Hkv) when int8/fp8
        value_scale: torch.Tensor | None = None,
    ) -> None: ...

    def paged_attention(
        self,
        query: torch.Tensor,  # (T, Hq, D)
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        scale: float,
        query_lens: list[int] | None = None,
        key_scale: torch.Tensor | None = None,
        value_scale: torch.Tensor | None = None,
        *,
        plan_cache: dict | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor: ...  # (T, Hq, D)
