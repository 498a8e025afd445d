"""Linear layers that own their part of the weight under tensor parallelism.

Each layer knows which part of the checkpoint's matrix its rank holds and cuts it there:
every parameter has a `weight_loader(param, weight, shard_id)` that takes the checkpoint's
full tensor (lazy where the loader can, see `model.weights`, so that a rank reads only its
own bytes) and writes its part into place. The fused layers take their parts by shard id:
`QKVParallelLinear` "q", "k", "v"; `MergedColumnParallelLinear` 0 (gate), 1 (up); None
is a checkpoint that holds them fused already (Phi-3).

- `ReplicatedLinear`: every rank holds all of it (a router, a gate).
- `ColumnParallelLinear` (and its fused forms): a rank holds output rows.
- `RowParallelLinear`: a rank holds input columns and all-reduces its partial sum; its
  bias is added by rank 0 alone, so that the sum holds it once.
- `VocabParallelEmbedding`, `ParallelLMHead`: a rank holds rows of the vocabulary.

A layer multiplies a float weight as it lies. A weight in another format (the checkpoint's
own 4/8-bit codes kept quantized, float8, int8 rows, or a float one prepacked for oneDNN)
makes the layer use that format's linear method (`layers.linear_methods`), chosen per layer
at load (`finish_loading`), or after it (`prepack`, `quantize_int8`).
"""

import torch
import torch.nn.functional as F
from torch import nn

from pagefleet_serve.model.context import current_context
from pagefleet_serve.model.layers.linear_methods import PrepackedLinear, quantized_linear
from pagefleet_serve.model.quant import QuantizedWeight, quantize_int8
from pagefleet_serve.model.weights import (
    Ranges,
    Weight,
    cut,
    is_kept_quantized,
    load,
    load_into,
    shape_of,
)

# Up to this many float32 rows on the CPU, logits are the product with the vocabulary
# matrix as it lies (see ParallelLMHead; measured slower than MKL's GEMM from 12 rows).
FEW_LOGIT_ROWS = 8


def parameter(shape: tuple[int, ...], loader, dtype: torch.dtype) -> nn.Parameter:
    """An uninitialised parameter (never touched until loaded: its pages are not resident)
    that `loader` fills."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader
    return param


def default_weight_loader(param: nn.Parameter, weight: Weight, shard_id=None) -> None:
    """A replicated parameter: the whole checkpoint tensor, as it is."""
    load_into(weight, param.data)


class LinearBase(nn.Module):
    """y = x W^T (+ bias) over this rank's part of W: `in_features` x `out_features`."""

    # The shard ids of the parts, in their order along the output rows (None: one part).
    shard_ids: tuple = (None,)
    # Row-parallel: the output is a partial sum (all-reduced over the ranks unless the
    # caller sums it with others first: `reduce_results`), its bias added by rank 0.
    row_parallel = False
    reduce_results = False

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        context = current_context()
        self.parallel, self.backend, dtype = context.parallel, context.backend, context.dtype
        self.in_features, self.out_features = in_features, out_features
        self.weight = parameter((out_features, in_features), self.weight_loader, dtype)
        self.bias = parameter((out_features,), self.weight_loader, dtype) if bias else None
        # A format other than a float matrix as it lies (see the module docstring).
        self.method: nn.Module | None = None
        self._quantized: dict = {}  # shard id -> QuantizedWeight, until `finish_loading`
        self._bind()

    @property
    def bias_term(self) -> nn.Parameter | None:
        """The bias this rank adds (row-parallel: rank 0 alone)."""
        if self.row_parallel and self.parallel.rank != 0:
            return None
        return self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._compute(x)

    def _bind(self) -> None:
        """Bind the product of the current format once, the all-reduce after it where the
        output is a partial sum: a decode step makes ~121 of these calls."""
        compute = self._float if self.method is None else self.method.forward
        if self.reduce_results and self.parallel.parallel:
            all_reduce = self.parallel.all_reduce
            self._compute = lambda x: all_reduce(compute(x))
        else:
            self._compute = compute

    def _float(self, x: torch.Tensor) -> torch.Tensor:
        """On the CPU a single bfloat16/float16 row is computed as two rows (a broadcast,
        no copy): PyTorch sends one row to a matrix-vector routine several times slower
        than a two-row product."""
        if x.shape[0] == 1 and x.dtype != torch.float32 and x.device.type == "cpu":
            return F.linear(x.expand(2, -1), self.weight, self.bias_term)[:1]
        return F.linear(x, self.weight, self.bias_term)

    def use_method(self, method: nn.Module) -> None:
        """Multiply with `method` from now on; the float weight is dropped (a weight another
        module shares, a tied embedding, lives on there)."""
        self.method = method
        del self.weight
        self._bind()

    # -- loading -----------------------------------------------------------------------
    def part(self, shard_id, shape: tuple[int, ...], bias: bool) -> tuple[int, Ranges] | None:
        """(dim, ranges) of this rank's part of the checkpoint tensor of `shard_id`;
        None: all of it."""
        return None

    def rows(self, shard_id) -> tuple[int, int] | None:
        """Where the part of `shard_id` lies in this rank's rows; None: all of them."""
        return None

    def weight_loader(self, param: nn.Parameter, weight: Weight, shard_id=None) -> None:
        is_bias = param is self.bias
        where = self.part(shard_id, shape_of(weight), is_bias)
        if where is not None:
            weight = cut(weight, *where)
        if is_kept_quantized(weight) and not is_bias:
            self._quantized[shard_id] = load(weight, param.dtype)
            return
        rows = self.rows(shard_id)
        load_into(weight, param.data if rows is None else param.data[rows[0] : rows[1]])

    def finish_loading(self) -> None:
        """Multiply the checkpoint's own codes where they were kept quantized."""
        if not self._quantized:
            return
        shard_ids = (None,) if None in self._quantized else self.shard_ids  # fused already
        missing = [s for s in shard_ids if s not in self._quantized]
        if missing:
            raise ValueError(f"a fused matrix has quantized parts without parts {missing}")
        parts = [self._quantized.pop(s) for s in shard_ids]
        weight = parts[0] if len(parts) == 1 else QuantizedWeight.cat_rows(parts)
        self.use_method(quantized_linear(weight, self.bias_term, self.backend))

    def prepack(self) -> bool:
        """Reorder a float weight once for oneDNN on the CPU (see `PrepackedLinear`)."""
        if self.method is not None:
            return False
        self.use_method(PrepackedLinear(self, self.backend))
        return True

    def quantize_int8(self) -> None:
        """int8 codes with one scale per output row, weight-only (quantization int8)."""
        if self.method is None:
            self.use_method(
                quantized_linear(quantize_int8(self.weight), self.bias_term, self.backend)
            )

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}"


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole matrix."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias)


