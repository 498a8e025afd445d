"""Choose the attention implementation; the rest of the engine is the same on every backend.

A backend is any object with `write_kv_cache(...)` and `paged_attention(...)` of the
signatures in `pagefleet_kernels.reference`: `torch` is that reference, `triton` the
kernels of `pagefleet_kernels.triton_attention`; `auto` takes Triton on CUDA, the
reference elsewhere.
"""

import os

import torch

from pagefleet_serve.config import ATTENTION_BACKENDS


def get_attention_backend(name: str, device: torch.device, sliding_window: int | None = None):
    """The backend module; `sliding_window`: the model's, if any of its layers has one."""
    if name == "auto":
        # The Triton kernels have no sliding window; the reference runs on CUDA too.
        name = "triton" if device.type == "cuda" and sliding_window is None else "torch"
    if name == "triton" and sliding_window is not None:
        raise ValueError(
            f"the model uses sliding-window attention (sliding_window={sliding_window}), which "
            "the Triton kernels do not implement; use attention_backend 'torch'"
        )
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
