"""The cache write (Triton vs the torch backend, bit for bit) and the int8 / fp8 quantization."""

import pytest
import torch
from pagefleet_kernels import torch_attention, triton_attention
from pagefleet_kernels.kv_cache import (
    SCALE_DTYPE,
    bytes_per_token_head,
    is_quantized,
    kv_cache_torch_dtype,
)

from tests.kernels.conftest import requires_cuda
from tests.kernels.kernel_batches import CACHE_DTYPES


def empty_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, cache, device):
    cache_dtype = CACHE_DTYPES[cache] or dtype
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.zeros(shape, dtype=cache_dtype, device=device) for _ in range(2)]
    scales = [None, None]
    if is_quantized(cache_dtype):
        scales = [torch.zeros(shape[:3], dtype=SCALE_DTYPE, device=device) for _ in range(2)]
    return caches + scales


def bits(t: torch.Tensor) -> torch.Tensor:
    """Compare float8 (and every other dtype) bit for bit."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def check_write(num_tokens, num_kv_heads, head_dim, block_size, dtype, cache, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    num_blocks = num_tokens // block_size + 4
    # K and V as the model hands them over: views into one fused qkv projection.
    qkv = (torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=generator) * 3).to(dtype)
    qkv[0, 1] = 0.0  # a row of zeros still gets a finite scale
    qkv = qkv.to(device)
    key, value = qkv[:, 1], qkv[:, 2]
    slot_mapping = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slot_mapping = slot_mapping.to(device)
    expected = empty_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, cache, device)
    actual = empty_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, cache, device)
    torch_attention.write_kv_cache(
        key, value, expected[0], expected[1], slot_mapping, *expected[2:]
    )
    triton_attention.write_kv_cache(key, value, actual[0], actual[1], slot_mapping, *actual[2:])
    for want, got in zip(expected, actual, strict=True):
        if want is not None:
            assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("cache", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_write_matches_reference_bit_for_bit(dtype, cache, device):
    check_write(40, 3, 64, 16, dtype, cache, device)


@pytest.mark.parametrize(("num_kv_heads", "head_dim", "block_size"), [(1, 128, 32), (8, 80, 16)])
def test_write_other_shapes(num_kv_heads, head_dim, block_size, device):
    for cache in ("int8", "fp8"):
        check_write(17, num_kv_heads, head_dim, block_size, torch.bfloat16, cache, device)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("cache", ["auto", "int8", "fp8"])
def test_gpu_write_full_size(cache, device):
    check_write(8192, 8, 128, 16, torch.bfloat16, cache, device)


def test_quantization_error_bounds():
    x = torch.randn(1000, 64, generator=torch.Generator().manual_seed(0)) * 5
    codes, scale = torch_attention.quantize_kv(x, torch.int8)
    assert codes.dtype == torch.int8 and scale.shape == (1000,)
    assert codes.abs().amax(-1).eq(127).all()  # the row's largest value uses the full range
    error = (torch_attention.dequantize_kv(codes, scale, torch.float32) - x).abs()
    assert (error <= scale[:, None] / 2 * (1 + 1e-5)).all()  # half a step

    codes, scale = torch_attention.quantize_kv(x, torch.float8_e4m3fn)
    assert codes.float().abs().amax(-1).eq(448).all()
    deq = torch_attention.dequantize_kv(codes, scale, torch.float32)
    # e4m3: 3 mantissa bits, half a step is 2**-4 relative; below 2**-6 (in code units) the
    # step is a fixed 2**-9.
    bound = torch.maximum(x.abs() * 2**-4, scale[:, None] * 2**-10) * (1 + 1e-5)
    assert ((deq - x).abs() <= bound).all()


def test_a_row_of_zeros_stays_zero():
    for dtype in (torch.int8, torch.float8_e4m3fn):
        codes, scale = torch_attention.quantize_kv(torch.zeros(2, 16), dtype)
        assert torch.isfinite(scale).all() and (scale > 0).all()
        assert torch_attention.dequantize_kv(codes, scale, torch.float32).eq(0).all()


def test_reference_rejects_missing_scales():
    caches = empty_cache(4, 16, 2, 16, torch.float32, "int8", "cpu")
    with pytest.raises(ValueError, match="needs scales"):
        torch_attention.write_kv_cache(
            torch.zeros(1, 2, 16), torch.zeros(1, 2, 16), caches[0], caches[1], torch.tensor([0])
        )


def test_cache_dtypes_and_sizes():
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("int8", torch.float32) == torch.int8
    assert kv_cache_torch_dtype("fp8", torch.float16) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_cache_torch_dtype("fp4", torch.float32)
    # One token of one head: codes plus a float32 scale.
    assert bytes_per_token_head(torch.float32, 64) == 256
    assert bytes_per_token_head(torch.int8, 64) == 68  # 3.8x fewer than float32
    assert bytes_per_token_head(torch.bfloat16, 128) == 256
    assert bytes_per_token_head(torch.float8_e4m3fn, 128) == 132  # 1.9x fewer than bfloat16
