"""gpt-oss in the one paged model runner: attention sinks, sliding and full layers in turn,
YaRN rope, a biased router whose softmax is over its top 2, experts with biases and a
clamped SwiGLU (gate and up interleaved in the checkpoint), q/k/v/o biases; and its MXFP4
experts, dequantized at load.

A tiny random GptOssForCausalLM built with transformers (16 experts, 2 a token, an
8-token window that the prompts cross, YaRN over an original context of 32) saved with
save_pretrained; its sinks, expert biases and router are made large enough to decide
tokens, and the SwiGLU limit small enough to clamp. PageFleet's greedy tokens must equal
transformers' generate in float32: in batches where prefill chunks and decodes share
steps, with prefix-cache hits, under preemption, for n=3 samples and with speculative
decoding."""

from __future__ import annotations

import json

import pytest
import torch
from pagefleet_serve import SamplingParams
from pagefleet_serve.model import mxfp4
from pagefleet_serve.model.layers.rotary import RotaryEmbedding
from pagefleet_serve.model.loader.model_loader import load_model
from pagefleet_serve.model.uri import UnsupportedModelError
from safetensors.torch import load_file, save_file

from tests.engine.test_engine_architectures import (
    MAX_NEW_TOKENS,
    PROMPTS,
    build,
    load,
    reference_tokens,
)
from tests.engine.test_engine_moe import assert_n_samples_share_the_prompt_and_draw_apart

GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
WINDOW = 8
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "beta_fast": 8.0,
    "beta_slow": 1.0,
    "original_max_position_embeddings": 32,
    "truncate": False,
    "rope_theta": 10000.0,
}
GPT_OSS = {
    "num_local_experts": 16,
    "num_experts_per_tok": 2,
    "sliding_window": WINDOW,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "rope_parameters": YARN,
    "swiglu_limit": 1.0,
    "attention_bias": True,
}


def build_gpt_oss(path, extra: dict | None = None):
    """The tiny model, its sinks (one per head), expert biases and router made to matter."""
    model = build("GptOss", GPT_OSS | (extra or {}), path)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):  # from far below the scores to far above
                param.copy_(torch.linspace(-3.0, 4.0, param.numel()))
            elif name.endswith(("_proj_bias", "router.bias")):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """A gpt-oss checkpoint and its transformers model (the reference)."""
    path = tmp_path_factory.mktemp("gpt-oss")
    return path, build_gpt_oss(path)


def test_config_switches_of_a_gpt_oss_checkpoint(gpt_oss):
    path, _ = gpt_oss
    loaded = load_model(str(path), torch.float32)
    config, layer = loaded.config, loaded.model.layers[0]
    # sinks in the attention, a biased router, experts with biases
    assert layer.self_attn.attn.sinks is not None and layer.mlp.gate.bias is not None
    assert layer.mlp.experts.gate_up_proj_bias is not None
    assert config.qkv_bias and config.o_bias
    assert config.router_scoring == "top_k_softmax" and not config.norm_topk_prob
    assert config.num_experts == 16 and config.num_experts_per_tok == 2
    assert config.swiglu_limit == 1.0 and config.swiglu_alpha == 1.702
    assert config.sliding_window == WINDOW
    assert config.sliding_layers == (True, False, True)
    scaling = dict(config.rope_scaling)
    assert scaling["rope_type"] == "yarn" and scaling["truncate"] is False
    factor = RotaryEmbedding(
        config.head_dim, config.rope_theta, config.rope_scaling
    ).attention_factor
    assert factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)) + 1)


