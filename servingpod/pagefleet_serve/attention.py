"""Choose the attention implementation; the rest of the engine is the same on every backend.

A backend follows `pagefleet_kernels.backend.AttentionBackend`: `torch` is
`pagefleet_kernels.torch_attention`, `cpu` its C++ decode kernel
(`pagefleet_kernels.cpu_attention`), `triton` the kernels of
`pagefleet_kernels.triton_attention`. `auto` takes Triton on CUDA and the C++ kernel on the
CPU when a compiler could build it (it measured 1.6x faster than torch for float32 decode at
batch 64, 5x with an int8 cache), torch otherwise.
"""

import os

import torch

from pagefleet_serve.config import ATTENTION_BACKENDS


def get_attention_backend(name: str, device: torch.device):
    """The backend module; every backend implements sliding windows and soft-capping."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
        if device.type == "cpu":
            from pagefleet_kernels import cpu_attention

            name = "cpu" if cpu_attention.available() else "torch"
    if name == "torch":
        from pagefleet_kernels import torch_attention

        return torch_attention
    if name == "cpu":
        from pagefleet_kernels import cpu_attention

        if device.type != "cpu" or not cpu_attention.available():
            raise ValueError(
                f"attention_backend 'cpu' needs the CPU device and a C++ compiler to build its "
                f"kernel (device {device}); use 'torch'"
            )
        return cpu_attention
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
