"""Megatron-style tensor parallelism of the one model: the parts of the heads, the
intermediate size and the vocabulary a rank holds, and the collectives its layers call
(`torch.distributed`'s, over the default process group the engine set up: gloo on the CPU,
NCCL on CUDA).

q/k/v and gate/up are column-parallel (a rank holds the output rows of its heads, of its
part of the intermediate size); o and down are row-parallel (the matching input columns),
each followed by one all-reduce, their bias held by rank 0 alone so that the sum adds it
once. The embedding and the LM head are vocabulary-parallel: a rank looks up and scores
its part of the vocabulary; the looked-up rows are all-reduced, the logits gathered on
rank 0. Norms, the router of a mixture and a shared expert's gate are replicated. The
parallel layers (`model.layers.linear`) take their parts from here and cut them out of the
checkpoint's tensors as they load.

Heads are split by key/value groups, so that each rank's query heads read only its own
key/value heads (and its KV cache holds only those): with more ranks than key/value heads,
each rank holds the one key/value head its query heads read (replicated, as vLLM does).
Parts may be uneven (SmolLM2's 3 key/value heads over 2 ranks: 2 and 1); a quantized
matrix split along its inputs is cut at whole blocks.

Pipeline parallelism splits the layers too: the ranks form `stages` stages of `size` ranks
each (global rank = stage * size + rank), each stage holding a contiguous run of layers,
split as above among its ranks, whose collectives run in the stage's own process group.
The first stage holds the embedding, the last the final norm and the LM head (and the
embedding's rows, when the head is tied to them). A stage hands its output rows to the
next one, rank to rank (`send_hidden`, `receive_hidden`); the last stage's logits go to
global rank 0, which samples (`send_logits`, `receive_logits`).
"""

from dataclasses import dataclass, field

import torch

from pagefleet_serve.model.quant import GGUF_GROUP


def _part(n: int, rank: int, size: int, align: int = 1) -> tuple[int, int]:
    """Rank `rank`'s contiguous part of `n` items, the first parts the larger, each
    boundary a multiple of `align`."""
    units = n // align
    return -(-rank * units // size) * align, -(-(rank + 1) * units // size) * align


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place among `size` ranks (size 1: the whole model, no collectives), in
    pipeline stage `stage` of `stages`; `group`: the stage's process group (None: the
    default one, which a single stage's ranks make up)."""

    rank: int = 0
    size: int = 1
    stage: int = 0
    stages: int = 1
    group: object = field(default=None, compare=False, repr=False)

    @property
    def parallel(self) -> bool:
        return self.size > 1

    @property
    def global_rank(self) -> int:
        return self.stage * self.size + self.rank

    @property
    def first_stage(self) -> bool:
        return self.stage == 0

    @property
    def last_stage(self) -> bool:
        return self.stage == self.stages - 1

    def layers(self, num_layers: int) -> tuple[int, int]:
        """[first, end) of this stage's layers (the first stages the longer)."""
        return _part(num_layers, self.stage, self.stages)

    # -- the parts ---------------------------------------------------------------------
    def kv_heads(self, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
        """[first, end) of this rank's key/value heads."""
        if num_kv_heads >= self.size:
            return _part(num_kv_heads, self.rank, self.size)
        head = self.rank * num_kv_heads // self.size
        return head, head + 1

    def q_heads(self, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
        """[first, end) of this rank's query heads: the groups of its key/value heads, or
        (more ranks than key/value heads) its share of the one group it reads."""
        if num_kv_heads >= self.size:
            group = num_heads // num_kv_heads
            first, end = self.kv_heads(num_heads, num_kv_heads)
            return first * group, end * group
        return _part(num_heads, self.rank, self.size)

    def intermediate(self, n: int) -> tuple[int, int]:
        """[first, end) of an MLP's (or an expert's) intermediate size, at whole quantized
        blocks where every part can have some."""
        return _part(
            n, self.rank, self.size, GGUF_GROUP if n % (GGUF_GROUP * self.size) == 0 else 1
        )

    def vocab(self, n: int) -> tuple[int, int]:
        return _part(n, self.rank, self.size)

    def vocab_width(self, n: int) -> int:
        """The widest rank's part of the vocabulary (rank 0's): what the gather pads to."""
        first, end = _part(n, 0, self.size)
        return end - first

    def max_kv_heads(self, num_heads: int, num_kv_heads: int) -> int:
        """The most key/value heads any rank holds (rank 0's): what sizes a KV block."""
        first, end = TensorParallel(0, self.size).kv_heads(num_heads, num_kv_heads)
        return end - first

    # -- the collectives ---------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x`, in place (row-parallel outputs, looked-up rows)."""
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Every rank's (rows, its part) logits side by side on rank 0, (rows, vocab);
        None on the other ranks."""
        if self.size == 1:
            return logits
        width = self.vocab_width(vocab_size)
        if logits.shape[1] < width:
            logits = torch.nn.functional.pad(logits, (0, width - logits.shape[1]))
        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.size)] if self.rank == 0 else None
        torch.distributed.gather(logits, parts, dst=self.stage * self.size, group=self.group)
        if parts is None:
            return None
        widths = [
            end - first
            for first, end in (_part(vocab_size, r, self.size) for r in range(self.size))
        ]
        return torch.cat([part[:, :w] for part, w in zip(parts, widths, strict=True)], dim=1)

    # -- between the stages ------------------------------------------------------------
    def send_hidden(self, x: torch.Tensor) -> None:
        """This stage's output rows to the same rank of the next stage."""
        torch.distributed.send(x.contiguous(), self.global_rank + self.size)

    def receive_hidden(
        self, num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The previous stage's (tokens, hidden) output rows, from the same rank of it."""
        x = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
        torch.distributed.recv(x, self.global_rank - self.size)
        return x

    def send_logits(self, logits: torch.Tensor | None) -> torch.Tensor | None:
        """The last stage's gathered logits to global rank 0 (which samples); returned as
        they are when this rank is rank 0 (one stage), else None."""
        if self.stages == 1 or logits is None:
            return logits
        torch.distributed.send(logits, 0)
        return None

    def receive_logits(self, rows: int, vocab_size: int, device: torch.device) -> torch.Tensor:
        """On global rank 0 of a pipeline: the last stage's (rows, vocab) logits."""
        logits = torch.empty(rows, vocab_size, dtype=torch.float32, device=device)
        torch.distributed.recv(logits, (self.stages - 1) * self.size)
        return logits


NO_PARALLEL = TensorParallel()
