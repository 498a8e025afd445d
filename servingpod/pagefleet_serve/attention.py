"""Choose the kernel backend; the rest of the engine is the same on every backend.

`--attention-backend` (vLLM's name for the flag) names a whole `pagefleet_kernels.backend.
KernelBackend`, not only its attention: `torch` (PyTorch end to end), `cpu` (the C++
decode attention, layer ops, few-row and 4-bit/Q8_0 matmuls and fused decoder layer of
`cpu_attention` / `cpu_layer_ops`), `triton` (the Triton attention and layer ops). `auto`
takes Triton on CUDA and the C++ kernels on the CPU when they were built for its CPU (the
attention measured 1.6x faster than torch for float32 decode at batch 64, 5x with an int8
cache), torch otherwise.
"""

import os

import torch
from pagefleet_kernels.backend import KernelBackend, cpu_backend, torch_backend, triton_backend

from pagefleet_serve.config import ATTENTION_BACKENDS


def get_kernel_backend(name: str, device: torch.device) -> KernelBackend:
    """The backend `name` (one of ATTENTION_BACKENDS) on `device`; every backend implements
    sliding windows and soft-capping."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
        if device.type == "cpu":
            from pagefleet_kernels import cpu_attention

            name = "cpu" if cpu_attention.available() else "torch"
    if name == "torch":
        return torch_backend()
    if name == "cpu":
        from pagefleet_kernels import cpu_attention

        if device.type != "cpu" or not cpu_attention.available():
            raise ValueError(
                f"attention_backend 'cpu' needs the CPU device and its C++ kernels built for this "
                f"CPU (device {device}; `python -m pagefleet_kernels.cpu_build` builds them); "
                f"use 'torch'"
            )
        return cpu_backend()
    if name == "triton":
        # The interpreter runs the same kernels on CPU tensors (slowly): for tests.
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"attention_backend 'triton' needs a CUDA device, got {device}; use 'torch' "
                f"(or set TRITON_INTERPRET=1 to run the kernels in the Triton interpreter)"
            )
        return triton_backend()
    raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
