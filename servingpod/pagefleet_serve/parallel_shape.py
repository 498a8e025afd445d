"""Which tensor x pipeline shapes a model can be split into: the one rule the engine
applies when it loads a model and the operator applies to `spec.parallelism` (torch-free).

Tensor parallelism splits the key/value heads into contiguous parts, the first parts the
larger (3 heads over 2 ranks: 2 and 1), each rank taking the query heads of its key/value
heads; with more ranks than key/value heads each head is replicated over a whole number of
ranks, which then split its query heads. A norm over the whole key projection (OLMoE) sums
its squares over the ranks and cannot be replicated. Each pipeline stage needs a layer.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    num_heads: int
    num_kv_heads: int
    num_layers: int
    # A norm over the whole key projection (OLMoE's k_norm), not over each head.
    whole_kv_norm: bool = False


@dataclass(frozen=True)
class ShapeProblem:
    """`size` (of `axis`: "tensor" or "pipeline") does not fit the model: `reason` reads
    after the size, e.g. f"tensor_parallel_size {size} {reason}"."""

    axis: str
    size: int
    reason: str


def shape_problem(tensor: int, pipeline: int, shape: ModelShape) -> ShapeProblem | None:
    heads, kv_heads = shape.num_heads, shape.num_kv_heads
    if tensor > kv_heads and (tensor % kv_heads or heads % tensor):
        return ShapeProblem(
            "tensor",
            tensor,
            f"exceeds the model's {kv_heads} key/value heads: it must then be a multiple of "
            f"them and divide the {heads} attention heads",
        )
    if tensor > kv_heads and shape.whole_kv_norm:
        return ShapeProblem(
            "tensor",
            tensor,
            f"exceeds the model's {kv_heads} key/value heads, which its norm over the whole "
            f"key projection (OLMoE) cannot replicate: use at most {kv_heads} ranks",
        )
    if pipeline > shape.num_layers:
        return ShapeProblem(
            "pipeline",
            pipeline,
            f"exceeds the model's {shape.num_layers} layers: each stage needs one at least",
        )
    return None


def check_shape(tensor: int, pipeline: int, shape: ModelShape) -> None:
    """ValueError naming the engine's flag when the model cannot be split so."""
    problem = shape_problem(tensor, pipeline, shape)
    if problem is not None:
        raise ValueError(f"{problem.axis}_parallel_size {problem.size} {problem.reason}")
