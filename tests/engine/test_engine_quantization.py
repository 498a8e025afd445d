"""Weights kept quantized: GGUF Q4_0/Q4_1/Q8_0 and int8 weight-only.

The codes must stand for exactly the weights the `gguf` package dequantizes to; the packed
matmul must equal dequantize-then-matmul up to float32 summation order; and the built-in
model served with its own Q4_1 weights must generate greedily what the expanded model does.
"""

import gguf
import numpy as np
import pytest
import torch
from pagefleet_kernels import cpu_layer_ops, layer_ops
from pagefleet_kernels.backend import cpu_backend, torch_backend
from pagefleet_serve import SamplingParams
from pagefleet_serve.config import EngineConfig
from pagefleet_serve.model.layers.linear_methods import (
    DEQUANTIZE_ROWS,
    DEQUANTIZE_ROWS_FLOAT32,
    QuantizedLinear,
    quantized_linear,
)
from pagefleet_serve.model.loader.gguf_file import GGUFFile
from pagefleet_serve.model.loader.model_loader import load_model
from pagefleet_serve.model.loader.resolve import builtin_gguf_path
from pagefleet_serve.model.quant import dequantize_gguf, from_gguf, quantize_int8

GGUF_TYPES = ("Q4_0", "Q4_1", "Q8_0")


def gguf_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    weight = np.random.default_rng(seed).normal(0, 0.05, (rows, cols)).astype(np.float32)
    weight[:, :8] += 0.3  # a skewed group: Q4_1's minimum is not -max
    return gguf.quants.quantize(weight, getattr(gguf.GGMLQuantizationType, type_name))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    error = (actual - expected).detach().abs().max()
    return float(error / expected.detach().abs().max())


@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_gguf_codes_stand_for_the_dequantized_weights_exactly(type_name):
    blocks = gguf_blocks(type_name, 96, 256)
    expected = gguf.quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, type_name))
    weight = from_gguf(blocks, type_name)
    assert weight.shape == (96, 256)
    torch.testing.assert_close(weight.dequantize(), torch.from_numpy(expected), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_gguf_blocks_expand_into_any_dtype_bit_for_bit_as_the_gguf_package(type_name, dtype):
    """The loader's expansion of a float model's GGUF weights (dequantize_gguf) against
    gguf's own: every float32 bit, 2-D and stacked experts (3-D), then one rounding."""
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    for blocks in (gguf_blocks(type_name, 40, 96, seed=1), gguf_blocks(type_name, 3 * 8, 64)):
        if len(blocks) == 24:
            blocks = blocks.reshape(3, 8, -1)
        expected = torch.from_numpy(gguf.quants.dequantize(blocks, qtype)).to(dtype)
        out = torch.full(expected.shape, float("nan"), dtype=dtype)
        dequantize_gguf(blocks, type_name, out)
        assert torch.equal(bits(out), bits(expected))
    real = GGUFFile(builtin_gguf_path()).tensors  # the built-in model's Q4_1 matrices
    tensor = next(t for t in real if t.tensor_type.name == "Q4_1")
    expected = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type))
    out = torch.empty(expected.shape)
    dequantize_gguf(tensor.data, "Q4_1", out)
    assert torch.equal(bits(out), bits(expected))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("ops", ["torch", "cpu"])  # the float32 rows' matmul: torch's, C++
@pytest.mark.parametrize("type_name", GGUF_TYPES)
@pytest.mark.parametrize("rows", [1, 2, 7, 16, 64])
def test_quantized_matmul_equals_dequantize_then_matmul(type_name, rows, ops):
    if ops == "cpu" and not cpu_layer_ops.available():
        pytest.skip("no C++ compiler here")
    weight = from_gguf(gguf_blocks(type_name, 192, 576), type_name)
    bias = torch.randn(192)
    x = torch.randn(rows, 576)
    expected = x @ weight.dequantize().T + bias
    actual = quantized_linear(weight, bias, cpu_backend() if ops == "cpu" else torch_backend())(x)
    assert actual.shape == (rows, 192)
    assert relative_error(actual, expected) < 1e-5


