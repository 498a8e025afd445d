"""A quantized KV cache read back as bfloat16 is rounded once: code x scale computed in
float32 (exact for these values), then rounded to bfloat16. Rounding the scale (or the
codes' product) to bfloat16 first moves values by up to an ulp, which the attention
tolerances would hide; this is the exact check."""

import pytest
import torch
from pagefleet_kernels import torch_attention


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
def test_dequantize_to_bfloat16_rounds_the_exact_product_once(cache_dtype):
    generator = torch.Generator().manual_seed(0)
    # Scales with 12 significant bits (float32 holds them, bfloat16 does not) and codes of
    # at most 8: every product is exact in float64 and in float32.
    mantissas = 1 + torch.randint(1, 2**11, (64, 4), generator=generator) / 2**11
    scale = torch.ldexp(mantissas, torch.randint(-12, -2, (64, 4), generator=generator))
    values = torch.randint(-127, 128, (64, 4, 16), generator=generator).float()
    codes = values.to(cache_dtype)
    exact = codes.double() * scale.double()[..., None]
    assert torch.equal(exact.float().double(), exact)  # float32 holds the products
    got = torch_attention.dequantize_kv(codes, scale.float(), torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, exact.to(torch.bfloat16))
    twice = codes.to(torch.bfloat16) * scale.to(torch.bfloat16)[..., None]
    assert not torch.equal(twice, exact.to(torch.bfloat16))  # the check tells them apart
