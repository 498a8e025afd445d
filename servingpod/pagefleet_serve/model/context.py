"""What a model's layers take from where they are built: the kernel backend, the rank's
place among the parallel ranks, and the dtype their parameters are made in.

A model is built inside `building(...)` (see `registry.build_model`), once; each layer reads
`current_context()` in its constructor, so that neither the backend nor the parallel groups
are passed down through the model files (the way vLLM's layers read its current config).
Outside a `building` block the context is the torch backend on one rank in float32: a
model or a layer built to inspect or test it alone.
"""

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from pagefleet_kernels.backend import KernelBackend, torch_backend

from pagefleet_serve.model.tensor_parallel import NO_PARALLEL, TensorParallel


@dataclass(frozen=True)
class ModelContext:
    backend: KernelBackend
    parallel: TensorParallel = NO_PARALLEL
    dtype: torch.dtype = torch.float32  # of the parameters, which the weights are loaded into


_CURRENT: contextvars.ContextVar[ModelContext | None] = contextvars.ContextVar(
    "model_context", default=None
)


def current_context() -> ModelContext:
    context = _CURRENT.get()
    return ModelContext(torch_backend()) if context is None else context


@contextlib.contextmanager
def building(context: ModelContext) -> Iterator[ModelContext]:
    token = _CURRENT.set(context)
    try:
        yield context
    finally:
        _CURRENT.reset(token)
