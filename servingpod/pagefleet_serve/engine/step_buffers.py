"""One step's integer metadata in one persistent buffer: filled on the host, copied to the
device in one copy, read there through views.

A forward pass needs its tokens' ids, positions and KV slots, each sequence's context
length, where its tokens start in the flattened batch and its block table (padded to the
widest), and the sampler needs the rows whose logits it reads. All are int64 (what the
kernels are compiled for) and lie end to end in one host buffer (pinned on CUDA, so that
the copy is asynchronous) and one device buffer of the same size, both allocated once and
grown only when a step needs more room: a step costs one host-to-device copy and no
synchronisation. The backends read the values they need on the host from the host side
(`AttentionMetadata.seq_lens_host`, `query_start_loc_host`), not from the device.

A step whose rows read LoRA adapters adds each token's slot and the tokens of each slot,
grouped (`LoRAMapping`), to the same buffer.
"""

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from pagefleet_kernels.metadata import AttentionMetadata, LoRAMapping


@dataclass
class StepInputs:
    """What one forward pass and its sampling read, views into the device buffer."""

    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    attn: AttentionMetadata
    logits_rows: torch.Tensor  # (S,) int64: the hidden rows whose logits are computed
    sample_rows: torch.Tensor  # (R,) int64: the logits row each sample row draws from
    lora: LoRAMapping | None = None  # None: no row reads an adapter


