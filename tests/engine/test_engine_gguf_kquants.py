"""GGUF K-quants (and IQ4) kept in the file's own blocks (issue 70): every block type
decodes bit for bit as the `gguf` package's reference dequantizer, the block layers
multiply what the dequantized matrix does at every batch size (the few-row kernels and the
wide-batch GEMM), dense and as a mixture's experts, and a Q4_K_M file (Q4_K with Q6_K, as
llama.cpp mixes them) serves the greedy tokens of its float32 expansion while holding
little more than the file's bytes."""

import gguf
import numpy as np
import pytest
import torch
from pagefleet_kernels import cpu_layer_ops, layer_ops
from pagefleet_kernels.backend import cpu_backend, torch_backend
from pagefleet_kernels.gguf_blocks import GGUF_BLOCK_TYPES, dequantize_blocks
from pagefleet_serve import SamplingParams
from pagefleet_serve.model.block_weight import BlockWeight
from pagefleet_serve.model.layers.linear_methods import (
    NATIVE_GEMM_ROWS,
    BlockLinear,
    quantized_linear,
)
from pagefleet_serve.model.loader.model_loader import load_model, resident_bytes

from tests.engine.kquants import Q4_K, Q6_K, q4_k_m, quantize
from tests.engine.test_engine_architectures import MAX_NEW_TOKENS, PROMPTS, build, load
from tests.engine.test_engine_gguf_architectures import write_gguf
from tests.engine.test_engine_moe import GGUF_CASES

# Byte offsets of each type's float16 fields (d, and m or dmin): random bytes elsewhere.
F16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
}
K_TYPES = ("Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
# Large enough for K-quant rows (256 weights a block) and a Q4_K_M file.
KQUANT_SIZES = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}


