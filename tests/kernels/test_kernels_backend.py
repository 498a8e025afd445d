"""The declared kernel backends (`pagefleet_kernels.backend.KernelBackend`): every
capability is a typed field, the optional ones None where absent; each backend declares
exactly what it provides (the C++ backend its matmuls and fused layer iff its layer-ops
extension builds, the torch and Triton backends none of those C++ kernels); and every
backend that declares an op passes the same parity test for it, against the torch backend
or a float64 product (the Triton kernels interpreted on the CPU without CUDA)."""

import dataclasses
import typing

import gguf
import numpy as np
import pytest
import torch
from pagefleet_kernels import (
    backend,
    cpu_attention,
    cpu_layer_ops,
    layer_ops,
    torch_attention,
    triton_attention,
    triton_layer_ops,
)
from pagefleet_kernels.backend import KernelBackend, cpu_backend, torch_backend, triton_backend
from pagefleet_kernels.metadata import AttentionMetadata

from tests.kernels.kernel_batches import (
    KERNEL_TOLERANCE,
    QUANTIZATION_TOLERANCE,
    make_batch,
    naive_attention,
)

OPTIONAL = ("linear", "int4_matmul", "int8_matmul", "fused_decoder_layer")
# Optional ops every backend declares today (each tested in its own file).
DECLARED_BY_EVERY_BACKEND = ("add_lora", "fused_moe")
LAYER_OPS = ("rms_norm", "add_rms_norm", "rope", "act_and_mul")
QUANTIZED_OPS = ("dequantize_int4", "quantize_activations_int8")
needs_compiler = pytest.mark.skipif(
    not cpu_attention.available(), reason="no C++ compiler: the engine uses the torch backend"
)
BACKENDS = {"torch": torch_backend, "cpu": cpu_backend, "triton": triton_backend}
DEVICES = {"torch": "cpu", "cpu": "cpu", "triton": triton_layer_ops.KERNEL_DEVICE}


def each_backend(names=tuple(BACKENDS)) -> list:
    return [pytest.param(n, id=n, marks=[needs_compiler] * (n == "cpu")) for n in names]


def declaring(op: str) -> list:
    """The backends that declare `op` (the C++ one only where it builds)."""
    declared = ["torch", "triton"]
    if cpu_attention.available():
        declared.append("cpu")
    return [n for n in declared if getattr(BACKENDS[n](), op) is not None]


def test_every_capability_is_a_typed_field_and_the_optional_ones_default_to_none():
    hints = typing.get_type_hints(KernelBackend)
    fields = dataclasses.fields(KernelBackend)
    assert all(f.name in hints for f in fields)
    optional = set(OPTIONAL) | set(DECLARED_BY_EVERY_BACKEND)
    assert {f.name for f in fields if f.default is None} == optional
    for name in optional:
        assert type(None) in typing.get_args(hints[name]), name
    with pytest.raises(dataclasses.FrozenInstanceError):
        torch_backend().linear = cpu_layer_ops.linear


def test_torch_backend_is_pytorch_end_to_end_with_no_native_kernels():
    ops = torch_backend()
    assert ops.name == "torch" and ops is torch_backend()  # built once
    attention = (ops.prepare, ops.write_kv_cache, ops.paged_attention)
    assert attention == (
        torch_attention.prepare,
        torch_attention.write_kv_cache,
        torch_attention.paged_attention,
    )
    for name in LAYER_OPS + QUANTIZED_OPS:
        assert getattr(ops, name) is getattr(layer_ops, name), name
    assert all(getattr(ops, name) is None for name in OPTIONAL)


def test_triton_backend_declares_its_kernels_and_no_cpu_ones():
    ops = triton_backend()
    assert ops.name == "triton"
    assert (ops.prepare, ops.paged_attention) == (
        triton_attention.prepare,
        triton_attention.paged_attention,
    )
    assert ops.write_kv_cache is triton_attention.write_kv_cache
    for name in LAYER_OPS:
        assert getattr(ops, name) is getattr(triton_layer_ops, name), name
    for name in QUANTIZED_OPS:  # once per matmul: the eager ops
        assert getattr(ops, name) is getattr(layer_ops, name), name
    assert all(getattr(ops, name) is None for name in OPTIONAL)


