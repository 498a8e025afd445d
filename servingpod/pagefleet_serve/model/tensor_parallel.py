"""Megatron-style tensor parallelism of the one model: which part of each weight a rank
holds, and the collectives its layers call (`torch.distributed`'s, over the default
process group the engine set up: gloo on the CPU, NCCL on CUDA).

q/k/v and gate/up are column-parallel (a rank holds the output rows of its heads, of its
part of the intermediate size); o and down are row-parallel (the matching input columns),
each followed by one all-reduce, their bias held by rank 0 alone so that the sum adds it
once. The embedding and the LM head are vocabulary-parallel: a rank looks up and scores
its part of the vocabulary; the looked-up rows are all-reduced, the logits gathered on
rank 0. Norms, the router of a mixture and a shared expert's gate are replicated.

Heads are split by key/value groups, so that each rank's query heads read only its own
key/value heads (and its KV cache holds only those): with more ranks than key/value heads,
each rank holds the one key/value head its query heads read (replicated, as vLLM does).
Parts may be uneven (SmolLM2's 3 key/value heads over 2 ranks: 2 and 1); a quantized
matrix split along its inputs is cut at whole blocks.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagefleet_serve.model.quant import GGUF_GROUP

# A weight a rank leaves out (a row-parallel bias on ranks other than 0).
SKIP = "skip"


def _part(n: int, rank: int, size: int, align: int = 1) -> tuple[int, int]:
    """Rank `rank`'s contiguous part of `n` items, the first parts the larger, each
    boundary a multiple of `align`."""
    units = n // align
    return -(-rank * units // size) * align, -(-(rank + 1) * units // size) * align


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place among `size` ranks (size 1: the whole model, no collectives)."""

    rank: int = 0
    size: int = 1

    @property
    def parallel(self) -> bool:
        return self.size > 1

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
            torch.distributed.all_reduce(x)
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
        torch.distributed.gather(logits, parts, dst=0)
        if parts is None:
            return None
        widths = [
            end - first
            for first, end in (_part(vocab_size, r, self.size) for r in range(self.size))
        ]
        return torch.cat([part[:, :w] for part, w in zip(parts, widths, strict=True)], dim=1)


NO_PARALLEL = TensorParallel()


@dataclass(frozen=True)
class ShardPlan:
    """Which part of each checkpoint weight a rank loads, from the model's head counts."""

    tp: TensorParallel
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def slices(
        self, name: str, shape: Sequence[int]
    ) -> tuple[int, list[tuple[int, int]]] | str | None:
        """(dim, [first, end) ranges along it, concatenated) of the Hugging Face-named
        weight `name` of `shape`; None: the whole weight; SKIP: none of it."""
        if not self.tp.parallel:
            return None
        tp, d = self.tp, self.head_dim
        parts = name.removesuffix(".weight").removesuffix(".bias").split(".")
        kind, bias = parts[-1], name.endswith(".bias")
        q_first, q_end = tp.q_heads(self.num_heads, self.num_kv_heads)
        kv_first, kv_end = tp.kv_heads(self.num_heads, self.num_kv_heads)
        q_rows = (q_first * d, q_end * d)
        kv_rows = (kv_first * d, kv_end * d)
        rows = 0 if bias else len(shape) - 2  # the output dim (after the experts', if any)
        columns = len(shape) - 1
        if kind in ("embed_tokens", "lm_head"):
            return 0, [tp.vocab(shape[0])]
        if kind == "q_proj":
            return 0, [q_rows]
        if kind in ("k_proj", "v_proj"):
            return 0, [kv_rows]
        if kind == "qkv_proj":  # Phi-3's fused rows: q | k | v
            q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
            k_rows = tuple(q_size + r for r in kv_rows)
            v_rows = tuple(q_size + kv_size + r for r in kv_rows)
            return 0, [q_rows, k_rows, v_rows]
        if kind == "o_proj":
            if bias:
                return None if tp.rank == 0 else SKIP
            return columns, [q_rows]
        if kind in ("gate_proj", "up_proj"):
            return rows, [tp.intermediate(shape[rows])]
        if kind == "gate_up_proj":  # fused gate | up rows (Phi-3, stacked experts)
            half = shape[rows] // 2
            first, end = tp.intermediate(half)
            return rows, [(first, end), (half + first, half + end)]
        if kind == "down_proj":
            return columns, [tp.intermediate(shape[columns])]
        return None

    def shape(self, name: str, shape: Sequence[int]) -> tuple[int, ...] | None:
        """The shape of this rank's part of `name` (None: it holds none)."""
        plan = self.slices(name, shape)
        if plan is None:
            return tuple(shape)
        if plan == SKIP:
            return None
        dim, ranges = plan
        out = list(shape)
        out[dim] = sum(end - first for first, end in ranges)
        return tuple(out)


def take(source, dim: int, ranges: list[tuple[int, int]], cat=torch.cat):
    """The `ranges` of `source` along `dim`, concatenated: a tensor, a numpy array or a
    safetensors slice (which reads only those parts of the file); `cat` joins them."""
    pieces = [source[(slice(None),) * dim + (slice(first, end),)] for first, end in ranges]
    return pieces[0] if len(pieces) == 1 else cat(pieces, dim)


def check_shardable(
    size: int, num_heads: int, num_kv_heads: int, qk_norm_whole: bool = False
) -> None:
    """ValueError when the model cannot be split over `size` ranks."""
    if size == 1:
        return
    if num_kv_heads < size and (size % num_kv_heads or num_heads % size):
        raise ValueError(
            f"tensor_parallel_size {size} exceeds the model's {num_kv_heads} key/value heads: "
            f"it must then be a multiple of them and divide the {num_heads} attention heads"
        )
    if qk_norm_whole:
        raise ValueError(
            "tensor parallelism does not support q/k norms over the whole projection "
            "(OLMoE) yet: use tensor_parallel_size 1"
        )