@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_wide_batches_multiply_the_dequantized_matrix(type_name):
    """From DEQUANTIZE_ROWS rows on, the layer dequantizes its 4-bit parts and runs a float
    matmul: the nibbles and scales it keeps for that give the GGUF's weights exactly, and a
    wide batch gets what the same rows get a few at a time through the int4 kernel."""
    weight = from_gguf(gguf_blocks(type_name, 192, 576), type_name)
    layer = quantized_linear(weight, None, torch_backend())
    torch.testing.assert_close(layer.dequantized(), weight.dequantize(), atol=0, rtol=0)
    x = torch.randn(DEQUANTIZE_ROWS, 576)
    few_at_a_time = torch.cat([layer(x[i : i + 8]) for i in range(0, DEQUANTIZE_ROWS, 8)])
    assert relative_error(layer(x), few_at_a_time) < 1e-5


@pytest.mark.parametrize("ops", ["torch", "cpu"])  # torch: round x, then torch's matmuls
@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_int8_activations_multiply_the_rounded_rows_at_every_batch_size(type_name, ops):
    """With int8 activations a 4-bit layer computes x^ W^T, x^ being x rounded to int8 per
    32 inputs: through the C++ integer dot products at a few rows, through the dequantized
    matrix for a wide batch, through PyTorch's int4 matmul on the torch ops; each equals
    the float64 product of x^ and the GGUF's weights up to float32 sums, so a row gets the
    same product at any batch size. The rounding is really applied (x W^T differs)."""
    if ops == "cpu" and not cpu_layer_ops.available():
        pytest.skip("no C++ compiler here")
    weight = from_gguf(gguf_blocks(type_name, 192, 576), type_name)
    bias = torch.randn(192)
    layer = quantized_linear(weight, bias, cpu_backend() if ops == "cpu" else torch_backend())
    layer(torch.randn(2, 576))  # a product before, then int8 activations from here on
    layer.round_activations_to_int8()
    x = torch.randn(20, 576) * torch.linspace(0.1, 10, 576)  # groups of different scales
    rounded = layer_ops.quantize_activations_int8(x).double()
    expected = rounded @ weight.dequantize().double().T + bias.double()
    wide = layer(x)  # 20 rows: from DEQUANTIZE_ROWS_FLOAT32 on, the dequantized matrix
    assert relative_error(wide.double(), expected) < 1e-6
    for rows in (1, 3, 5):
        assert relative_error(layer(x[:rows]).double(), expected[:rows]) < 1e-6
    unrounded = x.double() @ weight.dequantize().double().T + bias.double()
    assert relative_error(wide.double(), unrounded) > 1e-4


def test_int8_activations_keep_the_builtin_model_close_to_its_expanded_weights():
    """The built-in model's 4-bit layers with int8 activations against the expanded
    weights: a fused layer, the down projection and the Q8_0 head within 2% (the rounding
    is under 0.4% of a group's largest value) but not exact, and the head's top tokens the
    same. A model without 4-bit weights is refused: the setting would change nothing."""
    models = {}
    for quantization in ("auto", "none"):
        loaded = load_model("builtin://smollm2-135m", torch.float32, quantization)
        models[quantization] = loaded.model
    with pytest.raises(ValueError, match="applies to 4-bit weights"):
        models["none"].use_int8_activations()
    model = models["auto"]
    assert model.use_int8_activations() == 30 * 4 + 1  # qkv, o, gate_up, down; the head
    generator = torch.Generator().manual_seed(0)
    for name in ("layers.5.self_attn.qkv_proj", "layers.5.mlp.down_proj", "lm_head"):
        layer = model.get_submodule(name)
        x = torch.randn(7, layer.in_features, generator=generator)
        got, exact = layer(x), models["none"].get_submodule(name)(x)
        assert 1e-5 < relative_error(got, exact) < 0.02, name
        if name == "lm_head":
            assert torch.equal(got.argmax(-1), exact.argmax(-1))