@needs_compiler
def test_cpu_backend_declares_its_native_kernels_iff_its_extension_builds(monkeypatch):
    ops = cpu_backend()
    assert ops.name == "cpu" and ops.paged_attention is cpu_attention.paged_attention
    for name in LAYER_OPS + QUANTIZED_OPS:  # falling back per call for what they do not take
        assert getattr(ops, name) is getattr(cpu_layer_ops, name), name
    native = cpu_layer_ops.available()
    assert all((getattr(ops, name) is not None) == native for name in OPTIONAL)
    if native:
        assert ops.linear is cpu_layer_ops.linear
        assert ops.int8_matmul is cpu_layer_ops.int8_matmul
        assert ops.int4_matmul.matmul is cpu_layer_ops.int4_matmul
        assert ops.int4_matmul.weight_layout is cpu_layer_ops.scales_and_shifts
        assert ops.fused_decoder_layer.bind_linear is cpu_layer_ops.quantized_linear
        assert ops.fused_decoder_layer.bind_layer is cpu_layer_ops.decoder_layer
    # Where the layer-ops extension does not build, none of its kernels is declared.
    monkeypatch.setattr(cpu_layer_ops, "available", lambda: False)
    without = backend.cpu_backend.__wrapped__()
    assert all(getattr(without, name) is None for name in OPTIONAL)
    assert without.rms_norm is cpu_layer_ops.rms_norm


# -- the same parity tests for every backend that declares the op --------------------------
@pytest.mark.parametrize("cache", ["auto", "int8"])
@pytest.mark.parametrize("name", each_backend())
def test_attention_writes_and_attends_as_the_torch_backend_does(name, cache):
    """prepare once, then write_kv_cache and paged_attention over a mixed batch (decodes and
    a prefill chunk, grouped-query heads): the cache holds the torch backend's bits, the
    output is the naive loop's within the kernels' tolerance (and the cache's error)."""
    device = DEVICES[name]
    ops = BACKENDS[name]()
    batch = make_batch([1, 1, 6], [17, 40, 9], 4, 2, cache=cache, device=device, seed=3)
    expected = (batch.key_cache, batch.value_cache, batch.key_scale, batch.value_scale)
    written = [None if t is None else torch.zeros_like(t) for t in expected]
    key_cache, value_cache, key_scale, value_scale = written
    ops.write_kv_cache(
        batch.key, batch.value, key_cache, value_cache, batch.slot_mapping, key_scale, value_scale
    )
    for got, want in zip(written, expected, strict=True):
        assert got is None or torch.equal(got.cpu(), want.cpu())
    metadata = AttentionMetadata(
        batch.slot_mapping,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        batch.query_lens,
        seq_lens_host=batch.seq_lens.tolist(),
        query_start_loc_host=batch.query_start_loc.tolist(),
    )
    ops.prepare(metadata, batch.key_cache.shape[1], {None})
    actual = batch.attention(ops, plan_cache=metadata.plan_cache).cpu()
    tolerance = (
        KERNEL_TOLERANCE[torch.float32] if cache == "auto" else QUANTIZATION_TOLERANCE[cache]
    )
    torch.testing.assert_close(actual, naive_attention(batch), atol=tolerance[0], rtol=tolerance[1])


