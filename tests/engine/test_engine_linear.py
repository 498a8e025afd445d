"""Linear layers prepacked for oneDNN on the CPU: the same products as `F.linear` (bitwise in
bfloat16, where both run oneDNN's kernel; within rounding in float32, where F.linear runs
MKL's), for every batch size, with and without bias, on strided rows; and the engine packs
exactly the weights it owns."""

import pytest
import torch
import torch.nn.functional as F
from pagefleet_kernels import cpu_layer_ops
from pagefleet_kernels.backend import cpu_backend, torch_backend
from pagefleet_serve.model.layers.linear import LinearBase, ReplicatedLinear
from pagefleet_serve.model.layers.linear_methods import (
    FEW_ROWS_NATIVE,
    PrepackedLinear,
    can_prepack,
)


def Linear(in_features: int, out_features: int, bias: bool = False) -> ReplicatedLinear:
    """A float layer with nn.Linear's random initialisation."""
    layer = ReplicatedLinear(in_features, out_features, bias=bias)
    reference = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(reference.weight)
        if bias:
            layer.bias.copy_(reference.bias)
    return layer


pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this PyTorch has no oneDNN"
)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("rows", [0, 1, 5, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_prepacked_linear_equals_f_linear(dtype, rows, bias):
    if not can_prepack(dtype):
        pytest.skip(f"oneDNN cannot prepack {dtype} on this CPU (AVX2 only)")
    torch.manual_seed(rows)
    linear = Linear(576, 960, bias=bias).to(dtype)
    weight = linear.weight.detach().clone()
    bias_value = None if linear.bias is None else linear.bias.detach().clone()
    x = torch.randn(rows, 1000, dtype=dtype)[:, :576]  # rows 1000 apart: not contiguous
    linear = PrepackedLinear(linear, torch_backend())
    assert linear.weight is None  # the unpacked copy is released
    got = linear(x)
    expected = F.linear(x, weight, bias_value)
    assert got.shape == (rows, 960)
    if dtype == torch.bfloat16:
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_layer_ops.available(), reason="no C++ compiler")
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_few_float32_rows_go_to_the_backends_kernel_and_more_to_onednn(bias):
    """Prepacked with the C++ CPU ops, a float32 layer keeps its weight as it lies for the
    ops' `linear`: up to FEW_ROWS_NATIVE rows get exactly that kernel's product (plus the
    bias), more rows oneDNN's; both within float32 rounding of F.linear."""
    torch.manual_seed(1)
    linear = Linear(576, 960, bias=bias)
    weight = linear.weight.detach().clone()
    bias_value = None if linear.bias is None else linear.bias.detach().clone()
    linear = PrepackedLinear(linear, cpu_backend())
    assert linear.packed_weight is not None and torch.equal(linear.weight, weight)
    for rows in (1, 3, FEW_ROWS_NATIVE, FEW_ROWS_NATIVE + 1, 64):
        x = torch.randn(rows, 1000)[:, :576]
        got = linear(x)
        torch.testing.assert_close(got, F.linear(x, weight, bias_value), rtol=1e-5, atol=1e-5)
        native = cpu_layer_ops.linear(x, weight)
        native = native if bias_value is None else native + bias_value
        assert torch.equal(got, native) == (rows <= FEW_ROWS_NATIVE)
    # bfloat16 weights are not kept twice: the kernel takes float32 only.
    if can_prepack(torch.bfloat16):
        half = PrepackedLinear(Linear(64, 32).to(torch.bfloat16), cpu_backend())
        assert half.weight is None and half.few_rows is None


def test_engine_prepacks_every_linear_layer(make_llm):
    """Every projection and the LM head; SmolLM2's head is its embedding, which keeps its
    own rows for lookups. A compiled model keeps plain weights: inductor cannot lower a
    weight it did not pack itself."""
    small = {"max_model_len": 256, "kv_cache_memory_bytes": 16 << 20}
    model = make_llm(**small).engine.runner.model
    for layer in model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        for linear in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj):
            method = linear.method
            assert isinstance(method, PrepackedLinear) and method.packed_weight is not None
    head = model.lm_head.method
    assert isinstance(head, PrepackedLinear) and head.packed_weight is not None
    assert model.embed_tokens.weight.shape == (model.config.vocab_size, model.config.hidden_size)
    compiled = make_llm(enforce_eager=False, **small).engine.runner.model
    assert not any(isinstance(m, PrepackedLinear) for m in compiled.modules())


def test_bfloat16_weights_are_packed_only_where_onednn_takes_them(make_llm):
    """On a CPU without AVX-512 (or AVX-NE-CONVERT) oneDNN refuses to prepack bfloat16
    weights: the engine starts anyway, with plain ones (it failed to start there before)."""
    model = make_llm(
        dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=16 << 20
    ).engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    packed = [isinstance(m.method, PrepackedLinear) for m in linears]
    assert packed and all(p == can_prepack(torch.bfloat16) for p in packed)
