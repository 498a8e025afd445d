"""The batch descriptions the model hands every kernel: `AttentionMetadata` (a forward
pass's layout over the paged KV cache) and `LoRAMapping` (which adapter slot each row
reads). They sit apart from `backend`, which imports the implementations that read them.
Tensor layouts are those of the package docstring."""

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64
    block_tables: torch.Tensor  # (B, max_blocks) int64 (the kernels also take int32)
    seq_lens: torch.Tensor  # (B,) int64, context length including this step's tokens
    query_start_loc: torch.Tensor  # (B + 1,) int64
    query_lens: list[int]  # host copy
    # Shared by every layer's attention call of this forward pass: the backend keeps work
    # that depends on the batch layout alone here (see KernelBackend.prepare).
    plan_cache: dict = field(default_factory=dict)
    # Host copies, when the caller has them: a backend that needs these values on the host
    # reads them here, not from the device tensors (on CUDA a synchronisation each).
    seq_lens_host: list[int] | None = None
    query_start_loc_host: list[int] | None = None


@dataclass
class LoRAMapping:
    """Which LoRA adapter slot each row of a step reads (see `KernelBackend.add_lora`)."""

    token_slots: torch.Tensor  # (T,) int64: each row's slot, -1 for no adapter
    # Each slot the step reads (host) with its rows, (n,) int64 on the device, in order.
    slot_rows: list[tuple[int, torch.Tensor]]
    # Optional (None: not built; the operators that read them then take `slot_rows`): the
    # rows of `slot_rows` end to end (n,); the same as one (slots read, most rows of one)
    # table padded with row 0 (what a padding place computes is never read), flattened;
    # where in it each row lies.
    rows: torch.Tensor | None = None
    padded_rows: torch.Tensor | None = None
    padded_positions: torch.Tensor | None = None
