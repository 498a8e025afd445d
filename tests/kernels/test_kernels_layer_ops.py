"""The C++ layer ops (`cpu_layer_ops`) and the Triton ones (`triton_layer_ops`, interpreted
on the CPU, compiled on CUDA) against the eager ones (`layer_ops`): the residual add and the
rotary embedding give torch's bits, the activations lie within one rounding of the dtype,
the norm within its reduction-order error; strided inputs (q and k as a view of the fused
q/k/v rows) and row counts that split over threads included, and no kernel falls back to
the eager ops on these inputs. Also: the C++ extensions' parallel loops really run on
torch's threads."""

import pytest
import torch
from pagefleet_kernels import cpu_attention, cpu_layer_ops, layer_ops, triton_layer_ops

from tests.kernels.conftest import requires_cuda

needs_compiler = pytest.mark.skipif(
    not cpu_layer_ops.available(), reason="no C++ compiler: the engine uses the torch ops"
)
IMPLEMENTATIONS = {"cpu": cpu_layer_ops, "triton": triton_layer_ops}
DEVICES = {"cpu": "cpu", "triton": triton_layer_ops.KERNEL_DEVICE}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rows, row size): a decode row, a few rows of an odd size, enough rows to split over the
# C++ ops' threads (the Triton interpreter runs one program at a time: fewer rows there).
SHAPES = {
    "cpu": [(1, 576), (5, 100), (300, 576)],
    "triton": [(1, 576), (5, 100), (33, 576)],
}
ROPE_TOKENS = {"cpu": [1, 7, 300], "triton": [1, 7]}


def cases(values: dict[str, list]) -> list:
    """(implementation name, value) for each implementation's values."""
    return [
        pytest.param(name, value, id=f"{name}-{value}", marks=[needs_compiler] * (name == "cpu"))
        for name, name_values in values.items()
        for value in name_values
    ]


class NoEagerOps:
    """Stands in for `layer_ops` inside an implementation under test: a fallback to the
    eager ops fails the test instead of passing it with the eager ops' own bits."""

    def __getattr__(self, name):
        raise AssertionError(f"fell back to the eager layer_ops.{name}")


def kernels_of(name: str, monkeypatch):
    ops = IMPLEMENTATIONS[name]
    monkeypatch.setattr(ops, "layer_ops", NoEagerOps())
    return ops


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


