"""Model sources: Hugging Face directories (sharded safetensors, llama3 rope scaling, untied
embeddings) checked token for token against transformers, and clear errors for what is
not supported."""

import json

import pytest
import torch
from pagefleet_serve import LLM, SamplingParams
from pagefleet_serve.model.loader.model_loader import TINY_CONFIG, load_model, random_weights
from pagefleet_serve.model.uri import UnsupportedModelError
from safetensors.torch import save_file

HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A random Llama in Hugging Face's format, its weights split over two shards."""
    weights = random_weights(TINY_CONFIG, torch.float32)  # builtin://tiny-random's
    path = tmp_path_factory.mktemp("tiny-llama")
    names = sorted(weights)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    index = {"metadata": {}, "weight_map": {}}
    for file, keys in shards.items():
        save_file(
            {f"model.{k}" if k != "lm_head.weight" else k: weights[k].contiguous() for k in keys},
            path / file,
        )
        index["weight_map"].update({k: file for k in keys})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "config.json").write_text(json.dumps(HF_CONFIG))
    return path


def test_hf_directory_matches_transformers(hf_dir):
    from transformers import LlamaForCausalLM

    reference = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    llm = LLM(
        str(hf_dir),
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=8 << 20,
        block_size=4,
    )
    assert llm.engine.model_config.rope_scaling is not None
    prompts = [[5, 17, 300, 42, 7, 99, 100, 3, 8], [400, 401, 402], list(range(60, 130))]
    ours = llm.generate(prompts, SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, ours, strict=True):
        with torch.inference_mode():
            ref = reference.generate(
                torch.tensor([prompt]),
                max_new_tokens=80,
                min_new_tokens=80,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        # Past position 64 the llama3 scaling of the low frequencies is in play.
        assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist()
    llm.engine.block_manager.check_no_leaks()


def test_non_llama_directory_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(
        UnsupportedModelError, match=r"'gpt2' is not Llama-family; supported: .*GGUF"
    ):
        load_model(str(tmp_path), torch.float32)


def test_file_that_is_not_gguf_is_refused(tmp_path):
    bogus = tmp_path / "model.bin"
    bogus.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(UnsupportedModelError, match="is not a GGUF file; supported"):
        load_model(str(bogus), torch.float32)


def test_gguf_of_another_architecture_is_refused(tmp_path):
    import gguf

    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=r"architecture .falcon. is not supported"):
        load_model(f"file://{path}", torch.float32)


def test_missing_model_and_unknown_builtin(tmp_path):
    with pytest.raises(UnsupportedModelError, match="not found"):
        load_model(str(tmp_path / "nope"), torch.float32)
    with pytest.raises(UnsupportedModelError, match="unknown built-in model"):
        load_model("builtin://gpt-5", torch.float32)


def test_pool_too_small_for_max_model_len_names_both_numbers():
    with pytest.raises(ValueError, match=r"max_model_len \(4096 tokens\).*\(64 tokens = 16 blocks"):
        LLM(
            "builtin://tiny-random",
            dtype="float32",
            block_size=4,
            kv_cache_memory_bytes=16 * 4 * 2 * 2 * 2 * 16 * 4,
        )


def test_native_bf16_is_read_from_the_cpu_flags():
    from pagefleet_serve.engine import device

    amx = "processor\t: 0\nflags\t\t: fpu sse avx512f amx_bf16 amx_tile\n"
    avx512 = "flags\t\t: fpu avx512f avx512_bf16\n"
    plain = "flags\t\t: fpu sse avx2 avx512f\n"
    assert device.cpu_has_native_bf16(amx)
    assert device.cpu_has_native_bf16(avx512)
    assert not device.cpu_has_native_bf16(plain)
    assert not device.cpu_has_native_bf16("")


@pytest.mark.parametrize(("native", "expected"), [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_is_bfloat16_only_on_cpus_with_native_bf16(monkeypatch, native, expected):
    from pagefleet_serve.engine import device

    # Both answers on any machine: the CPU's flags are replaced, not read.
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda cpuinfo=None: native)
    cpu = torch.device("cpu")
    assert device.resolve_dtype("auto", cpu) == expected
    assert device.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert device.resolve_dtype("float32", cpu) == torch.float32
    assert device.resolve_dtype("bfloat16", cpu) == torch.bfloat16
    llm = LLM("builtin://tiny-random", max_model_len=64, kv_cache_memory_bytes=1 << 20)
    assert llm.engine.dtype == expected
    assert next(llm.engine.runner.model.parameters()).dtype == expected


def test_rotary_frequencies_stay_float32_in_a_bfloat16_model():
    """Module.to(bfloat16) would round them (2^-9 relative): at position 2,000 the angle
    of a mid frequency would be off by about a radian."""
    from pagefleet_serve.model.layers.rotary import rope_inv_freq

    llm = LLM(
        "builtin://smollm2-135m", dtype="bfloat16", max_model_len=64, kv_cache_memory_bytes=8 << 20
    )
    model = llm.engine.runner.model
    assert next(model.parameters()).dtype == torch.bfloat16
    c = model.config
    assert model.rotary.inv_freq.dtype == torch.float32
    assert torch.equal(
        model.rotary.inv_freq, rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
    )
    # The cos/sin of a far position are those of the exact angle, rounded once.
    positions = torch.tensor([2000])
    cos, _ = model.rotary.cos_sin(positions, model.rotary.inv_freq, torch.bfloat16)
    exact = torch.cos(2000.0 * rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling).double())
    assert torch.allclose(cos[0, : exact.numel()].double(), exact, atol=1e-2)
