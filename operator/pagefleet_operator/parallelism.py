"""spec.parallelism against the model's shape, at reconcile.

The rule is the engine's own (`pagefleet_serve.parallel_shape`), so that the operator
accepts exactly the shapes a pod serves. The operator knows the shape only of the model it
ships (the built-in one); an hf://, pvc:// or file:// model's config lives where only the
pod reads it, so the pod's engine checks those at load and the status says the operator
could not (the ParallelismChecked condition, Unknown).
"""

from __future__ import annotations

from typing import Any

from pagefleet_serve.parallel_shape import ModelShape, shape_problem

from .spec import InferenceServiceSpec
from .status import Problem

CONDITION = "ParallelismChecked"


# The built-in model's GGUF header (tests/operator reads the file to keep this true).
KNOWN_MODEL_SHAPES = {
    "builtin://smollm2-135m": ModelShape(num_heads=9, num_kv_heads=3, num_layers=30)
}


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
    found = shape_problem(parallelism.tensor, parallelism.pipeline, shape)
    if found is not None:
        problem = f"spec.parallelism.{found.axis}: {found.size} {found.reason} ({uri})"
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
            f"tensor {parallelism.tensor} splits the {shape.num_heads} attention "
            f"and {shape.num_kv_heads} KV heads; pipeline {parallelism.pipeline} the "
            f"{shape.num_layers} layers"
        ),
    }
