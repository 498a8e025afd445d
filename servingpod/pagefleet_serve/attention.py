"""Choose the attention implementation; the rest of the engine is the same on every backend.

A backend is any object with `write_kv_cache(...)` and `paged_attention(...)` of the
signatures in `pagefleet_kernels.reference`: `torch` is that reference, `triton` the
kernels of `pagefleet_kernels.triton_attention`; `auto` takes Triton on CUDA, the
reference elsewhere.
"""

import os

import torch

from pagefleet_serve.config import ATTENTION_BACKENDS


def get_attention_backend(name: str, device: torch.device):
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from pagefleet_kernels import reference

        return reference
    if name == "triton":
        # The interpreter runs the same kernels on CPU tensors (slowly): for tests.
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"attention_backend 'triton' needs a CUDA device, got {device}; use 'torch' "
                f"(or set TRITON_INTERPRET=1 to run the kernels in the Triton interpreter)"
            )
        from pagefleet_kernels import triton_attention

        return triton_attention
    raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