class StepBuffers:
    def __init__(self, device: torch.device, block_size: int) -> None:
        self.device = device
        self.block_size = block_size
        self._pinned = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.int64)
        self._device = torch.empty(0, dtype=torch.int64, device=device)
        # Recorded after each copy: the host buffer is not rewritten before the copy read it.
        self._copied = torch.cuda.Event() if self._pinned else None

    @property
    def capacity(self) -> int:
        """Elements each buffer holds."""
        return self._host.numel()

    @torch.inference_mode()
    def build(
        self,
        input_ids: list[int],
        starts: list[int],
        query_lens: list[int],
        tables: list[list[int]],
        logits_rows: Sequence[int] = (),
        sample_rows: Sequence[int] = (),
        lora_slots: Sequence[int] = (),
    ) -> StepInputs:
        """Sequence i's `query_lens[i]` tokens sit at positions from `starts[i]`; their K/V
        go to the slots its block table `tables[i]` names; they read LoRA adapter slot
        `lora_slots[i]` (-1: none; empty: no sequence reads one)."""
        num_tokens, num_seqs = len(input_ids), len(query_lens)
        width = max(map(len, tables))
        sizes = [num_tokens] * 3 + [num_seqs, num_seqs + 1, len(logits_rows), len(sample_rows)]
        sizes.append(num_seqs * width)
        lora = _lora_rows(lora_slots, query_lens)
        if lora is not None:
            sizes += [len(part) for part in lora.arrays]
        total = sum(sizes)
        self._reserve(total)
        host, bounds = self._host.numpy(), [0, *itertools.accumulate(sizes)]
        parts = [host[lo:hi] for lo, hi in itertools.pairwise(bounds)]
        ids, positions, slots, seq_lens, query_start_loc, logits, samples, table = parts[:8]
        if lora is not None:
            for part, values in zip(parts[8:], lora.arrays, strict=True):
                part[:] = values
        ids[:] = input_ids
        logits[:] = logits_rows
        samples[:] = sample_rows
        q_lens = np.array(query_lens, dtype=np.int64)
        first = np.array(starts, dtype=np.int64)
        query_start_loc[0] = 0
        np.cumsum(q_lens, out=query_start_loc[1:])
        np.add(first, q_lens, out=seq_lens)
        # Token t of sequence i sits at position starts[i] + (t - query_start_loc[i]).
        seq_index = np.repeat(np.arange(num_seqs), q_lens)
        offsets = first - query_start_loc[:-1]
        np.add(np.arange(num_tokens), offsets[seq_index], out=positions)
        table = table.reshape(num_seqs, width)
        self._fill_tables(table, tables)
        block = table[seq_index, positions // self.block_size]
        np.add(block * self.block_size, positions % self.block_size, out=slots)
        self._copy(total)
        views = self._device[:total].split(sizes)
        return StepInputs(
            input_ids=views[0],
            positions=views[1],
            attn=AttentionMetadata(
                slot_mapping=views[2],
                block_tables=views[7].view(num_seqs, width),
                seq_lens=views[3],
                query_start_loc=views[4],
                query_lens=query_lens,
                seq_lens_host=seq_lens.tolist(),
                query_start_loc_host=query_start_loc.tolist(),
            ),
            logits_rows=views[5],
            sample_rows=views[6],
            lora=None if lora is None else lora.mapping(views[8:]),
        )

    @staticmethod
    def _fill_tables(table: np.ndarray, tables: list[list[int]]) -> None:
        """Each row its block ids, then zeros: one boolean-mask fill over the flattened
        ids, no per-row Python."""
        lens = np.fromiter(map(len, tables), np.int64, len(tables))
        flat = np.fromiter(itertools.chain.from_iterable(tables), np.int64, int(lens.sum()))
        table.fill(0)
        table[np.arange(table.shape[1]) < lens[:, None]] = flat

    def _reserve(self, total: int) -> None:
        """Room for `total` elements (at least doubled when it grows, so that contexts
        growing a block at a time reallocate rarely), and the host side free to write."""
        if self._copied is not None:
            self._copied.synchronize()  # a no-op once the step's results were read back
        if total <= self.capacity:
            return
        size = max(total, 2 * self.capacity)
        self._host = torch.empty(size, dtype=torch.int64, pin_memory=self._pinned)
        self._device = torch.empty(size, dtype=torch.int64, device=self.device)

    def _copy(self, total: int) -> None:
        """The step's one host-to-device copy."""
        self._device[:total].copy_(self._host[:total], non_blocking=self._pinned)
        if self._copied is not None:
            self._copied.record()


@dataclass
class _LoRARows:
    """A step's `LoRAMapping` on the host: its arrays, and each slot read with its rows."""

    arrays: tuple[np.ndarray, ...]  # token_slots, rows, padded_rows, padded_positions
    counts: list[tuple[int, int]]  # (slot, rows reading it), by slot

    def mapping(self, views: Sequence[torch.Tensor]) -> LoRAMapping:
        token_slots, rows, padded_rows, positions = views
        groups = rows.split([count for _, count in self.counts])
        slot_rows = [(slot, g) for (slot, _), g in zip(self.counts, groups, strict=True)]
        return LoRAMapping(token_slots, slot_rows, rows, padded_rows, positions)


def _lora_rows(lora_slots: Sequence[int], query_lens: list[int]) -> _LoRARows | None:
    """Each token's adapter slot (-1: none), the tokens that read one grouped by slot (in
    order within a slot), the same as a (slots read, most rows) table padded with row 0
    (whose products there are never read back), and where each grouped token lies in that
    table; None when no sequence reads an adapter."""
    if not lora_slots or max(lora_slots) < 0:
        return None
    token_slots = np.repeat(np.asarray(lora_slots, dtype=np.int64), query_lens)
    order = np.argsort(token_slots, kind="stable")
    rows = order[token_slots[order] >= 0]
    present, counts = np.unique(token_slots[rows], return_counts=True)
    slot_index = np.repeat(np.arange(len(present)), counts)  # each grouped row's slot
    column = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)
    width = int(counts.max())
    padded = np.zeros((len(present), width), dtype=np.int64)
    padded[slot_index, column] = rows
    positions = slot_index * width + column
    arrays = (token_slots, rows, padded.ravel(), positions)
    return _LoRARows(arrays, list(zip(present.tolist(), counts.tolist(), strict=True)))
