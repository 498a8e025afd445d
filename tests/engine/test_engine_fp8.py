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
from pagefleet_serve.model.loader import UnsupportedModelError, load_model
from safetensors.torch import load_file, save_file
from test_engine_architectures import PROMPTS, build

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
    assert sorted(loaded.weights) == sorted(expected.weights)
    assert not any("scale" in name for name in loaded.weights)
    for name, weight in expected.weights.items():
        assert torch.equal(loaded.weights[name], weight), name


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