def test_yarn_frequencies_are_transformers(gpt_oss):
    """The rotary frequencies and attention factor are transformers' own, with truncate
    off and on."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    path, reference = gpt_oss
    for truncate in (False, True):
        hf = json.loads((path / "config.json").read_text())
        hf["rope_parameters"] = YARN | {"truncate": truncate}
        (path / "config.json").write_text(json.dumps(hf))
        config = load_model(str(path), torch.float32).config
        expected, factor = ROPE_INIT_FUNCTIONS["yarn"](GptOssConfig(**hf))
        rope = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        torch.testing.assert_close(rope.inv_freq, expected, rtol=0, atol=0)
        assert rope.attention_factor == factor
    reference.config.save_pretrained(path)  # the fixture's config again


def test_greedy_parity_with_transformers(gpt_oss):
    """16 tokens a step: the long prompts prefill in chunks while others decode, each
    crossing the 8-token window and YaRN's original context."""
    path, reference = gpt_oss
    llm = load(path, max_num_batched_tokens=16, enable_prefix_caching=False)
    outs = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == reference_tokens(reference, prompt)
    llm.engine.block_manager.check_no_leaks()


def test_prefix_hits_and_chunked_prefill_keep_parity(gpt_oss):
    """A second request sharing the first's prompt reads its blocks from the prefix cache
    and computes only its tail, in chunks of 8 tokens beside the others' decodes."""
    path, reference = gpt_oss
    llm = load(path, max_num_batched_tokens=8, enable_prefix_caching=True)
    shared = PROMPTS[0]
    first = llm.generate([shared], GREEDY)[0]
    assert first.outputs[0].token_ids == reference_tokens(reference, shared)
    prompts = [shared + PROMPTS[2], shared[:20] + PROMPTS[1]]
    outs = llm.generate(prompts, GREEDY)
    assert [out.num_cached_tokens for out in outs] == [36, 20]  # whole 4-token blocks
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == reference_tokens(reference, prompt)
    llm.engine.block_manager.check_no_leaks()


def test_preempted_sequences_resume_with_their_tokens(gpt_oss):
    """Six sequences in a pool too small for them all: some are preempted and recomputed;
    every one still gets transformers' greedy tokens."""
    path, reference = gpt_oss
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


def test_n_samples_share_the_prompt_and_draw_apart(gpt_oss):
    assert_n_samples_share_the_prompt_and_draw_apart(*gpt_oss)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_keeps_the_greedy_tokens(gpt_oss, method):
    """Prompt-lookup drafts, and drafts of the checkpoint itself as its own draft model
    (most of them accepted): verify steps of several tokens cross the 8-token window and
    attend with sinks over sliding and full layers alike, and keep transformers' tokens."""
    path, reference = gpt_oss
    spec = {"num_speculative_tokens": 4}
    spec |= {"method": "ngram"} if method == "ngram" else {"model": str(path)}
    llm = load(path, speculative_config=spec)
    outs = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == reference_tokens(reference, prompt)
    stats = llm.engine.stats().spec_decode
    assert stats.num_draft_tokens > 0
    if method == "draft_model":
        assert stats.num_accepted_tokens > stats.num_draft_tokens // 2
    llm.engine.block_manager.check_no_leaks()


def test_sinks_change_the_answer(gpt_oss, tmp_path):
    """The same checkpoint with its sinks at -inf-like logits (no share of any softmax)
    generates other tokens: the sinks are read and used."""
    path, _ = gpt_oss
    weights = load_file(path / "model.safetensors")
    for name in weights:
        if name.endswith("sinks"):
            weights[name] = torch.full_like(weights[name], -1e4)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    prompt = [PROMPTS[0]]
    with_sinks = load(path).generate(prompt, GREEDY)[0].outputs[0].token_ids
    without = load(tmp_path).generate(prompt, GREEDY)[0].outputs[0].token_ids
    assert with_sinks != without