def rows(shape, dtype, seed: int, scale: float = 1.0, device="cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(dtype).to(device)


def norm_weight(size: int, dtype, device="cpu") -> torch.Tensor:
    return (torch.rand(size, generator=torch.Generator().manual_seed(2)) + 0.5).to(dtype).to(device)


def rope_tables(tokens: int, head_dim: int, dtype, device="cpu"):
    """cos and sin (tokens, head_dim) of random angles, sin's first half negated (what the
    model's _rope hands the op)."""
    angles = torch.rand(tokens, head_dim, generator=torch.Generator().manual_seed(4)) * 6.0
    sin = angles.sin()
    sin[:, : head_dim // 2] = -sin[:, : head_dim // 2]
    return angles.cos().to(dtype).to(device), sin.to(dtype).to(device)


@pytest.mark.parametrize("unit_offset", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("name", "shape"), cases(SHAPES))
def test_rms_norm_and_residual_add(name, shape, dtype, unit_offset, monkeypatch):
    device = DEVICES[name]
    x, h = rows(shape, dtype, 0, 3.0, device), rows(shape, dtype, 1, device=device)
    weight = norm_weight(shape[1], dtype, device)
    ops = kernels_of(name, monkeypatch)
    assert_within_ulps(
        ops.rms_norm(x, weight, 1e-6, unit_offset),
        layer_ops.rms_norm(x, weight, 1e-6, unit_offset),
        NORM_ULPS,
    )
    total, normed = ops.add_rms_norm(x, h, weight, 1e-6, unit_offset)
    expected_total, expected_normed = layer_ops.add_rms_norm(x, h, weight, 1e-6, unit_offset)
    assert torch.equal(total, expected_total)  # one rounding of a sum: torch's bits
    assert_within_ulps(normed, expected_normed, NORM_ULPS)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_norm_of_q_and_k_heads_as_views(dtype, monkeypatch):
    """Qwen3's and Gemma 3's per-head q/k norms: (T, H, D) views of the fused q/k/v rows,
    each (token, head) row normed on its own."""
    device = DEVICES["triton"]
    qkv = rows((3, 15 * 64), dtype, 3, 3.0, device)
    q = qkv[:, : 9 * 64].view(3, 9, 64)
    weight = norm_weight(64, dtype, device)
    actual = kernels_of("triton", monkeypatch).rms_norm(q, weight, 1e-6)
    assert actual.shape == q.shape and actual.is_contiguous()
    assert_within_ulps(actual, layer_ops.rms_norm(q, weight, 1e-6), NORM_ULPS)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("name", "tokens"), cases(ROPE_TOKENS))
def test_rope_of_q_and_k_as_a_view_of_the_fused_rows(name, tokens, dtype, monkeypatch):
    device = DEVICES[name]
    # SmolLM2's layout: 9 q heads and 3 k heads of 64, then 3 v heads, in one row.
    qkv = rows((tokens, 15 * 64), dtype, 3, device=device)
    qk = qkv[:, : 12 * 64].view(tokens, 12, 64)
    cos, sin = rope_tables(tokens, 64, dtype, device)
    actual = kernels_of(name, monkeypatch).rope(qk, cos, sin)
    assert actual.is_contiguous()
    assert torch.equal(actual, layer_ops.rope(qk, cos, sin))  # every rounding torch's


@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("name", "shape"), cases(SHAPES))
def test_activation_times_up(name, shape, dtype, gelu, monkeypatch):
    """Against the eager op evaluated in float64: torch's own float32 GELU loses its small
    negative values to the cancellation in 1 + tanh(y) (hundreds of ulps; the kernels
    compute 2e / (1 + e) there instead)."""
    gate_up = rows((shape[0], 2 * shape[1]), dtype, 5, 8.0)
    gate_up[0, :3] = torch.tensor([-100.0, -40.0, 40.0])  # exp(-g) past float32's range
    gate_up = gate_up.to(DEVICES[name])
    actual = kernels_of(name, monkeypatch).act_and_mul(gate_up, gelu)
    assert actual.shape == (shape[0], shape[1])
    assert_within_ulps(actual, layer_ops.act_and_mul(gate_up.double(), gelu), ACTIVATION_ULPS)


@needs_compiler
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