class ColumnParallelLinear(LinearBase):
    """A rank holds output rows: its part of `output_size` (at whole quantized blocks
    where every part can have some, as the intermediate size is split)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        self.first, end = current_context().parallel.intermediate(output_size)
        super().__init__(input_size, end - self.first, bias)

    def part(self, shard_id, shape, bias):
        if not self.parallel.parallel:
            return None
        return 0, [(self.first, self.first + self.out_features)]


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel matrices of equal height stacked along the rows, one product: gate
    and up (shard ids 0 and 1), each cut at this rank's part."""

    def __init__(self, input_size: int, output_size: int, num_parts: int = 2) -> None:
        self.first, end = current_context().parallel.intermediate(output_size)
        self.shard_ids = tuple(range(num_parts))
        LinearBase.__init__(self, input_size, num_parts * (end - self.first), bias=False)

    def part(self, shard_id, shape, bias):
        if not self.parallel.parallel:
            return None
        local = self.out_features // len(self.shard_ids)
        if shard_id is not None:
            return 0, [(self.first, self.first + local)]
        size = shape[0] // len(self.shard_ids)  # fused in the checkpoint: each part's rows
        return 0, [(i * size + self.first, i * size + self.first + local) for i in self.shard_ids]

    def rows(self, shard_id):
        if shard_id is None:
            return None
        local = self.out_features // len(self.shard_ids)
        return shard_id * local, (shard_id + 1) * local


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v stacked along the rows, one product: a rank holds its key/value heads and
    the query heads that read them (see `TensorParallel.q_heads`). `num_heads` and
    `num_kv_heads` are then this rank's."""

    shard_ids = ("q", "k", "v")

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        parallel = current_context().parallel
        q_first, q_end = parallel.q_heads(num_heads, num_kv_heads)
        kv_first, kv_end = parallel.kv_heads(num_heads, num_kv_heads)
        self.total_q, self.total_kv = num_heads * head_dim, num_kv_heads * head_dim
        self.q_rows = (q_first * head_dim, q_end * head_dim)
        self.kv_rows = (kv_first * head_dim, kv_end * head_dim)
        self.q_heads = (q_first, q_end)
        self.num_heads, self.num_kv_heads = q_end - q_first, kv_end - kv_first
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        LinearBase.__init__(self, hidden_size, self.q_size + 2 * self.kv_size, bias)

    def part(self, shard_id, shape, bias):
        if not self.parallel.parallel:
            return None
        if shard_id == "q":
            return 0, [self.q_rows]
        if shard_id in ("k", "v"):
            return 0, [self.kv_rows]
        k_rows = tuple(self.total_q + r for r in self.kv_rows)  # fused: q | k | v
        v_rows = tuple(self.total_q + self.total_kv + r for r in self.kv_rows)
        return 0, [self.q_rows, k_rows, v_rows]

    def rows(self, shard_id):
        q, kv = self.q_size, self.kv_size
        return {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv), None: None}[shard_id]


