"""FP8 checkpoints as they are published (issue 46, the CPU side): a tiny random Llama is
quantized to float8 e4m3 here in each format (compressed-tensors per tensor and per
channel, fbgemm_fp8 per channel, fp8 in 128x128-style blocks), written with its
`quantization_config`, and must load as exactly the model whose weights are the float8
values times their scales (written as a float32 checkpoint), and generate its tokens.
Formats that are not float8 weights, and tensors that do not fit their format, are refused
by name."""

import json
import math

import pytest
import torch
from pagefleet_serve import LLM, SamplingParams
from pagefleet_serve.model.loader.model_loader import load_model
from pagefleet_serve.model.uri import UnsupportedModelError
from safetensors.torch import load_file, save_file

from tests.engine.test_engine_architectures import PROMPTS, build

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
BLOCK = (16, 32)  # small blocks, so that the tiny matrices hold several and a ragged edge


def quantized(weight: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 weight, float32 scale) as llm-compressor and fbgemm write them."""
    weight = weight.float()
    if strategy == "tensor":
        scale = weight.abs().amax() / FP8_MAX
        return (weight / scale).to(torch.float8_e4m3fn), scale.reshape(1)
    if strategy == "channel":
        scale = weight.abs().amax(dim=1, keepdim=True) / FP8_MAX
        return (weight / scale).to(torch.float8_e4m3fn), scale
    rows, columns = weight.shape
    grid = (math.ceil(rows / BLOCK[0]), math.ceil(columns / BLOCK[1]))
    scale = torch.empty(grid)
    for i in range(grid[0]):
        for j in range(grid[1]):
            block = weight[i * BLOCK[0] : (i + 1) * BLOCK[0], j * BLOCK[1] : (j + 1) * BLOCK[1]]
            scale[i, j] = block.abs().amax() / FP8_MAX
    per_element = scale.repeat_interleave(BLOCK[0], 0)[:rows].repeat_interleave(BLOCK[1], 1)
    return (weight / per_element[:, :columns]).to(torch.float8_e4m3fn), scale


FORMATS = {
    "compressed-tensors-tensor": (
        "tensor",
        ".weight_scale",
        {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
                    "input_activations": {"num_bits": 8, "type": "float", "dynamic": True},
                }
            },
            "ignore": ["lm_head"],
        },
    ),
    "compressed-tensors-channel": (
        "channel",
        ".weight_scale",
        {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                }
            },
            "ignore": ["lm_head"],
        },
    ),
    "fbgemm_fp8": (
        "channel",
        ".weight_scale",
        {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0},
    ),
    "fp8-blocks": (
        "block",
        ".weight_scale_inv",
        {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK)},
    ),
}


def write_fp8(source, fp8_dir, reference_dir, fmt: str) -> None:
    """Quantize `source`'s projections into `fp8_dir` in format `fmt`, and write what they
    stand for (float8 x scale, in float32) into `reference_dir`."""
    strategy, suffix, quantization = FORMATS[fmt]
    tensors = load_file(source / "model.safetensors")
    fp8, reference = {}, {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS:
            weight, scale = quantized(tensor, strategy)
            fp8[name], fp8[module + suffix] = weight, scale
            if fmt == "compressed-tensors-tensor":  # a static activation scale, unused
                fp8[module + ".input_scale"] = torch.ones(1)
            if strategy == "block":
                rows, columns = weight.shape
                per_element = scale.repeat_interleave(BLOCK[0], 0)[:rows]
                scale = per_element.repeat_interleave(BLOCK[1], 1)[:, :columns]
            reference[name] = weight.float() * scale
        else:
            fp8[name] = reference[name] = tensor
    config = json.loads((source / "config.json").read_text())
    for directory, weights, extra in (
        (fp8_dir, fp8, {"quantization_config": quantization}),
        (reference_dir, reference, {}),
    ):
        directory.mkdir()
        save_file(weights, directory / "model.safetensors")
        (directory / "config.json").write_text(json.dumps(config | extra))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    build("Llama", {}, path)
    return path


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_float8_checkpoint_loads_as_its_dequantized_model(source, tmp_path, fmt):
    write_fp8(source, tmp_path / "fp8", tmp_path / "reference", fmt)
    loaded = load_model(str(tmp_path / "fp8"), torch.float32)
    expected = load_model(str(tmp_path / "reference"), torch.float32)
    assert loaded.config == expected.config
    loaded, expected = loaded.model.state_dict(), expected.model.state_dict()
    assert sorted(loaded) == sorted(expected)
    assert not any("scale" in name for name in loaded)
    for name, weight in expected.items():
        assert torch.equal(loaded[name], weight), name


def test_a_float8_checkpoint_generates_the_dequantized_models_tokens(source, tmp_path):
    write_fp8(source, tmp_path / "fp8", tmp_path / "reference", "compressed-tensors-channel")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    settings = dict(dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20)
    outputs = [
        [o.outputs[0].token_ids for o in LLM(str(path), **settings).generate(PROMPTS[:2], params)]
        for path in (tmp_path / "fp8", tmp_path / "reference")
    ]
    assert outputs[0] == outputs[1] and all(len(t) == 16 for t in outputs[0])


def rewrite(fp8_dir, config_change=None, tensors_change=None) -> None:
    if config_change is not None:
        config = json.loads((fp8_dir / "config.json").read_text())
        (fp8_dir / "config.json").write_text(json.dumps(config_change(config)))
    if tensors_change is not None:
        tensors = load_file(fp8_dir / "model.safetensors")
        tensors_change(tensors)
        save_file(tensors, fp8_dir / "model.safetensors")


def int4_weights(config: dict) -> dict:
    group = config["quantization_config"]["config_groups"]["group_0"]
    group["weights"] = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}
    return config


@pytest.mark.parametrize(
    ("fmt", "config_change", "tensors_change", "message"),
    [
        (
            "compressed-tensors-channel",
            int4_weights,
            None,
            r"compressed-tensors group 'group_0' has int 4-bit weights with strategy 'group'",
        ),
        (
            "fp8-blocks",
            lambda c: c | {"quantization_config": c["quantization_config"] | {"fmt": "e5m2"}},
            None,
            r"fp8 fmt 'e5m2': only e4m3 is read",
        ),
        (
            "fbgemm_fp8",
            None,
            lambda t: t.pop("model.layers.0.self_attn.q_proj.weight_scale"),
            r"model\.layers\.0\.self_attn\.q_proj\.weight is float8 and has no scale",
        ),
        (
            "fp8-blocks",
            None,
            lambda t: t.update(
                {"model.layers.1.mlp.down_proj.weight_scale_inv": torch.ones(1, 1) * 0.01}
            ),
            r"model\.layers\.1\.mlp\.down_proj\.weight: a block scale of shape \(1, 1\)",
        ),
    ],
)
def test_what_is_not_float8_with_fitting_scales_is_refused_by_name(
    source, tmp_path, fmt, config_change, tensors_change, message
):
    write_fp8(source, tmp_path / "fp8", tmp_path / "reference", fmt)
    rewrite(tmp_path / "fp8", config_change, tensors_change)
    with pytest.raises(UnsupportedModelError, match=message):
        load_model(str(tmp_path / "fp8"), torch.float32)


# -- kept in float8 (quantization="fp8", what auto means on CUDA) -----------------------------
KEPT_FORMATS = ["compressed-tensors-tensor", "compressed-tensors-channel", "fbgemm_fp8"]


def fp8_model(path, device="cpu"):
    from pagefleet_serve.engine.device import RunnerConfig
    from pagefleet_serve.engine.model_runner import ModelRunner

    loaded = load_model(str(path), torch.float32, "fp8")
    return ModelRunner(
        loaded, RunnerConfig(torch.device(device), torch.float32, 16, "torch", "auto")
    )


@pytest.mark.parametrize("fmt", KEPT_FORMATS)
def test_kept_float8_layers_hold_exactly_the_checkpoints_weights(source, tmp_path, fmt):
    """Each projection (q/k/v and gate/up fused by the model, a per-tensor scale repeated
    per row) is an Fp8Linear whose float8 values times its row scales are the reference's
    float32 weights, bit for bit; nothing else is float8."""
    from pagefleet_serve.model.layers.linear_methods import Fp8Linear

    write_fp8(source, tmp_path / "fp8", tmp_path / "reference", fmt)
    reference = load_file(tmp_path / "reference" / "model.safetensors")
    model = fp8_model(tmp_path / "fp8").model
    layer = model.layers[1]
    fused = {
        layer.self_attn.qkv_proj: [f"self_attn.{n}_proj" for n in "qkv"],
        layer.self_attn.o_proj: ["self_attn.o_proj"],
        layer.mlp.gate_up_proj: ["mlp.gate_proj", "mlp.up_proj"],
        layer.mlp.down_proj: ["mlp.down_proj"],
    }
    for linear, parts in fused.items():
        module = linear.method
        assert isinstance(module, Fp8Linear)
        weight = module.weight_fp8.float() * module.scale.reshape(-1, 1)
        expected = torch.cat([reference[f"model.layers.1.{p}.weight"] for p in parts])
        assert torch.equal(weight, expected), parts
    assert not isinstance(model.lm_head.method, Fp8Linear)
    assert model.embed_tokens.weight.dtype == torch.float32


def test_an_fp8_layer_is_the_float8_product_of_each_rows_scaled_activations():
    """y = (x / s_x rounded to float8) s_x (w_fp8 s_w)^T, s_x = max |x_row| / 448: exactly
    that in float32 on the CPU, and within float8's rounding of the float32 product."""
    from pagefleet_serve.model.fp8 import Fp8Scheme, kept
    from pagefleet_serve.model.layers.linear_methods import quantized_linear

    generator = torch.Generator().manual_seed(3)
    w = torch.randn(48, 64, generator=generator)
    scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    weight = kept("w", (w / scale).to(torch.float8_e4m3fn), scale, Fp8Scheme("fbgemm_fp8"))
    bias = torch.randn(48, generator=generator)
    layer = quantized_linear(weight, bias, None)
    x = torch.randn(2, 5, 64, generator=generator) * torch.tensor([1e-3, 30.0]).view(2, 1, 1)
    y = layer(x)
    rows = x.reshape(-1, 64)
    s_x = rows.abs().amax(dim=1, keepdim=True) / FP8_MAX
    x8 = (rows / s_x).to(torch.float8_e4m3fn).float() * s_x
    w_dequantized = weight.dequantize()
    expected = (x8 @ w_dequantized.t() + bias).view(2, 5, 48)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())
    exact = x @ w_dequantized.t() + bias
    relative = (y - exact).norm() / exact.norm()
    assert 0 < relative < 0.05  # float8 activations: about 2^-4 per element, averaged
    # .to() keeps the float8 codes and the float32 scales
    layer.to(torch.bfloat16)
    assert layer.weight_fp8.dtype == torch.float8_e4m3fn and layer.scale.dtype == torch.float32


