"""The batch layout of the recurrent kernels (`causal_conv1d`, `gated_delta_rule`, `ssd`):
the same flattened batch attention takes, and per sequence a row of each layer's state.

A forward pass runs T tokens of B sequences end to end: sequence i's tokens are rows
[query_start_loc[i], query_start_loc[i + 1]) of every (T, ...) input, a decode step's
one token or a chunk of a prompt. A layer's per-sequence state lives in tensors of
(num_slots, ...): sequence i reads row `state_indices[i]` (unless `has_initial_state[i]`
is False: a new prompt, or one recomputed after preemption, starts from zeros and never
reads the row's stale contents) and leaves there its state after its last token, so that
its next chunk or decode step continues from it. Two sequences of one batch never share a
row.
"""

from dataclasses import dataclass, field
from itertools import accumulate

import torch


@dataclass
class StateMetadata:
    query_start_loc: torch.Tensor  # (B + 1,) int64
    query_lens: list[int]  # host copy of the B lengths
    state_indices: torch.Tensor  # (B,) int64: each sequence's row in the state tensors
    has_initial_state: torch.Tensor  # (B,) bool: False: start from zeros
    # Shared by every layer of one forward pass (see `split`).
    plan_cache: dict = field(default_factory=dict)

    @property
    def starts(self) -> list[int]:
        """The host copy of query_start_loc."""
        return [0, *accumulate(self.query_lens)]

    def split(self) -> "StateSplit":
        """The batch as the vectorised paths run it, built once per forward pass."""
        cached = self.plan_cache.get("state_split")
        if cached is None:
            cached = self.plan_cache["state_split"] = StateSplit.of(self)
        return cached


@dataclass(frozen=True)
class StateSplit:
    """The one-token sequences (decode steps), run as one batched step, and the longer ones
    (prompt chunks), each run on its own by a chunked form."""

    step_rows: torch.Tensor  # (S,) int64: the token row of each one-token sequence
    step_slots: torch.Tensor  # (S,) int64: its state row
    step_initial: torch.Tensor  # (S,) bool: its has_initial_state
    # (first row, end row, index in the batch) of each longer sequence
    chunks: list[tuple[int, int, int]]

    @staticmethod
    def of(meta: StateMetadata) -> "StateSplit":
        starts = meta.starts
        steps = [i for i, n in enumerate(meta.query_lens) if n == 1]
        chunks = [(starts[i], starts[i + 1], i) for i, n in enumerate(meta.query_lens) if n > 1]
        device = meta.state_indices.device
        picked = torch.tensor(steps, dtype=torch.int64, device=device)
        return StateSplit(
            step_rows=torch.tensor([starts[i] for i in steps], dtype=torch.int64, device=device),
            step_slots=meta.state_indices[picked],
            step_initial=meta.has_initial_state[picked],
            chunks=chunks,
        )


def initial_rows(
    state: torch.Tensor, slots: torch.Tensor, initial: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The rows `slots` of `state` in `dtype`, zeros where `initial` is False (whatever the
    row holds, NaN included)."""
    rows = state.index_select(0, slots).to(dtype)
    mask = initial.view(-1, *([1] * (rows.dim() - 1)))
    return torch.where(mask, rows, torch.zeros((), dtype=dtype, device=rows.device))


def metadata(
    query_lens: list[int],
    state_indices: list[int],
    has_initial_state: list[bool],
    device: torch.device | str = "cpu",
) -> StateMetadata:
    """A StateMetadata from host lists (what an engine step and the tests have)."""
    return StateMetadata(
        query_start_loc=torch.tensor([0, *accumulate(query_lens)], device=device),
        query_lens=list(query_lens),
        state_indices=torch.tensor(state_indices, dtype=torch.int64, device=device),
        has_initial_state=torch.tensor(has_initial_state, dtype=torch.bool, device=device),
    )
