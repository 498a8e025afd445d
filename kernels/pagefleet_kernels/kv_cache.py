"""What a KV cache stores: its element type, its scales when quantized, one layer's tensors.

Quantized caches (`fp8`: float8 e4m3, `int8`) keep one float32 scale per token per KV head
for K and for V: `x ~= code * scale` with `scale = max|x| / QMAX` over the head's
`head_dim` values. Why per token and head:
- the scale is known the moment a token's K/V are written: no calibration pass (a per-tensor
  scale needs one) and nothing written earlier is re-quantized when a block fills up (a
  per-block scale changes as tokens arrive);
- one outlier token or head (attention sinks, large-norm keys) does not coarsen the rest;
- it costs 4 bytes next to `head_dim` one-byte codes (6% at head_dim 64, 3% at 128), and the
  attention kernel applies it to a whole score column (K) or probability column (V) at once,
  never to the K/V tiles themselves.
"""

from dataclasses import dataclass

import torch

SCALE_DTYPE = torch.float32
# Largest code magnitude: int8 keeps the range symmetric; 448 is e4m3fn's largest finite value.
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


# The element type of each quantized `kv_cache_dtype` setting ("auto" is the model's own).
# The settings are named in pagefleet_serve.config.KV_CACHE_DTYPES, which the kernels, a
# layer below the serving package, do not import: tests/kernels checks the two agree.
QUANTIZED_KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for a `kv_cache_dtype` setting (auto: the model's dtype)."""
    if name == "auto":
        return model_dtype
    if name in QUANTIZED_KV_CACHE_DTYPES:
        return QUANTIZED_KV_CACHE_DTYPES[name]
    allowed = ", ".join(repr(n) for n in ("auto", *QUANTIZED_KV_CACHE_DTYPES))
    raise ValueError(f"kv_cache_dtype must be one of {allowed}, got {name!r}")


def is_quantized(cache_dtype: torch.dtype) -> bool:
    return cache_dtype in QMAX


def bytes_per_token_head(cache_dtype: torch.dtype, head_dim: int) -> int:
    """Bytes one token of one KV head takes in the K (or the V) cache, scale included."""
    element = torch.empty((), dtype=cache_dtype).element_size()
    scale = torch.empty((), dtype=SCALE_DTYPE).element_size() if is_quantized(cache_dtype) else 0
    return head_dim * element + scale


@dataclass(frozen=True)
class LayerKVCache:
    """One layer's cache, views into the engine's pool."""

    key: torch.Tensor  # (num_blocks, block_size, num_kv_heads, head_dim)
    value: torch.Tensor  # (num_blocks, block_size, num_kv_heads, head_dim)
    key_scale: torch.Tensor | None = None  # (num_blocks, block_size, num_kv_heads) float32
    value_scale: torch.Tensor | None = None  # None when the cache is not quantized
