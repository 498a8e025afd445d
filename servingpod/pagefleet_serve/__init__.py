"""PageFleet's serving pod: a paged-KV, continuously batching Llama engine and its server.

The public names are imported on first use, so that light parts of the package (the
model URI parser the operator validates specs with) load without torch.
"""

import importlib

_EXPORTS = {
    "LLM": "pagefleet_serve.llm",
    "CompletionOutput": "pagefleet_serve.outputs",
    "EngineConfig": "pagefleet_serve.config",
    "RequestOutput": "pagefleet_serve.outputs",
    "SamplingParams": "pagefleet_serve.sampling_params",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagefleet_serve' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