def random_blocks(type_name: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Blocks of `type_name` for a (..., K) matrix: every code, scale and packed bit
    random, the float16 fields finite (small, of either sign)."""
    kind = GGUF_BLOCK_TYPES[type_name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (*shape[:-1], shape[-1] // kind.weights, kind.bytes), np.uint8)
    for start in F16_FIELDS[type_name]:
        halves = rng.normal(0, 0.01, blocks.shape[:-1]).astype(np.float16)
        blocks[..., start : start + 2] = halves[..., None].view(np.uint8)
    return blocks.reshape(*shape[:-1], -1)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("type_name", list(GGUF_BLOCK_TYPES))
def test_every_block_type_dequantizes_bit_for_bit_as_gguf(type_name):
    """The PyTorch decoders and the C++ ones against gguf.quants.dequantize, 2-D and
    stacked experts: every float32 bit, then one rounding to bfloat16."""
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    ggml_type = GGUF_BLOCK_TYPES[type_name].ggml_type
    for shape in ((24, 512), (3, 8, 256)):
        blocks = random_blocks(type_name, shape, seed=len(shape))
        expected = torch.from_numpy(gguf.quants.dequantize(blocks, qtype))
        assert expected.shape == shape and bool(expected.isfinite().all())
        for dtype in (torch.float32, torch.bfloat16):
            want = bits(expected.to(dtype))
            assert torch.equal(
                bits(dequantize_blocks(torch.from_numpy(blocks), type_name, dtype)), want
            )
            if cpu_layer_ops.available():
                native = cpu_layer_ops.dequantize_blocks(torch.from_numpy(blocks), ggml_type, dtype)
                assert torch.equal(bits(native), want)
        weight = BlockWeight.from_gguf(blocks, type_name)
        assert weight.shape == shape
        assert torch.equal(bits(weight.dequantize()), bits(expected))


@pytest.mark.parametrize("ops", ["torch", "cpu"])
@pytest.mark.parametrize("type_name", K_TYPES)
def test_block_layers_multiply_the_dequantized_matrix_at_every_batch_size(type_name, ops):
    """A fused layer of two block types (a Q4_K_M q/k/v: this type, then Q6_K or Q4_K rows) times x
    against the float64 product with gguf's weights, at a decode step's few rows and from
    NATIVE_GEMM_ROWS on (the C++ GEMM over tiles dequantized once); with int8 activations
    the product of x rounded per 32 inputs, at every batch size alike."""
    if ops == "cpu" and not cpu_layer_ops.available():
        pytest.skip("no C++ compiler here")
    other = "Q4_K" if type_name == "Q6_K" else "Q6_K"
    parts = [
        BlockWeight.from_gguf(random_blocks(type_name, (96, 512), seed=1), type_name),
        BlockWeight.from_gguf(random_blocks(other, (40, 512), seed=2), other),
    ]
    weight = BlockWeight.cat_rows(parts)
    assert [t for _, t in weight.parts] == [type_name, other] and weight.shape == (136, 512)
    matrix = torch.cat([p.dequantize() for p in parts]).double()
    bias = torch.randn(136)
    layer = quantized_linear(weight, bias, cpu_backend() if ops == "cpu" else torch_backend())
    assert isinstance(layer, BlockLinear)
    assert not list(layer.parameters())[1:]  # the bias; the blocks are buffers
    assert sum(b.numel() for b in layer.buffers()) == weight.nbytes  # the blocks alone
    x = torch.randn(NATIVE_GEMM_ROWS + 5, 512) * torch.linspace(0.1, 4, 512)
    expected = x.double() @ matrix.T + bias.double()
    for rows in (1, 3, 5, NATIVE_GEMM_ROWS + 5):
        assert relative_error(layer(x[:rows]), expected[:rows]) < 1e-5, rows
    layer.round_activations_to_int8()
    rounded = layer_ops.quantize_activations_int8(x).double() @ matrix.T + bias.double()
    for rows in (1, 5, NATIVE_GEMM_ROWS + 5):
        assert relative_error(layer(x[:rows]), rounded[:rows]) < 1e-5, rows
    assert relative_error(layer(x), expected) > 1e-4  # the rounding is really applied


def test_q4_k_m_model_serves_the_tokens_of_its_float32_expansion(tmp_path):
    """A tiny Llama written as Q4_K_M (the helper's K-quant quantizer, llama.cpp's choice of
    Q6_K for the tied table and every other layer's v and down): with quantization auto its
    matrices stay in the file's blocks (a fused q/k/v of Q4_K and Q6_K rows, the table
    looked up from the tied head's blocks) and it generates the greedy tokens of the same
    file expanded to float32; it holds at most 1.2x the file's tensor bytes."""
    model = build("Llama", KQUANT_SIZES | {"tie_word_embeddings": True}, tmp_path / "hf")
    path = tmp_path / "tiny-q4_k_m.gguf"
    write_gguf(model, path, "llama", "tiny-llama", quantize=q4_k_m)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["token_embd.weight"] == Q6_K and types["blk.1.attn_v.weight"] == Q4_K
    assert types["blk.0.attn_v.weight"] == Q6_K and types["blk.0.ffn_down.weight"] == Q6_K

    loaded = load_model(f"file://{path}", torch.float32, "auto", backend=cpu_backend())
    net = loaded.model
    qkv = net.layers[0].self_attn.qkv_proj.method
    assert isinstance(qkv, BlockLinear) and qkv.type_names == ("Q4_K", "Q6_K")
    assert isinstance(net.lm_head.method, BlockLinear)
    assert net.embed_tokens.blocks is not None and not hasattr(net.embed_tokens, "weight")
    expanded = load_model(f"file://{path}", torch.float32, "none").model
    ids = torch.tensor(PROMPTS[0])
    torch.testing.assert_close(net.embed_tokens(ids), expanded.embed_tokens(ids), atol=0, rtol=0)
    file_bytes = sum(t.data.nbytes for t in gguf.GGUFReader(path).tensors)
    assert resident_bytes(net) <= 1.2 * file_bytes, (resident_bytes(net), file_bytes)
    assert resident_bytes(expanded) > 3 * file_bytes  # the float32 model it stands for

    greedy = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = [
        [out.outputs[0].token_ids for out in load(path, quantization=q).generate(PROMPTS, greedy)]
        for q in ("auto", "none")
    ]
    assert outputs[0] == outputs[1]


def test_q4_k_experts_stay_in_blocks_and_generate_the_dequantized_tokens(tmp_path):
    """A mixture's stacked experts written as Q4_K (3-D blocks) stay in blocks with
    quantization auto, each expert's [gate | up] and down a block layer, and generate the
    tokens of the same file expanded to float32."""
    (family, extra), arch = GGUF_CASES["qwen3-moe"]
    sizes = KQUANT_SIZES | {"moe_intermediate_size": 256, "head_dim": 64}
    model = build(family, extra | sizes, tmp_path / "hf")
    path = tmp_path / "experts-q4_k.gguf"

    def experts_q4_k(name: str, data: np.ndarray):
        return (quantize(data, Q4_K), Q4_K) if "_exps." in name else None

    write_gguf(model, path, arch, "tiny-qwen3-moe", quantize=experts_q4_k)
    loaded = load_model(f"file://{path}", torch.float32, "auto", backend=cpu_backend())
    experts = loaded.model.layers[1].mlp.experts
    assert experts.quantized is not None
    assert all(isinstance(layer, BlockLinear) for layer in experts.gate_up_layers)
    assert not list(experts.parameters())
    greedy = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = [
        [out.outputs[0].token_ids for out in load(path, quantization=q).generate(PROMPTS, greedy)]
        for q in ("auto", "none")
    ]
    assert outputs[0] == outputs[1]