def round_activations_to_float8(module, args):
    """A projection's input as Fp8Linear sees it: each row scaled into float8 and back."""
    rows = args[0].reshape(-1, args[0].shape[-1])
    scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return ((rows / scale).to(torch.float8_e4m3fn).float() * scale).view_as(args[0])


def test_a_kept_float8_model_computes_the_dequantized_model_on_float8_inputs(source, tmp_path):
    """Kept in float8, the model's logits over a prefill are those of the dequantized
    model whose projections see their inputs rounded to float8 per row (the same
    arithmetic done apart); without that rounding they differ by float8's error (about 16%
    of their norm on this random model), so the comparison has teeth. Through the engine
    (quantization="fp8") greedy generation starts with the same token for every prompt.
    Later tokens are not compared: on this random model a one-ulp difference between the
    decode kernels flips a float8 rounding, and the sequences part after a few tokens."""
    from pagefleet_serve.model.layers.linear_methods import Fp8Linear

    write_fp8(source, tmp_path / "fp8", tmp_path / "reference", "compressed-tensors-channel")
    kept_runner = fp8_model(tmp_path / "fp8")
    reference = fp8_model(tmp_path / "reference")  # no float8 matrices: loads as float32
    ids = list(range(5, 45))
    logits = []
    for runner in (kept_runner, reference, reference):
        if len(logits) == 2:  # the second reference pass rounds as float8 does
            for name, module in reference.model.named_modules():
                if name.endswith("_proj"):
                    module.register_forward_pre_hook(round_activations_to_float8)
        runner.allocate_kv_cache(4)
        logits.append(runner.model.compute_logits(runner.forward(ids, [0], [40], [[0, 1, 2]])))
    kept, plain, rounded = logits
    torch.testing.assert_close(kept, rounded, rtol=1e-4, atol=1e-4)
    assert (kept - plain).norm() / plain.norm() > 0.02

    settings = dict(dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    kept_llm = LLM(str(tmp_path / "fp8"), quantization="fp8", **settings)
    assert isinstance(kept_llm.engine.runner.model.layers[0].mlp.down_proj.method, Fp8Linear)
    reference_llm = LLM(str(tmp_path / "reference"), **settings)
    for name, module in reference_llm.engine.runner.model.named_modules():
        if name.endswith("_proj"):
            module.register_forward_pre_hook(round_activations_to_float8)
    got = [o.outputs[0].token_ids for o in kept_llm.generate(PROMPTS, params)]
    expected = [o.outputs[0].token_ids for o in reference_llm.generate(PROMPTS, params)]
    assert [t[0] for t in got] == [t[0] for t in expected]
    assert all(len(t) == 12 for t in got)


def test_auto_keeps_float8_on_one_hopper_gpu_and_dequantizes_elsewhere(monkeypatch):
    """auto: float8 on a CUDA device of capability 9.0+ serving alone; dequantized on
    the CPU, on older GPUs (no fast rowwise float8 product) and under tensor parallelism
    (float8 weights are not split yet); an explicit fp8 is kept everywhere."""
    from pagefleet_serve.config import EngineConfig
    from pagefleet_serve.engine.device import weight_quantization

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    auto = EngineConfig(quantization="auto")
    for capability, expected in (((9, 0), "fp8"), ((10, 0), "fp8"), ((8, 9), "none")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _d, c=capability: c)
        assert weight_quantization(auto, cuda) == expected, capability
    assert (
        weight_quantization(EngineConfig(quantization="auto", tensor_parallel_size=2), cuda)
        == "none"
    )
    assert weight_quantization(auto, cpu) == "auto"
    assert weight_quantization(EngineConfig(quantization="fp8"), cpu) == "fp8"
    assert weight_quantization(EngineConfig(quantization="none"), cuda) == "none"


def test_float8_experts_are_dequantized_when_the_rest_is_kept(tmp_path):
    """A mixture's float8 experts (no float8 grouped product yet) load dequantized beside
    kept float8 attention, and the model generates."""
    from pagefleet_serve.model.layers.linear_methods import Fp8Linear

    from tests.engine.test_engine_architectures import ARCHITECTURES

    family, extra = ARCHITECTURES["qwen2-moe-shared-expert"]
    build(family, extra, tmp_path / "moe")
    write_fp8(tmp_path / "moe", tmp_path / "fp8", tmp_path / "reference", "fbgemm_fp8")
    names = load_file(tmp_path / "fp8" / "model.safetensors")
    assert any(".experts." in n and n.endswith("weight_scale") for n in names)
    loaded = load_model(str(tmp_path / "fp8"), torch.float32, "fp8")
    expected = load_model(str(tmp_path / "reference"), torch.float32)
    loaded, expected = loaded.model.state_dict(), expected.model.state_dict()
    experts = [n for n in expected if ".experts." in n]
    assert experts and all(torch.equal(loaded[n], expected[n]) for n in experts)
    llm = LLM(str(tmp_path / "fp8"), quantization="fp8", dtype="float32", max_model_len=128,
              kv_cache_memory_bytes=4 << 20)  # fmt: skip
    assert isinstance(llm.engine.runner.model.layers[0].self_attn.o_proj.method, Fp8Linear)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert len(llm.generate(PROMPTS[:1], params)[0].outputs[0].token_ids) == 8


def test_block_scaled_float8_is_dequantized_even_when_fp8_is_asked(source, tmp_path):
    write_fp8(source, tmp_path / "fp8", tmp_path / "reference", "fp8-blocks")
    loaded = load_model(str(tmp_path / "fp8"), torch.float32, "fp8")
    expected = load_model(str(tmp_path / "reference"), torch.float32).model.state_dict()
    loaded = loaded.model.state_dict()
    for name, weight in expected.items():
        assert torch.equal(loaded[name], weight), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_on_cuda_an_fp8_layer_matches_its_cpu_product(dtype):
    from pagefleet_serve.model.fp8 import Fp8Scheme, kept
    from pagefleet_serve.model.layers.linear_methods import quantized_linear

    generator = torch.Generator().manual_seed(4)
    w = torch.randn(256, 512, generator=generator)
    scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    weight = kept("w", (w / scale).to(torch.float8_e4m3fn), scale, Fp8Scheme("fbgemm_fp8"))
    layer = quantized_linear(weight, None, None)
    x = torch.randn(7, 512, generator=generator)
    expected = layer(x)
    y = layer.to("cuda")(x.to("cuda", dtype))
    assert y.dtype == dtype
    torch.testing.assert_close(y.float().cpu(), expected, rtol=2e-2, atol=2e-2)
