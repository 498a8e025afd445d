"""spec.parallelism against the model's shape, at reconcile.

vLLM's rules: `tensor` divides the attention heads; the KV heads are split when there are
at least `tensor` of them (so `tensor` divides them) and replicated otherwise (so they
divide `tensor`); `pipeline` stages get at least one layer each. The operator knows the
shape only of the model it ships (the built-in one); an hf://, pvc:// or file:// model's
config lives where only the pod reads it, so the pod's engine checks those at load and
the status says the operator could not (the ParallelismChecked condition, Unknown).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .spec import InferenceServiceSpec
from .status import Problem

CONDITION = "ParallelismChecked"


@dataclass(frozen=True)
class ModelShape:
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int


# The built-in model's GGUF header (tests/operator reads the file to keep this true).
KNOWN_MODEL_SHAPES = {"builtin://smollm2-135m": ModelShape(9, 3, 30)}


def shape_problem(tensor: int, pipeline: int, shape: ModelShape, uri: str) -> str | None:
    heads, kv_heads = shape.num_attention_heads, shape.num_key_value_heads
    if heads % tensor:
        return f"spec.parallelism.tensor: {tensor} does not divide the {heads} attention heads of {uri}"
    if kv_heads % tensor if kv_heads >= tensor else tensor % kv_heads:
        return (
            f"spec.parallelism.tensor: {tensor} and the {kv_heads} KV heads of {uri} do not "
            "split (one must divide the other)"
        )
    if pipeline > shape.num_hidden_layers:
        return (
            f"spec.parallelism.pipeline: {pipeline} stages exceed the "
            f"{shape.num_hidden_layers} layers of {uri}"
        )
    return None


def check_parallelism(spec: InferenceServiceSpec) -> tuple[Problem | None, dict[str, Any] | None]:
    """(the problem, the ParallelismChecked condition); (None, None) without parallelism."""
    parallelism = spec.parallelism
    if parallelism.world_size == 1:
        return None, None
    uri = spec.model.uri
    shape = KNOWN_MODEL_SHAPES.get(uri)
    if shape is None:
        return None, {
            "type": CONDITION,
            "status": "Unknown",
            "reason": "ModelConfigNotRead",
            "message": (
                f"tensor {parallelism.tensor} x pipeline {parallelism.pipeline}: the operator "
                f"does not read the config of {uri}; the serving pod checks the heads when "
                "it loads the model"
            ),
        }
    problem = shape_problem(parallelism.tensor, parallelism.pipeline, shape, uri)
    if problem is not None:
        return Problem("InvalidParallelism", problem), {
            "type": CONDITION,
            "status": "False",
            "reason": "InvalidParallelism",
            "message": problem,
        }
    return None, {
        "type": CONDITION,
        "status": "True",
        "reason": "HeadsSplit",
        "message": (
            f"tensor {parallelism.tensor} splits the {shape.num_attention_heads} attention "
            f"and {shape.num_key_value_heads} KV heads; pipeline {parallelism.pipeline} the "
            f"{shape.num_hidden_layers} layers"
        ),
    }
