"""Mixture-of-experts models beyond the greedy parity of test_engine_architectures: prefix-
cache hits and chunked prefill through the engine, the checkpoint forms (Mixtral's
block_sparse_moe names, transformers' stacked experts, GGUF files with llama.cpp's
ffn_*_exps tensors), the expert load a benchmark reads, and the configuration's checks."""

from __future__ import annotations

import json

import gguf
import pytest
import torch
from pagefleet_serve import SamplingParams
from pagefleet_serve.model.layers.linear_methods import QuantizedLinear, can_prepack
from pagefleet_serve.model.layers.moe import MoEBlock, MoEConfig
from pagefleet_serve.model.loader.model_loader import load_model
from safetensors import safe_open

from tests.engine.test_engine_architectures import (
    ARCHITECTURES,
    MAX_NEW_TOKENS,
    PROMPTS,
    build,
    load,
    reference_tokens,
)
from tests.engine.test_engine_gguf_architectures import write_gguf

GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)


def saved_names(path) -> set[str]:
    with safe_open(path / "model.safetensors", "pt") as f:
        return set(f.keys())  # safe_open is not a mapping


def test_prefix_hits_and_chunked_prefill_keep_parity(tmp_path):
    """Qwen2-MoE (shared expert, a dense layer): a second request sharing the first's
    prompt reads its blocks from the prefix cache and computes only its own tail, in
    chunks of 8 tokens beside the others' decodes; every output is transformers'."""
    family, extra = ARCHITECTURES["qwen2-moe-shared-expert"]
    reference = build(family, extra, tmp_path)
    llm = load(tmp_path, max_num_batched_tokens=8, enable_prefix_caching=True)
    shared = PROMPTS[0]
    first = llm.generate([shared], GREEDY)[0]
    assert first.outputs[0].token_ids == reference_tokens(reference, shared)
    prompts = [shared + PROMPTS[2], shared[:20] + PROMPTS[1]]
    outs = llm.generate(prompts, GREEDY)
    assert [out.num_cached_tokens for out in outs] == [36, 20]  # whole 4-token blocks
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == reference_tokens(reference, prompt)
    llm.engine.block_manager.check_no_leaks()


def test_mixtral_names_and_stacked_experts_load_alike(tmp_path):
    """transformers writes Mixtral's experts under their original names (block_sparse_moe.
    experts.{e}.w1/w2/w3) and, asked for its own format, stacked (mlp.experts.gate_up_proj);
    both load into the same stacked tensors and generate the same tokens."""
    family, extra = ARCHITECTURES["mixtral-moe"]
    original, stacked = tmp_path / "original", tmp_path / "stacked"
    reference = build(family, extra, original)
    reference.save_pretrained(stacked, save_original_format=False)
    assert "model.layers.0.block_sparse_moe.experts.7.w3.weight" in saved_names(original)
    assert "model.layers.0.mlp.experts.gate_up_proj" in saved_names(stacked)
    loaded = [
        load_model(str(path), torch.float32).model.state_dict() for path in (original, stacked)
    ]
    for weights in loaded:
        assert weights["layers.0.mlp.experts.gate_up_proj"].shape == (8, 256, 64)
        assert weights["layers.0.mlp.experts.down_proj"].shape == (8, 64, 128)
    for name, weight in loaded[0].items():
        torch.testing.assert_close(weight, loaded[1][name], rtol=0, atol=0, msg=name)
    expected = reference_tokens(reference, PROMPTS[1])
    for path in (original, stacked):
        out = load(path).generate([PROMPTS[1]], GREEDY)[0]
        assert out.outputs[0].token_ids == expected