def random_int4_parts(parts: int, outputs: int, inputs: int, group: int, generator):
    """`parts` random 4-bit matrices: nibbles (outputs, inputs / 2) and PyTorch's scales and
    zeros (inputs / group, outputs, 2)."""
    nibbles = [
        torch.randint(0, 256, (outputs, inputs // 2), dtype=torch.uint8, generator=generator)
        for _ in range(parts)
    ]
    scales_and_zeros = [
        torch.randn(inputs // group, outputs, 2, generator=generator) for _ in range(parts)
    ]
    return nibbles, scales_and_zeros


@needs_compiler
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 13])  # whole and partial blocks of 4 rows
@pytest.mark.parametrize("parts", [1, 2])  # a 4-bit matrix, a Q8_0 one as two 4-bit parts
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int4_matmul_equals_dequantize_then_matmul(dtype, parts, rows):
    """The C++ 4-bit matmul (float32 rows, where torch's int4 kernel is slow) against the
    dequantized matrix times x, in float64: the same weights, float32 sums. 200 outputs:
    three tiles of 64 and a partial one."""
    generator = torch.Generator().manual_seed(rows * parts)
    outputs, inputs, group = 200, 192, 32
    nibbles, scales_and_zeros = random_int4_parts(parts, outputs, inputs, group, generator)
    x = torch.randn(rows, inputs, generator=generator).to(dtype)
    shifts = [cpu_layer_ops.scales_and_shifts(sz) for sz in scales_and_zeros]
    assert shifts[0].shape == (outputs, inputs // group, 2)
    actual = cpu_layer_ops.int4_matmul(x, nibbles, shifts, group)
    assert actual.shape == (rows, outputs) and actual.dtype == dtype
    weight = layer_ops.dequantize_int4(nibbles, scales_and_zeros, group).double()
    expected = x.double() @ weight.T
    error = (actual.double() - expected).abs().max() / expected.abs().max()
    assert error < (1e-6 if dtype == torch.float32 else 4e-3)  # float32 sums; bf16's rounding
    # A row on its own gets what it gets among others (no cross-row mixing in a block).
    torch.testing.assert_close(
        cpu_layer_ops.int4_matmul(x[-1:].contiguous(), nibbles, shifts, group),
        actual[-1:],
    )
    with pytest.raises(RuntimeError, match="groups of 32"):
        cpu_layer_ops.int4_matmul(x[:, :128].contiguous(), nibbles, shifts, 64)
    with pytest.raises(RuntimeError, match=r"\(N, K / group, 2\)"):  # PyTorch's layout
        cpu_layer_ops.int4_matmul(x, nibbles, scales_and_zeros, group)


@needs_compiler
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 13])
@pytest.mark.parametrize("parts", [1, 2])
def test_int4_matmul_of_int8_activations_equals_the_rounded_product(parts, rows):
    """With int8_activations the C++ 4-bit matmul rounds x to int8 per 32 inputs and
    multiplies the codes with integer dot products: x^ W^T in float64 up to float32 sums
    (x^ from the eager rounding), a row alone the same bits as among others. The codes
    reach +-127 and groups have different scales (a zero group too)."""
    generator = torch.Generator().manual_seed(rows * parts + 7)
    outputs, inputs, group = 200, 192, 32
    nibbles, scales_and_zeros = random_int4_parts(parts, outputs, inputs, group, generator)
    x = torch.randn(rows, inputs, generator=generator) * torch.logspace(-2, 2, inputs)
    x[0, 32:64] = 0
    shifts = [cpu_layer_ops.scales_and_shifts(sz) for sz in scales_and_zeros]
    actual = cpu_layer_ops.int4_matmul(x, nibbles, shifts, group, True)
    weight = layer_ops.dequantize_int4(nibbles, scales_and_zeros, group).double()
    expected = layer_ops.quantize_activations_int8(x).double() @ weight.T
    error = (actual.double() - expected).abs().max() / expected.abs().max()
    assert error < 1e-6
    unrounded = x.double() @ weight.T
    assert (actual.double() - unrounded).abs().max() / unrounded.abs().max() > 1e-4
    torch.testing.assert_close(
        cpu_layer_ops.int4_matmul(x[-1:].contiguous(), nibbles, shifts, group, True),
        actual[-1:],
        atol=0,
        rtol=0,
    )


