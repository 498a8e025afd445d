"""The batch descriptions the model hands every kernel: `AttentionMetadata` (a forward
pass's layout over the paged KV cache) and `LoRAMapping` (which adapter slot each row
reads). They sit apart from `backend`, which imports the implementations that read them.
Tensor layouts are those of the package docstring."""

from dataclasses import dataclass, field

import torch

from pagefleet_kernels.state_batch import StateMetadata


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
    # A hybrid model's step: each sequence's row of its recurrent layers' state (None where
    # the model has no recurrent layer).
    state: StateMetadata | None = None
    # Rows whose queries see keys past their own position (a bidirectional span: Gemma 3's
    # image tokens see their whole image), with their own layout: each such row a
    # one-token query whose context ends where its span does. None: every row is causal.
    bidirectional: "BidirectionalRows | None" = None


@dataclass
class BidirectionalRows:
    rows: torch.Tensor  # (R,) int64: the rows of the step's batch
    attn: AttentionMetadata  # R one-token queries, their contexts to their spans' ends


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
