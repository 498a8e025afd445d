"""The C++ layer ops (`cpu_layer_ops`) against the eager ones (`layer_ops`): the residual
add, the rotary embedding and the activations give torch's bits or lie within one rounding
of the dtype, the norm within its reduction-order error; strided inputs (q and k as a view
of the fused q/k/v rows) and row counts that split over threads included. Also: the C++
extensions' parallel loops really run on torch's threads."""

import pytest
import torch
from pagefleet_kernels import cpu_attention, cpu_layer_ops, layer_ops

pytestmark = pytest.mark.skipif(
    not cpu_layer_ops.available(), reason="no C++ compiler: the engine uses the torch ops"
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rows, row size): a decode row, a few rows of an odd size, enough rows to split over threads.
SHAPES = [(1, 576), (5, 100), (300, 576)]


def assert_within_ulps(actual: torch.Tensor, expected: torch.Tensor, ulps: dict) -> None:
    """Within `ulps[dtype]` units in the last place of `actual`'s dtype, or within a
    hundredth of its epsilon absolute: next to activations of order one, a smaller value is
    an underflow, kept by one side and flushed to zero by the other."""
    eps = torch.finfo(actual.dtype).eps
    torch.testing.assert_close(
        actual, expected.to(actual.dtype), rtol=ulps[actual.dtype] * eps, atol=eps / 100
    )


# The norm's float32 sum of squares is added in another order than torch's: a few float32
# roundings on the scale, which in bfloat16/float16 can flip the rounding of the normed
# value and then of its product with the weight.
NORM_ULPS = {torch.float32: 16, torch.bfloat16: 2, torch.float16: 2}
# The activation's float32 value (an exp with ~1e-7 relative error, a division; GELU's exp
# also scales the rounding of its argument by |2y|), rounded, times up, rounded.
ACTIVATION_ULPS = {torch.float32: 16, torch.bfloat16: 2, torch.float16: 2}


def rows(shape, dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(dtype)


@pytest.mark.parametrize("unit_offset", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_and_residual_add(dtype, shape, unit_offset):
    x, h = rows(shape, dtype, 0, 3.0), rows(shape, dtype, 1)
    weight = (torch.rand(shape[1], generator=torch.Generator().manual_seed(2)) + 0.5).to(dtype)
    assert_within_ulps(
        cpu_layer_ops.rms_norm(x, weight, 1e-6, unit_offset),
        layer_ops.rms_norm(x, weight, 1e-6, unit_offset),
        NORM_ULPS,
    )
    total, normed = cpu_layer_ops.add_rms_norm(x, h, weight, 1e-6, unit_offset)
    expected_total, expected_normed = layer_ops.add_rms_norm(x, h, weight, 1e-6, unit_offset)
    assert torch.equal(total, expected_total)  # one rounding of a sum: torch's bits
    assert_within_ulps(normed, expected_normed, NORM_ULPS)


@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_of_q_and_k_as_a_view_of_the_fused_rows(dtype, tokens):
    # SmolLM2's layout: 9 q heads and 3 k heads of 64, then 3 v heads, in one row.
    qkv = rows((tokens, 15 * 64), dtype, 3)
    qk = qkv[:, : 12 * 64].view(tokens, 12, 64)
    angles = torch.rand(tokens, 64, generator=torch.Generator().manual_seed(4)) * 6.0
    sin = angles.sin()
    sin[:, :32] = -sin[:, :32]  # what the model's _rope hands the op
    cos, sin = angles.cos().to(dtype), sin.to(dtype)
    actual = cpu_layer_ops.rope(qk, cos, sin)
    assert actual.is_contiguous()
    assert torch.equal(actual, layer_ops.rope(qk, cos, sin))  # every rounding torch's


@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu_tanh"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_activation_times_up(dtype, shape, gelu):
    """Against the eager op evaluated in float64: torch's own float32 GELU loses its small
    negative values to the cancellation in 1 + tanh(y) (hundreds of ulps; the kernel
    computes 2e / (1 + e) there instead)."""
    gate_up = rows((shape[0], 2 * shape[1]), dtype, 5, 8.0)
    gate_up[0, :3] = torch.tensor([-100.0, -40.0, 40.0])  # exp(-g) past float32's range
    actual = cpu_layer_ops.act_and_mul(gate_up, gelu)
    assert actual.shape == (shape[0], shape[1])
    assert_within_ulps(actual, layer_ops.act_and_mul(gate_up.double(), gelu), ACTIVATION_ULPS)


@pytest.mark.parametrize("group", [32, 64])  # GGUF's groups (a compiled special case), another
@pytest.mark.parametrize("parts", [1, 2])  # a 4-bit matrix, a Q8_0 one as two 4-bit parts
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dequantize_int4(dtype, parts, group):
    generator = torch.Generator().manual_seed(group + parts)
    rows, inputs = 96, 256
    nibbles = [
        torch.randint(0, 256, (rows, inputs // 2), dtype=torch.uint8, generator=generator)
        for _ in range(parts)
    ]
    scales_and_zeros = [
        torch.randn(inputs // group, rows, 2, generator=generator).to(dtype) for _ in range(parts)
    ]
    actual = cpu_layer_ops.dequantize_int4(nibbles, scales_and_zeros, group)
    assert actual.shape == (rows, inputs) and actual.dtype == dtype
    # The same float32 operations in the same order, one rounding: torch's bits.
    assert torch.equal(actual, layer_ops.dequantize_int4(nibbles, scales_and_zeros, group))
    # One weight by hand: input 3 of group 1 (low nibble of byte 3) and input 3 + group / 2
    # of group 1 (its high nibble), row 5.
    byte = int(nibbles[0][5, group // 2 + 3])
    scale, zero = scales_and_zeros[0][1, 5].float()  # float32, as the kernel computes
    if parts == 1:
        for code, column in ((byte & 0x0F, group + 3), (byte >> 4, group + group // 2 + 3)):
            assert actual[5, column] == ((code - 8.0) * scale + zero).to(dtype)


def test_layer_ops_fall_back_to_torch_for_what_the_kernels_do_not_take():
    """Float64 (no C++ instantiation) and a norm over (T, H, D) (q/k norms) take the eager
    ops rather than failing."""
    x = rows((3, 4, 64), torch.float64, 6)
    weight = torch.ones(64, dtype=torch.float64)
    assert torch.equal(cpu_layer_ops.rms_norm(x, weight, 1e-6), layer_ops.rms_norm(x, weight, 1e-6))
    gate_up = rows((3, 128), torch.float64, 7)
    assert torch.equal(cpu_layer_ops.act_and_mul(gate_up), layer_ops.act_and_mul(gate_up))


@pytest.mark.parametrize(
    "extension",
    [cpu_attention._extension, cpu_layer_ops._extension],
    ids=["attention", "layer_ops"],
)
def test_extension_loops_run_on_torchs_threads(extension):
    """ATen's parallel_for is a header template that runs serially unless the extension is
    built with OpenMP; the attention kernel was, for a while, one thread whatever
    torch.set_num_threads said."""
    if extension() is None:
        pytest.skip("no C++ compiler")
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert extension().parallel_threads() == 2
    finally:
        torch.set_num_threads(previous)
