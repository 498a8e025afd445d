"""Tests of the attention and layer kernels against naive PyTorch references."""
