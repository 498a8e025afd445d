"""The decode roofline benchmark on the CPU at its tiny shape: it runs the engine's decode
step end to end, and the bytes it holds a step to are the bytes the model really has."""

import json

import pytest
import torch
from pagefleet_kernels.backend import torch_backend
from pagefleet_serve.engine.device import RunnerConfig
from pagefleet_serve.engine.model_runner import ModelRunner
from pagefleet_serve.model.context import ModelContext
from pagefleet_serve.model.loader.model_loader import from_weights
from pagefleet_serve.model.registry import build_model

from benchmarks import bench_decode_roofline as bench


@pytest.mark.parametrize("shape", ["tiny", "8b"])
def test_a_steps_weight_bytes_are_the_models_parameters_less_the_unread_embedding(shape):
    config = bench.SHAPES[shape]
    with torch.device("meta"):  # the 8B shape's parameters, without their storage
        model = build_model(config, ModelContext(torch_backend()))
    parameters = sum(p.numel() for p in model.parameters())
    embedding = config.vocab_size * config.hidden_size
    batch, context = 8, 1024
    moved = bench.step_bytes(config, batch, context, element=2)
    assert moved["weights"] == 2 * (parameters - embedding + batch * config.hidden_size)
    kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2
    assert moved["kv_cache"] == batch * context * kv_per_token
    if shape == "8b":  # Llama-3-8B: 8.03e9 parameters, 128 KiB of bf16 K/V per token
        assert 8.0e9 < parameters < 8.1e9 and kv_per_token == 128 << 10


def test_the_decode_step_runs_and_writes_its_rows(tmp_path, monkeypatch):
    out = tmp_path / "roofline.json"
    monkeypatch.setattr(
        "sys.argv",
        ["bench", "--shape", "tiny", "--device", "cpu", "--dtype", "float32",
         "--batches", "1", "3", "--context", "40", "--steps", "2", "--output", str(out)],
    )  # fmt: skip
    bench.main()
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["bandwidth_source"] == "measured copy"
    assert [row["batch"] for row in result["rows"]] == [1, 3]
    for row in result["rows"]:
        assert row["step_ms"] > 0 and row["times_roofline"] > 1


def test_the_random_weights_load_into_the_model_runner_and_give_finite_logits():
    config = bench.SHAPES["tiny"]
    weights = bench.random_weights(config, torch.float32, torch.device("cpu"))
    runner = ModelRunner(
        from_weights("tiny", config, weights.items(), ModelContext(torch_backend())),
        RunnerConfig(torch.device("cpu"), torch.float32, bench.BLOCK_SIZE, "torch", "auto"),
    )
    runner.allocate_kv_cache(4)
    hidden = runner.forward([1, 2, 3], [0], [3], [[0]])
    assert torch.isfinite(runner.model.compute_logits(hidden)).all()