def pack_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., R, C) floats, each 32 columns a code of E2M1 times one power of two -> blocks
    (..., R, C / 32, 16) and scales (..., R, C / 32), as gpt-oss's checkpoints hold them
    (the low nibble the even column)."""
    values = torch.tensor(mxfp4.E2M1_VALUES)
    groups = weight.unflatten(-1, (-1, 32))  # (..., R, G, 32)
    # The smallest power of two that brings the group's largest magnitude within 6.
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0**-100) / 6.0))
    exponent = exponent.clamp(min=-127)
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - values).abs().argmin(-1)  # +0.0 before -0.0
    assert torch.equal(values[codes] * torch.exp2(exponent)[..., None], groups)
    pairs = codes.unflatten(-1, (16, 2)).to(torch.uint8)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def representable(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Random weights exactly representable in MXFP4: E2M1 codes times 2^-3 .. 2^-6."""
    codes = torch.randint(0, 16, shape, generator=generator)
    scale = torch.exp2(-torch.randint(3, 7, (*shape[:-1], shape[-1] // 32), generator=generator))
    return torch.tensor(mxfp4.E2M1_VALUES)[codes] * scale.repeat_interleave(32, dim=-1)


def test_mxfp4_experts_load_as_their_float_weights(gpt_oss, tmp_path):
    """An MXFP4 checkpoint (quant_method mxfp4, experts as uint8 *_blocks and *_scales of
    rows x columns, as gpt-oss ships) written from float experts that MXFP4 represents
    exactly: the loaded experts equal those of the float checkpoint, bit for bit, agree
    with transformers' own dequantization, and generate its tokens."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path, reference = gpt_oss
    weights = load_file(path / "model.safetensors")
    generator = torch.Generator().manual_seed(3)
    packed, floats = {}, {}
    for name in list(weights):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            rows_by_columns = representable(tuple(weights[name].transpose(1, 2).shape), generator)
            floats[name] = weights[name] = rows_by_columns.transpose(1, 2).contiguous()
            blocks, scales = pack_mxfp4(rows_by_columns)
            packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
            ours = mxfp4.dequantize(blocks, scales, torch.float32)
            theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            torch.testing.assert_close(ours.transpose(1, 2), theirs, rtol=0, atol=0)
    float_dir, mxfp4_dir = tmp_path / "float", tmp_path / "mxfp4"
    float_dir.mkdir()
    mxfp4_dir.mkdir()
    save_file(weights, float_dir / "model.safetensors", metadata={"format": "pt"})
    rest = {n: w for n, w in weights.items() if n not in floats}
    save_file(rest | packed, mxfp4_dir / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((path / "config.json").read_text())
    (float_dir / "config.json").write_text(json.dumps(hf))
    hf["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (mxfp4_dir / "config.json").write_text(json.dumps(hf))
    loaded = [load_model(str(d), torch.float32).model.state_dict() for d in (float_dir, mxfp4_dir)]
    assert loaded[0].keys() == loaded[1].keys()
    for name, weight in loaded[0].items():
        torch.testing.assert_close(loaded[1][name], weight, rtol=0, atol=0, msg=name)
    experts = loaded[1]["layers.0.mlp.experts.gate_up_proj"]
    assert experts.shape == (16, 2 * 128, 64) and experts.dtype == torch.float32
    # The model as transformers holds the same float experts, and PageFleet on the file.
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name in floats:
                param.copy_(floats[name])
    expected = reference_tokens(reference, PROMPTS[1])
    reference.load_state_dict(load_file(path / "model.safetensors"))  # the fixture's again
    out = load(mxfp4_dir).generate([PROMPTS[1]], GREEDY)[0]
    assert out.outputs[0].token_ids == expected


def test_mxfp4_blocks_without_scales_are_refused(gpt_oss, tmp_path):
    path, _ = gpt_oss
    weights = load_file(path / "model.safetensors")
    name = "model.layers.0.mlp.experts.down_proj"
    blocks, _ = pack_mxfp4(representable((16, 64, 128), torch.Generator().manual_seed(0)))
    weights.pop(name)
    save_file(weights | {name + "_blocks": blocks}, tmp_path / "model.safetensors")
    hf = json.loads((path / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(UnsupportedModelError, match="down_proj_blocks has no down_proj_scales"):
        load_model(str(tmp_path), torch.float32)