# name: (architecture, GGUF architecture); llama.cpp's Qwen MoE files have no dense layers.
GGUF_CASES = {
    "mixtral-moe": (ARCHITECTURES["mixtral-moe"], "llama"),
    "qwen2-moe-shared-expert": (
        ("Qwen2Moe", ARCHITECTURES["qwen2-moe-shared-expert"][1] | {"mlp_only_layers": []}),
        "qwen2moe",
    ),
    "qwen3-moe": (
        ("Qwen3Moe", ARCHITECTURES["qwen3-moe"][1] | {"decoder_sparse_step": 1}),
        "qwen3moe",
    ),
}


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_gguf_mixture_generates_what_its_directory_does(case, tmp_path):
    """A float32 GGUF of the model as llama.cpp's converter writes a mixture (expert_count,
    expert_used_count, the experts stacked as ffn_gate/up/down_exps, the shared expert's
    _shexp tensors; Mixtral as `llama`) serves the tokens of its Hugging Face directory,
    itself token-exact against transformers."""
    (family, extra), arch = GGUF_CASES[case]
    model = build(family, extra, tmp_path / "hf")
    path = tmp_path / f"{case}.gguf"
    write_gguf(model, path, arch, f"tiny-{case}")
    config = load_model(f"file://{path}", torch.float32).config
    expected = load_model(str(tmp_path / "hf"), torch.float32).config
    for field in ("num_experts", "num_experts_per_tok", "norm_topk_prob", "sparse_layers"):
        assert getattr(config, field) == getattr(expected, field), field
    assert type(config) is type(expected)  # the same family's config, its own fields alike
    assert getattr(config, "shared_expert_intermediate_size", 0) == getattr(
        expected, "shared_expert_intermediate_size", 0
    )
    outputs = [
        [out.outputs[0].token_ids for out in load(source).generate(PROMPTS, GREEDY)]
        for source in (path, tmp_path / "hf")
    ]
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_gguf_quantized_experts_stay_quantized_and_generate_the_dequantized_tokens(kind, tmp_path):
    """Q8_0 / Q4_0 experts (3-D blocks) stay quantized with quantization auto, each
    expert's [gate | up] and down a quantized layer of the backend's kernels; the file
    generates what a directory holding the same dequantized experts does, and with
    quantization none the experts are expanded to float."""
    (family, extra), arch = GGUF_CASES["qwen3-moe"]
    model = build(family, extra, tmp_path / "hf")
    quantization = getattr(gguf.GGMLQuantizationType, kind)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".mlp.experts." in name:
                codes = gguf.quants.quantize(param.float().numpy(), quantization)
                param.copy_(torch.from_numpy(gguf.quants.dequantize(codes, quantization)))
    model.save_pretrained(tmp_path / "hf")
    path = tmp_path / f"experts-{kind}.gguf"
    write_gguf(model, path, arch, "tiny-qwen3-moe", expert_type=quantization)
    for setting, kept in (("auto", True), ("none", False)):
        loaded = load_model(f"file://{path}", torch.float32, setting)
        experts = loaded.model.layers[1].mlp.experts
        assert (experts.quantized is not None) is kept, setting
        if kept:
            assert all(isinstance(layer, QuantizedLinear) for layer in experts.gate_up_layers)
            assert not list(experts.parameters())  # no float copy of them
            held = sum(b.numel() * b.element_size() for b in experts.buffers())
            c = loaded.config
            size = c.moe_intermediate_size or c.intermediate_size
            floats = c.num_experts * 3 * c.hidden_size * size * 4  # float32 gate, up, down
            # Q4_0: nibbles and their scales; Q8_0: held as two 4-bit parts (Int4Linear).
            assert held < floats * (0.35 if kind == "Q4_0" else 0.55), (held, floats)
    outputs = [
        [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]
        for llm in (load(path, quantization="auto"), load(tmp_path / "hf"))
    ]
    assert outputs[0] == outputs[1]


def test_expert_load_counts_each_tokens_choices(tmp_path):
    """A sparse layer can record how many of a forward's tokens chose each expert."""
    family, extra = ARCHITECTURES["qwen3-moe"]
    build(family, extra, tmp_path)
    loaded = load_model(str(tmp_path), torch.float32)
    model = loaded.model
    block = model.layers[1].mlp
    assert isinstance(block, MoEBlock) and not isinstance(model.layers[0].mlp, MoEBlock)
    block.record_expert_load = True
    x = torch.randn(7, loaded.config.hidden_size)
    block(x)
    assert block.expert_load is not None
    assert block.expert_load.shape == (16,) and int(block.expert_load.sum()) == 7 * 2


@pytest.mark.skipif(not can_prepack(torch.bfloat16), reason="oneDNN packs no bfloat16 here")
def test_prepacked_bfloat16_experts_compute_what_the_stacked_ones_do(tmp_path):
    """Prepacking (CPU, eager) reorders a 16-bit model's experts for oneDNN and drops the
    stacked tensors; a sparse layer's output stays within bfloat16's rounding, for a
    decode row and a prefill chunk. Float32 experts stay as they lie."""
    family, extra = ARCHITECTURES["qwen3-moe"]
    build(family, extra, tmp_path)
    loaded = load_model(str(tmp_path), torch.bfloat16)
    model = loaded.model
    block = model.layers[1].mlp
    assert isinstance(block, MoEBlock)
    rows = [torch.randn(n, loaded.config.hidden_size).bfloat16() for n in (1, 40)]
    before = [block(x) for x in rows]
    model.prepack_linears()
    assert block.experts.packed is not None and not list(block.experts.parameters())
    for x, expected in zip(rows, before, strict=True):
        torch.testing.assert_close(block(x), expected, atol=1.5e-2, rtol=1e-2)
    float_model = load_model(str(tmp_path), torch.float32).model
    float_model.prepack_linears()
    assert all(layer.mlp.experts.packed is None for layer in float_model.layers[1::2])