def test_real_q4_1_and_q8_0_tensors_of_the_builtin_model():
    reader = gguf.GGUFReader(str(builtin_gguf_path()))
    tensors = {t.name: t for t in reader.tensors}
    x = torch.randn(5, 576)
    for name, rows in (("blk.0.ffn_gate.weight", None), ("token_embd.weight", 512)):
        tensor = tensors[name]
        assert tensor.tensor_type.name in ("Q4_1", "Q8_0")
        data = tensor.data[:rows]
        expected = torch.from_numpy(gguf.quants.dequantize(data, tensor.tensor_type))
        weight = from_gguf(data, tensor.tensor_type.name)
        torch.testing.assert_close(weight.dequantize(), expected, atol=0, rtol=0)
        layer = quantized_linear(weight, None, torch_backend())
        assert relative_error(layer(x), x @ expected.T) < 1e-5


def test_int8_weight_only_matmul_and_its_rounding_error():
    weight = torch.randn(128, 64)
    quantized = quantize_int8(weight)
    assert quantized.codes.dtype == torch.int8 and quantized.scale.shape == (128, 1)
    # Round to nearest: at most half a step per weight.
    assert ((quantized.dequantize() - weight).abs() <= quantized.scale / 2 + 1e-7).all()
    x = torch.randn(3, 64)
    layer = quantized_linear(quantized, None, torch_backend())
    assert relative_error(layer(x), x @ quantized.dequantize().T) < 1e-5


def test_fused_qkv_of_quantized_weights_matches_the_expanded_model():
    quantized = load_model("builtin://smollm2-135m", torch.float32, "auto")
    expanded = load_model("builtin://smollm2-135m", torch.float32, "none")
    layers = {}
    for name, loaded in (("auto", quantized), ("none", expanded)):
        layers[name] = loaded.model
    assert isinstance(layers["auto"].layers[0].self_attn.qkv_proj.method, QuantizedLinear)
    assert isinstance(layers["auto"].lm_head.method, QuantizedLinear)  # tied Q8_0 head: 2 x int4
    assert not isinstance(layers["none"].lm_head.method, QuantizedLinear)
    torch.testing.assert_close(
        layers["auto"].embed_tokens.weight, layers["none"].embed_tokens.weight, atol=0, rtol=0
    )
    x = torch.randn(4, 576)
    for module in ("layers.3.self_attn.qkv_proj", "layers.3.mlp.gate_up_proj", "lm_head"):
        got = layers["auto"].get_submodule(module)(x)
        expected = layers["none"].get_submodule(module)(x)
        assert relative_error(got, expected) < 1e-5, module


# Float32 activations: the 4-bit layers multiply through the C++ kernel (int4_matmul) where
# it builds, through PyTorch's int4 matmul otherwise.
def test_greedy_output_of_native_q4_1_equals_the_expanded_model(make_llm, chat_prompts):
    greedy = SamplingParams(max_tokens=32, temperature=0.0)
    outputs = {}
    for quantization in ("auto", "none"):
        llm = make_llm(
            quantization=quantization, max_model_len=512, kv_cache_memory_bytes=128 << 20
        )
        results = llm.generate(chat_prompts[:8], greedy)
        outputs[quantization] = [r.outputs[0].token_ids for r in results]
    assert outputs["auto"] == outputs["none"]


@pytest.mark.slow
def test_int8_generates_close_to_float32(make_llm, chat_prompts):
    """Requantized weights are not the same weights: most greedy outputs still agree."""
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    prompts = chat_prompts[:6]
    ours = make_llm(quantization="int8", max_model_len=512, kv_cache_memory_bytes=64 << 20)
    expanded = make_llm(quantization="none", max_model_len=512, kv_cache_memory_bytes=64 << 20)
    got = [r.outputs[0].token_ids for r in ours.generate(prompts, greedy)]
    expected = [r.outputs[0].token_ids for r in expanded.generate(prompts, greedy)]
    assert sum(g == e for g, e in zip(got, expected, strict=True)) >= 3


def test_quantization_setting_is_validated():
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="gptq")
    with pytest.raises(ValueError, match="activation_quantization must be one of"):
        EngineConfig(quantization="auto", activation_quantization="fp8")
    with pytest.raises(ValueError, match="which quantization 'auto' keeps"):
        EngineConfig(activation_quantization="int8")  # expanded weights: nothing to round for