@needs_compiler
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 13])
@pytest.mark.parametrize("int8_activations", [False, True])
def test_int8_matmul_of_q8_0_codes_equals_the_product_in_float64(int8_activations, rows):
    """The C++ matmul of int8 codes with a scale per 32 inputs (GGUF's Q8_0) against the
    float64 product with x (or x^, with int8 activations), codes at -128 and 127 included;
    a row alone the same bits as among others; a wrong layout refused."""
    generator = torch.Generator().manual_seed(rows + 11 * int8_activations)
    outputs, inputs, group = 200, 192, 32
    codes = torch.randint(-128, 128, (outputs, inputs), dtype=torch.int8, generator=generator)
    codes[0, :2] = torch.tensor([-128, 127], dtype=torch.int8)
    scales = torch.rand(outputs, inputs // group, generator=generator)
    x = torch.randn(rows, inputs, generator=generator) * torch.logspace(-2, 2, inputs)
    actual = cpu_layer_ops.int8_matmul(x, codes, scales, group, int8_activations)
    weight = (codes.double() * scales.double().repeat_interleave(group, dim=1)).T
    rounded = layer_ops.quantize_activations_int8(x) if int8_activations else x
    expected = rounded.double() @ weight
    assert (actual.double() - expected).abs().max() / expected.abs().max() < 1e-6
    torch.testing.assert_close(
        cpu_layer_ops.int8_matmul(x[-1:].contiguous(), codes, scales, group, int8_activations),
        actual[-1:],
        atol=0,
        rtol=0,
    )
    with pytest.raises(RuntimeError, match=r"\(N, K / group\)"):
        cpu_layer_ops.int8_matmul(x, codes, scales.T.contiguous(), group)


@needs_compiler
def test_int8_rounding_of_activations_is_the_eager_ops_bits():
    """The C++ rounding (used where a wide batch multiplies the dequantized matrix) gives
    the eager ops' bits: ties to even (2.5 -> 2, -3.5 -> -4 at scale 1), a zero group stays
    zero, codes within +-127 of one scale per 32 inputs."""
    x = torch.randn(37, 576, generator=torch.Generator().manual_seed(3)) * 5
    x[1, :32] = 0
    x[2, :4] = torch.tensor([127.0, 2.5, -3.5, 0.5])
    x[2, 4:32] = 0
    got = cpu_layer_ops.quantize_activations_int8(x)
    assert torch.equal(got, layer_ops.quantize_activations_int8(x))
    assert got[2, :4].tolist() == [127.0, 2.0, -4.0, 0.0] and not got[1, :32].any()
    groups = got.view(37, -1, 32)
    scale = x.view(37, -1, 32).abs().amax(-1, keepdim=True) / 127
    codes = torch.where(scale != 0, groups / scale, 0)
    assert (codes - codes.round()).abs().max() < 1e-4 and codes.abs().max() < 127.001


@needs_compiler
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 8, 9])  # blocks of 1-4 rows, and several
@pytest.mark.parametrize(("outputs", "inputs"), [(77, 576), (64, 1536), (19, 20)])
def test_linear_equals_the_product_in_float64(rows, outputs, inputs):
    """The C++ few-row float32 matmul against x @ W^T in float64: outputs in whole and partial
    tiles and blocks (77 = 2 tiles of 32 + 13), inputs a multiple of 8 or not (20); strided
    rows of x. Other dtypes are refused (None), for the caller to multiply another way."""
    generator = torch.Generator().manual_seed(rows * outputs)
    weight = torch.randn(outputs, inputs, generator=generator)
    x = torch.randn(rows, inputs + 3, generator=generator)[:, :inputs]
    got = cpu_layer_ops.linear(x, weight)
    expected = x.double() @ weight.double().T
    assert got.shape == (rows, outputs) and got.dtype == torch.float32
    if rows:
        assert (got.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    # A row gets the same bits alone as among others.
    if rows > 1:
        assert torch.equal(cpu_layer_ops.linear(x[-1:], weight), got[-1:])
    assert cpu_layer_ops.linear(x.to(torch.bfloat16), weight.to(torch.bfloat16)) is None


@pytest.mark.parametrize("name", [pytest.param("cpu", marks=needs_compiler), "triton"])
def test_layer_ops_fall_back_to_torch_for_what_the_kernels_do_not_take(name):
    """Float64 (no kernel instantiation) takes the eager ops rather than failing: their
    bits, where a float32 computation would round differently."""
    ops, device = IMPLEMENTATIONS[name], DEVICES[name]
    x = rows((3, 64), torch.float64, 6, device=device)
    weight = torch.ones(64, dtype=torch.float64, device=device)
    assert torch.equal(ops.rms_norm(x, weight, 1e-6), layer_ops.rms_norm(x, weight, 1e-6))
    gate_up = rows((3, 128), torch.float64, 7, device=device)
    assert torch.equal(ops.act_and_mul(gate_up), layer_ops.act_and_mul(gate_up))


@needs_compiler
def test_cpu_norm_of_heads_falls_back_to_torch():
    """A norm over (T, H, D) (q/k norms) takes the eager ops."""
    x = rows((3, 4, 64), torch.float32, 6)
    weight = torch.ones(64)
    assert torch.equal(cpu_layer_ops.rms_norm(x, weight, 1e-6), layer_ops.rms_norm(x, weight, 1e-6))


def test_triton_layer_ops_fall_back_to_torch_for_mixed_dtypes_and_other_devices(monkeypatch):
    """A float32 weight on bfloat16 rows promotes the eager norm's result to float32, which
    the kernel does not compute; tensors off the kernels' device never reach a launch."""
    device = DEVICES["triton"]
    x = rows((2, 64), torch.bfloat16, 8, device=device)
    weight = norm_weight(64, torch.float32, device)
    normed = triton_layer_ops.rms_norm(x, weight, 1e-6)
    assert normed.dtype == torch.float32
    assert torch.equal(normed, layer_ops.rms_norm(x, weight, 1e-6))
    monkeypatch.setattr(triton_layer_ops, "KERNEL_DEVICE", "elsewhere")
    for kernel in ("_rms_norm_kernel", "_rope_kernel", "_act_and_mul_kernel"):
        monkeypatch.setattr(triton_layer_ops, kernel, None)  # a launch would fail
    total, _ = triton_layer_ops.add_rms_norm(x, x, x[0], 1e-6)
    assert torch.equal(total, x + x)
    cos, sin = rope_tables(2, 64, torch.bfloat16, device)
    qk = x.view(2, 1, 64)
    assert torch.equal(triton_layer_ops.rope(qk, cos, sin), layer_ops.rope(qk, cos, sin))
    assert torch.equal(triton_layer_ops.act_and_mul(x), layer_ops.act_and_mul(x))


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


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_triton_layer_ops_compiled_on_cuda_equal_the_eager_ones(dtype, monkeypatch):
    """One Llama-3-8B layer's ops at a prefill chunk of 300 tokens, compiled: hidden 4096,
    32 q and 8 k heads of 128 in the fused q/k/v rows, intermediate 14336."""
    tokens, hidden, intermediate = 300, 4096, 14336
    x = rows((tokens, hidden), dtype, 0, 3.0, "cuda")
    h = rows((tokens, hidden), dtype, 1, device="cuda")
    weight = norm_weight(hidden, dtype, "cuda")
    qkv = rows((tokens, (32 + 16) * 128), dtype, 3, device="cuda")
    qk = qkv[:, : 40 * 128].view(tokens, 40, 128)
    cos, sin = rope_tables(tokens, 128, dtype, "cuda")
    gate_up = rows((tokens, 2 * intermediate), dtype, 5, 8.0, "cuda")
    ops = kernels_of("triton", monkeypatch)
    for unit_offset in (False, True):
        total, normed = ops.add_rms_norm(x, h, weight, 1e-5, unit_offset)
        expected_total, expected_normed = layer_ops.add_rms_norm(x, h, weight, 1e-5, unit_offset)
        assert torch.equal(total, expected_total)
        assert_within_ulps(normed, expected_normed, NORM_ULPS)
        assert_within_ulps(
            ops.rms_norm(x, weight, 1e-5, unit_offset),
            layer_ops.rms_norm(x, weight, 1e-5, unit_offset),
            NORM_ULPS,
        )
    assert torch.equal(ops.rope(qk, cos, sin), layer_ops.rope(qk, cos, sin))
    for gelu in (False, True):
        assert_within_ulps(
            ops.act_and_mul(gate_up, gelu),
            layer_ops.act_and_mul(gate_up.double(), gelu),
            ACTIVATION_ULPS,
        )
