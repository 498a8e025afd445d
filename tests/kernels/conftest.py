"""Kernel tests run the Triton kernels on the CPU through the Triton interpreter when no
CUDA device is present. The interpreter is chosen when `triton.jit` decorates a kernel, so
TRITON_INTERPRET must be set before `pagefleet_kernels.triton_attention` is first imported
(nothing imports it before this conftest: the engine loads it only for the triton backend).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def device() -> torch.device:
    """CUDA when present (compiled kernels), else the CPU (interpreted kernels)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