def test_dense_layers_of_a_sparse_config(tmp_path):
    """decoder_sparse_step and mlp_only_layers together: layers 1 and 3 sparse, 3 not."""
    family, extra = ARCHITECTURES["qwen3-moe"]
    build(family, extra | {"num_hidden_layers": 4, "mlp_only_layers": [3]}, tmp_path)
    config = load_model(str(tmp_path), torch.float32).config
    assert config.sparse_layers == (False, True, False, False)
    assert [config.layer_is_sparse(i) for i in range(4)] == [False, True, False, False]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok must be in \[1, num_experts = 8\]"),
        (
            {"router_scoring": "relu"},
            r"router_scoring must be one of \('softmax', 'sigmoid', 'top_k_softmax'\)",
        ),
        ({"sparse_layers": (True,)}, r"sparse_layers has 1 entries for 2 layers"),
    ],
)
def test_config_refuses_inconsistent_experts(change, message):
    base = dict(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=8,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
    )
    with pytest.raises(ValueError, match=message):
        MoEConfig(**(base | change))


def test_config_json_without_qkv_bias_key_defaults_to_biases(tmp_path):
    """Qwen1.5-MoE's config.json predates qkv_bias: its q/k/v carry biases."""
    family, extra = ARCHITECTURES["qwen2-moe-shared-expert"]
    build(family, extra, tmp_path)
    config_file = tmp_path / "config.json"
    hf = json.loads(config_file.read_text())
    hf.pop("qkv_bias", None)
    config_file.write_text(json.dumps(hf))
    assert load_model(str(tmp_path), torch.float32).config.qkv_bias


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """A Qwen3-MoE checkpoint and its transformers model (the reference)."""
    path = tmp_path_factory.mktemp("qwen3-moe")
    family, extra = ARCHITECTURES["qwen3-moe"]
    return path, build(family, extra, path)


def test_preempted_mixture_sequences_resume_with_their_tokens(qwen3_moe):
    """Six sequences in a pool too small for them all: some are preempted (their blocks
    freed) and recomputed; every one still gets transformers' greedy tokens."""
    path, reference = qwen3_moe
    # 4-token blocks; a sequence grows to ~37 + 48 tokens (22 blocks): 6 need 132 blocks.
    probe = load(path)
    bytes_per_block = probe.engine.runner.bytes_per_block
    del probe
    llm = load(path, kv_cache_memory_bytes=60 * bytes_per_block)
    prompts = [PROMPTS[i % 3][: 37 - i] for i in range(6)]
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.stats().num_preemptions >= 1
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == reference_tokens(reference, prompt)
    llm.engine.block_manager.check_no_leaks()


def test_n_samples_of_a_mixture_share_the_prompt_and_draw_apart(qwen3_moe):
    assert_n_samples_share_the_prompt_and_draw_apart(*qwen3_moe)


def assert_n_samples_share_the_prompt_and_draw_apart(path, reference) -> None:
    """n=3 greedy samples are the one greedy answer three times; seeded samples of n=3
    differ from each other, and each is what the same request gives again."""
    llm = load(path)
    prompt = PROMPTS[1]
    greedy = SamplingParams(n=3, max_tokens=16, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate([prompt], greedy)
    expected = reference_tokens(reference, prompt, 16)
    assert [o.token_ids for o in out.outputs] == [expected] * 3
    seeded = SamplingParams(n=3, max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    first, again = (llm.generate([prompt], seeded)[0] for _ in range(2))
    samples = [o.token_ids for o in first.outputs]
    assert len({tuple(s) for s in samples}) == 3
    assert samples == [o.token_ids for o in again.outputs]


def test_speculative_decoding_on_a_mixture_keeps_its_greedy_tokens(qwen3_moe):
    """Prompt-lookup drafts verified by the mixture: the accepted tokens are the model's own
    (transformers'), and some drafts are accepted (a prompt that repeats itself)."""
    path, reference = qwen3_moe
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None}
    llm = load(path, speculative_config=ngram)
    prompts = [PROMPTS[0][:12] * 3, PROMPTS[1]]
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == reference_tokens(reference, prompt)
    spec = llm.engine.stats().spec_decode
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens > 0