class RowParallelLinear(LinearBase):
    """A rank holds input columns and sums its partial output with the other ranks'. The
    inputs are this rank's query heads (`input_heads`: num_heads, num_kv_heads, head_dim
    of the whole model) or its part of an intermediate size. `reduce_results` False: the
    caller all-reduces the sum of this output and others (a shared expert's)."""

    row_parallel = True

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        input_heads: tuple[int, int, int] | None = None,
        reduce_results: bool = True,
    ) -> None:
        parallel = current_context().parallel
        self.reduce_results = reduce_results
        if input_heads is None:
            self.first, end = parallel.intermediate(input_size)
        else:
            num_heads, num_kv_heads, head_dim = input_heads
            first, end = parallel.q_heads(num_heads, num_kv_heads)
            self.first, end = first * head_dim, end * head_dim
        super().__init__(end - self.first, output_size, bias)

    def part(self, shard_id, shape, bias):
        if not self.parallel.parallel or bias:
            return None
        return len(shape) - 1, [(self.first, self.first + self.in_features)]


class VocabParallelEmbedding(nn.Module):
    """The embedding table: a rank looks up its part of the vocabulary (zero rows for the
    other ranks' ids), summed over the ranks. A quantized table is expanded at load: a
    lookup reads a few rows, not the whole table."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        context = current_context()
        self.parallel = context.parallel
        self.first, end = self.parallel.vocab(vocab_size)
        self.num_embeddings = end - self.first
        self.weight = parameter(
            (self.num_embeddings, hidden_size), self.weight_loader, context.dtype
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.parallel.parallel:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.first
        inside = (local >= 0) & (local < self.num_embeddings)
        x = F.embedding(torch.where(inside, local, 0), self.weight) * inside[:, None]
        return self.parallel.all_reduce(x)

    def weight_loader(self, param: nn.Parameter, weight: Weight, shard_id=None) -> None:
        if self.parallel.parallel:
            weight = cut(weight, 0, [(self.first, self.first + self.num_embeddings)])
        load_into(weight, param.data)


class ParallelLMHead(ColumnParallelLinear):
    """The vocabulary matrix (no bias): a rank scores its part of the vocabulary; the
    logits are gathered on rank 0 (`compute_logits`).

    MKL's float32 GEMM packs the (transposed) weight on every call: for a few rows of a
    matrix far larger than the caches that doubles the memory traffic (5 rows of SmolLM2's
    49152 x 576: 23-26 ms vs 13-15 ms for the product with the weight as it lies, one row
    14 ms either way), so 2 to FEW_LOGIT_ROWS float32 rows on the CPU (speculative
    verification scores 1 + k rows of each sequence) take that product instead."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        parallel = current_context().parallel
        self.vocab_size = vocab_size
        self.first, end = parallel.vocab(vocab_size)
        LinearBase.__init__(self, hidden_size, end - self.first, bias=False)

    def _float(self, x: torch.Tensor) -> torch.Tensor:
        if 1 < x.shape[0] <= FEW_LOGIT_ROWS and x.dtype == torch.float32 and x.is_cpu:
            return (self.weight @ x.T).T
        return super()._float(x)

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        """Score with the embedding's rows (unless the checkpoint gave the head its own
        quantized codes)."""
        if self.method is None:
            self.weight = embedding.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(rows, vocab) float32 logits; under tensor parallelism on rank 0 only (gathered
        from every rank's part), None on the other ranks."""
        return self.parallel.gather_vocab(self(hidden).float(), self.vocab_size)