def rows(shape, seed: int, device, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(device)


# The norm's float32 sum of squares in another order, an activation's exponential: within
# 16 units in the last place of float32 (test_kernels_layer_ops sweeps the dtypes).
ULPS = 16 * torch.finfo(torch.float32).eps


@pytest.mark.parametrize("name", each_backend())
def test_layer_ops_compute_the_torch_backends_values(name):
    device, ops, reference = DEVICES[name], BACKENDS[name](), torch_backend()
    x, h = rows((5, 576), 0, device, 3.0), rows((5, 576), 1, device)
    weight = rows((576,), 2, device).abs() + 0.5
    for unit_offset in (False, True):
        torch.testing.assert_close(
            ops.rms_norm(x, weight, 1e-6, unit_offset),
            reference.rms_norm(x, weight, 1e-6, unit_offset),
            rtol=ULPS,
            atol=1e-7,
        )
        total, normed = ops.add_rms_norm(x, h, weight, 1e-6, unit_offset)
        expected_total, expected_normed = reference.add_rms_norm(x, h, weight, 1e-6, unit_offset)
        assert torch.equal(total, expected_total)
        torch.testing.assert_close(normed, expected_normed, rtol=ULPS, atol=1e-7)
    qk = rows((3, 15 * 64), 3, device)[:, : 12 * 64].view(3, 12, 64)  # q and k of fused rows
    cos, sin = rows((3, 64), 4, device), rows((3, 64), 5, device)
    assert torch.equal(ops.rope(qk, cos, sin), reference.rope(qk, cos, sin))
    gate_up = rows((5, 2 * 576), 6, device, 4.0)
    for gelu in (False, True):
        # torch's float32 GELU loses small negative values to the cancellation in 1 + tanh
        # (up to ~1e-6 absolute here; the kernels compute them another way).
        expected = reference.act_and_mul(gate_up, gelu)
        torch.testing.assert_close(ops.act_and_mul(gate_up, gelu), expected, rtol=ULPS, atol=2e-6)


def int4_parts(parts: int, outputs: int, inputs: int, group: int, seed: int):
    """Random nibbles (N, K / 2) and PyTorch's scales and zeros (K / group, N, 2) per part."""
    generator = torch.Generator().manual_seed(seed)
    nibbles = [
        torch.randint(0, 256, (outputs, inputs // 2), dtype=torch.uint8, generator=generator)
        for _ in range(parts)
    ]
    scales_and_zeros = [
        torch.randn(inputs // group, outputs, 2, generator=generator) * 0.1 for _ in range(parts)
    ]
    return nibbles, scales_and_zeros


@pytest.mark.parametrize("name", each_backend())
def test_quantized_weights_ops_give_the_torch_backends_bits(name):
    """Every backend dequantizes 4-bit parts and rounds int8 activations to the eager
    ops' bits (the wide batches' path, and what int8 activations multiply)."""
    ops, reference = BACKENDS[name](), torch_backend()
    nibbles, scales_and_zeros = int4_parts(2, 96, 256, 32, 0)
    assert torch.equal(
        ops.dequantize_int4(nibbles, scales_and_zeros, 32),
        reference.dequantize_int4(nibbles, scales_and_zeros, 32),
    )
    x = rows((7, 256), 1, "cpu", 5.0)
    assert torch.equal(ops.quantize_activations_int8(x), reference.quantize_activations_int8(x))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("name", declaring("linear"))
def test_few_row_linear_is_the_product_in_float64(name):
    linear = BACKENDS[name]().linear
    weight = rows((200, 192), 0, "cpu")
    for count in (1, 3, 8):
        x = rows((count, 192), count, "cpu")
        assert relative_error(linear(x, weight), x.double() @ weight.double().T) < 1e-6
    assert linear(x.to(torch.bfloat16), weight.to(torch.bfloat16)) is None  # float32 only


@pytest.mark.parametrize("int8_activations", [False, True])
@pytest.mark.parametrize("name", declaring("int4_matmul"))
def test_int4_matmul_is_the_dequantized_product(name, int8_activations):
    """Parts in the backend's own layout times x (or x^) against the float64 product with
    the torch backend's dequantized matrix."""
    ops = BACKENDS[name]()
    nibbles, scales_and_zeros = int4_parts(2, 200, 192, 32, 1)
    layout = [ops.int4_matmul.weight_layout(sz) for sz in scales_and_zeros]
    weight = torch_backend().dequantize_int4(nibbles, scales_and_zeros, 32).double()
    x = rows((5, 192), 2, "cpu")
    actual = ops.int4_matmul.matmul(x, nibbles, layout, 32, int8_activations)
    rounded = layer_ops.quantize_activations_int8(x) if int8_activations else x
    assert relative_error(actual, rounded.double() @ weight.T) < 1e-6


@pytest.mark.parametrize("int8_activations", [False, True])
@pytest.mark.parametrize("name", declaring("int8_matmul"))
def test_int8_matmul_of_q8_0_codes_is_the_product_in_float64(name, int8_activations):
    generator = torch.Generator().manual_seed(3)
    codes = torch.randint(-128, 128, (200, 192), dtype=torch.int8, generator=generator)
    scales = torch.rand(200, 192 // 32, generator=generator)
    weight = codes.double() * scales.double().repeat_interleave(32, dim=1)
    x = rows((5, 192), 4, "cpu")
    actual = BACKENDS[name]().int8_matmul(x, codes, scales, 32, int8_activations)
    rounded = layer_ops.quantize_activations_int8(x) if int8_activations else x
    assert relative_error(actual, rounded.double() @ weight.T) < 1e-6


def q4_1_weight(rows_: int, cols: int, seed: int):
    from pagefleet_serve.model.quant import from_gguf

    weight = np.random.default_rng(seed).normal(0, 0.05, (rows_, cols)).astype(np.float32)
    return from_gguf(gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q4_1), "Q4_1")


@pytest.mark.parametrize("name", declaring("fused_decoder_layer"))
def test_fused_decoder_layer_computes_the_layers_ops_bits(name):
    """A decoder layer with 4-bit weights bound to the backend's fused layer: its two calls
    give the bits of the same backend's ops called one by one (qkv bias included)."""
    from pagefleet_serve.model.config import ModelConfig
    from pagefleet_serve.model.context import ModelContext, building
    from pagefleet_serve.model.layers.fused import bind_fused_layer
    from pagefleet_serve.model.layers.linear_methods import quantized_linear
    from pagefleet_serve.model.models.llama import LlamaDecoderLayer

    ops = BACKENDS[name]()
    config = ModelConfig(
        vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=32, qkv_bias=True,
    )  # fmt: skip
    with building(ModelContext(ops)):
        layer = LlamaDecoderLayer(config, 0)
    shapes = {
        "self_attn.qkv_proj": (256, 128),
        "self_attn.o_proj": (128, 128),
        "mlp.gate_up_proj": (512, 128),
        "mlp.down_proj": (128, 256),
    }
    for i, (path, shape) in enumerate(shapes.items()):
        bias = rows((shape[0],), i, "cpu") if path.endswith("qkv_proj") else None
        linear = quantized_linear(q4_1_weight(*shape, i), bias, ops)
        layer.get_submodule(path).use_method(linear)
    with torch.no_grad():
        layer.input_layernorm.weight.copy_(rows((128,), 8, "cpu").abs() + 0.5)
        layer.post_attention_layernorm.weight.copy_(rows((128,), 9, "cpu").abs() + 0.5)
    layer.fused = bind_fused_layer(layer, ops)
    x, attended = rows((3, 128), 10, "cpu"), rows((3, 128), 11, "cpu")
    cos, sin = rows((3, 32), 12, "cpu"), rows((3, 32), 13, "cpu")
    fused = layer.fused.for_rows(x)
    assert fused is not None
    with torch.inference_mode():
        for got, expected in zip(
            fused.attention_inputs(x, cos, sin), layer.attention_inputs(x, cos, sin), strict=True
        ):
            assert torch.equal(got, expected)
        got = fused.attention_outputs(x, attended)
        assert torch.equal(got, layer.attention_outputs(x, attended))