def test_int8_activations_serve_the_builtin_model(make_llm, chat_prompts):
    """The engine with `activation_quantization="int8"` (CPU, float32): its greedy output
    stays close to the expanded model's (the rounding changes the arithmetic, so not
    token for token everywhere); bfloat16 activations are refused with the reason."""
    with pytest.raises(ValueError, match="float32 activations"):
        make_llm(quantization="auto", activation_quantization="int8", dtype="bfloat16")
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    outputs = {}
    for activations in ("int8", "none"):
        llm = make_llm(
            quantization="auto" if activations == "int8" else "none",
            activation_quantization=activations,
            max_model_len=512,
            # The expanded engine of the test above (same config): reused, not rebuilt.
            kv_cache_memory_bytes=128 << 20,
        )
        outputs[activations] = [r.outputs[0].token_ids for r in llm.generate(chat_prompts, greedy)]
    same = sum(a == b for a, b in zip(outputs["int8"], outputs["none"], strict=True))
    print(f"{same} of {len(chat_prompts)} greedy outputs the same")
    assert same >= len(chat_prompts) // 2


@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_the_fused_layers_binding_multiplies_as_the_layer_does(type_name):
    """`QuantizedLinear.fused_binding` (the C++ object the fused decoder layer multiplies
    with) gives the layer's own bits, bias included, with and without int8 activations."""
    if not cpu_layer_ops.available():
        pytest.skip("no C++ compiler here")
    layer = quantized_linear(
        from_gguf(gguf_blocks(type_name, 192, 576), type_name), torch.randn(192), cpu_backend()
    )
    x = torch.randn(3, 576)
    assert torch.equal(layer.fused_binding()(x), layer(x))
    layer.round_activations_to_int8()
    assert torch.equal(layer.fused_binding()(x), layer(x))
    weight = from_gguf(gguf_blocks(type_name, 16, 64), type_name)
    torch_ops = quantized_linear(weight, None, torch_backend())
    assert torch_ops.fused_binding() is None  # the torch ops have no C++ matmul


def test_fused_decoder_layers_compute_the_ops_bits():
    """The built-in model's layers with the C++ CPU ops: below DEQUANTIZE_ROWS_FLOAT32 rows
    each runs its work around attention as two C++ calls (its `fused.for_rows`), whose
    q, k, v and output are the bits of the ops called one by one, with float32 or int8
    activations; wide batches, bfloat16 and compiled layers go op by op."""
    if not cpu_layer_ops.available():
        pytest.skip("no C++ compiler here")
    model = load_model("builtin://smollm2-135m", torch.float32, "auto", backend=cpu_backend()).model
    generator = torch.Generator().manual_seed(0)
    for activations in ("float32", "int8"):
        if activations == "int8":
            model.use_int8_activations()
        for rows in (1, 5, DEQUANTIZE_ROWS_FLOAT32 - 1):
            x = torch.randn(rows, 576, generator=generator)
            cos, sin = torch.randn(2, rows, 64, generator=generator).unbind(0)
            attended = torch.randn(rows, 576, generator=generator)
            for layer in (model.layers[0], model.layers[17]):
                fused = layer.fused.for_rows(x)
                assert fused is not None
                for got, expected in zip(
                    fused.attention_inputs(x, cos, sin),
                    layer.attention_inputs(x, cos, sin),
                    strict=True,
                ):
                    assert got.shape == expected.shape and torch.equal(got, expected)
                got = fused.attention_outputs(x, attended)
                assert torch.equal(got, layer.attention_outputs(x, attended))
    assert model.layers[0].fused.for_rows(torch.randn(DEQUANTIZE_ROWS_FLOAT32, 576)) is None
    assert model.layers[0].fused.for_rows(torch.randn(1, 576, dtype=torch.bfloat16)) is None
    model.layers[1].compile_around_attention()  # compiled: inductor fuses the eager ops instead
    assert model.layers[1].fused is None
