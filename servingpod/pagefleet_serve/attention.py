"""Choose the attention implementation; the rest of the engine is the same on every backend.

A backend is any object with `write_kv_cache(...)` and `paged_attention(...)` of the
signatures in `pagefleet_kernels.reference`.
"""

import torch


def get_attention_backend(name: str, device: torch.device):
    if name in ("auto", "torch"):
        from pagefleet_kernels import reference

        return reference
    raise ValueError(f"attention_backend must be 'auto' or 'torch', got {name!r}")
