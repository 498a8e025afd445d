"""Architectures beyond Llama in the one paged model runner: Qwen2 (q/k/v biases), Qwen3
(per-head q/k RMSNorm, with attention biases), Mistral (sliding window on every layer),
Phi-3 (fused checkpoint tensors, sliding window), Qwen2 with sliding and full layers
mixed, and the mixtures of experts: Mixtral, Qwen2-MoE (a gated shared expert, a dense
layer among the sparse ones), Qwen3-MoE and OLMoE (q/k norms over the whole projection,
clamped q/k/v), each with 8 or 16 experts and 2 a token.

Each is a tiny random model built with transformers' own class and saved with
save_pretrained; PageFleet's greedy tokens must equal transformers' generate for 48 tokens
in float32, on prompts longer than the sliding window, in batches where prefill chunks and
decodes share steps."""

from __future__ import annotations

import json
import math

import pytest
import torch
from pagefleet_serve import LLM, SamplingParams
from pagefleet_serve.model.loader.model_loader import load_model
from pagefleet_serve.model_uri import UnsupportedModelError

MAX_NEW_TOKENS = 48
WINDOW = 12
SMALL = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "initializer_range": 0.2,  # far from uniform logits: no greedy near-ties
    "bos_token_id": 1,
    "eos_token_id": 2,
}
ARCHITECTURES = {
    "qwen2-biases": ("Qwen2", {}),
    "qwen3-qk-norm": ("Qwen3", {"attention_bias": True}),
    "mistral-sliding-window": ("Mistral", {"sliding_window": WINDOW}),
    # Checkpoint with fused qkv_proj and gate_up_proj, and a sliding window.
    "phi3-fused-sliding-window": ("Phi3", {"sliding_window": WINDOW, "pad_token_id": 0}),
    # Scaled embeddings, (1 + w) sandwich norms, GeGLU, soft-capped attention and logits,
    # query_pre_attn_scalar, layers 0 and 2 sliding, 1 global; tied embeddings.
    "gemma2": (
        "Gemma2",
        {
            "sliding_window": WINDOW,
            "attn_logit_softcapping": 1.0,
            "final_logit_softcapping": 5.0,
            "query_pre_attn_scalar": 32,
            "tie_word_embeddings": True,
            "pad_token_id": 0,
        },
    ),
    # Gemma 3: q/k norms too, no caps; sliding layers rotate with their own base, the
    # global one with linear rope scaling.
    "gemma3": (
        "Gemma3Text",
        {
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            },
            "query_pre_attn_scalar": 32,
            "tie_word_embeddings": True,
            "pad_token_id": 0,
        },
    ),
    # Layers 1 and 2 slide, layer 0 sees everything.
    "qwen2-mixed-layers": (
        "Qwen2",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    ),
    # Mixtures of experts. Mixtral renormalizes its top 2 and slides (checkpoint names
    # block_sparse_moe.experts.{e}.w1/w2/w3).
    "mixtral-moe": (
        "Mixtral",
        {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": WINDOW},
    ),
    # A shared expert behind a sigmoid gate; layer 1 dense (mlp_only_layers), experts of
    # their own size; top 2 not renormalized.
    "qwen2-moe-shared-expert": (
        "Qwen2Moe",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 96,
            "mlp_only_layers": [1],
        },
    ),
    # Per-head q/k norms, renormalized top 2, every other layer sparse.
    "qwen3-moe": (
        "Qwen3Moe",
        {
            "num_experts": 16,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "decoder_sparse_step": 2,
        },
    ),
    # q/k norms over the whole projections, q/k/v clamped.
    "olmoe": ("Olmoe", {"num_experts": 8, "num_experts_per_tok": 2, "clip_qkv": 1.5}),
}
# Phi-3 128k's longrope on a tiny scale: the switch at a context of 32.
LONGROPE = {
    "pad_token_id": 0,
    "original_max_position_embeddings": 32,
    "rope_parameters": {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(SMALL["head_dim"] // 2)],
        "long_factor": [1.0 + 2.0 * i for i in range(SMALL["head_dim"] // 2)],
        "rope_theta": 10000.0,
    },
}
PROMPTS = [
    [(7 * i + 3) % 300 + 10 for i in range(37)],
    [(11 * i + 5) % 300 + 10 for i in range(23)],
    [(13 * i + 1) % 300 + 10 for i in range(5)],
]


def build(family: str, extra: dict, path):
    import transformers

    config = getattr(transformers, f"{family}Config")(**{**SMALL, **extra})
    torch.manual_seed(0)
    # The written-out softmax: the reference for soft-capping (SDPA cannot cap).
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.eval()
    if family.startswith("Gemma"):
        # Gemma initializes its norm weights to 0 (a scale of 1 + 0) and its tied, scaled-up
        # embeddings drown the layers: every token repeats. Random norm weights and smaller
        # embeddings give generations in which the (1 + weight) norms and the soft-capping
        # decide tokens.
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
            model.model.embed_tokens.weight.mul_(0.1)
    model.save_pretrained(path)
    return model


def reference_tokens(model, prompt: list[int], max_new_tokens: int = MAX_NEW_TOKENS) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def load(path, **overrides) -> LLM:
    """PageFleet on a saved tiny model: float32, small pool, 4-token blocks."""
    settings = dict(dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20, block_size=4)
    return LLM(str(path), **(settings | overrides))


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_greedy_parity_with_transformers(arch, tmp_path):
    family, extra = ARCHITECTURES[arch]
    reference = build(family, extra, tmp_path)
    llm = load(
        tmp_path,
        # 16 tokens a step: the long prompts prefill in chunks while others decode.
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
    )
    config = llm.engine.model_config
    attention = llm.engine.runner.model.layers[0].self_attn
    if "sliding_window" in extra:
        assert config.sliding_window == WINDOW
        assert len(PROMPTS[0]) > WINDOW and len(PROMPTS[1]) > WINDOW
    if arch == "qwen2-mixed-layers":
        assert config.sliding_layers == (False, True, True)
    if arch.startswith("gemma"):
        assert config.sliding_layers == (True, False, True)
    if arch == "gemma3":
        # q/k normed per head (over head_dim)
        assert attention.q_norm.weight.shape == (config.head_dim,)
        assert config.local_rope_theta == 10000.0
        assert dict(config.rope_scaling)["rope_type"] == "linear"
    if arch == "gemma2":
        assert config.attn_logit_softcapping == 1.0 and config.tie_word_embeddings
    if "moe" in arch:
        assert config.num_experts >= 8 and config.num_experts_per_tok == 2
    if arch == "qwen2-moe-shared-expert":
        assert config.sparse_layers == (True, False, True)
        assert config.shared_expert_intermediate_size == 96
    if arch == "qwen3-moe":
        assert config.sparse_layers == (False, True, False) and config.norm_topk_prob
    if arch == "olmoe":
        # q/k normed over the whole projection
        assert attention.q_norm.weight.shape == (config.num_heads * config.head_dim,)
        assert config.clip_qkv == 1.5
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ours = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, ours, strict=True):
        assert out.outputs[0].token_ids == reference_tokens(reference, prompt), arch
    llm.engine.block_manager.check_no_leaks()


def stepwise_reference(model, prompt: list[int]) -> list[int]:
    """Greedy decoding by transformers' model forward over its own KV cache, one token a
    step: its rotary embedding picks longrope's factors per forward pass, keys already in
    the cache staying as they were."""
    tokens = []
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(MAX_NEW_TOKENS):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(
                torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True
            )
    return tokens


def test_phi3_longrope_parity_across_the_switch(tmp_path):
    """Phi-3 128k's longrope on a tiny scale: short factors while a sequence's context is
    at most 32, long ones past it, cos/sin scaled by the attention factor. The 37-token
    prompt is long from its prefill on (transformers' generate agrees); the others cross
    the switch while decoding, their cached keys keeping the short factors, as transformers'
    forward does. (Its generate instead drops the cache at the crossing and recomputes the
    sequence: a different answer, checked here so the difference stays known.)"""
    reference = build("Phi3", LONGROPE, tmp_path)
    llm = load(tmp_path, enable_prefix_caching=False)
    scaling = dict(llm.engine.model_config.rope_scaling)
    assert scaling["original_max_position_embeddings"] == 32
    # max_position_embeddings / original = 8: sqrt(1 + ln 8 / ln 32)
    assert scaling["attention_factor"] == pytest.approx((1 + math.log(8) / math.log(32)) ** 0.5)
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ours = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)]
    assert ours == [stepwise_reference(reference, prompt) for prompt in PROMPTS]
    assert ours[0] == reference_tokens(reference, PROMPTS[0])
    assert ours[1] != reference_tokens(reference, PROMPTS[1])


def test_sliding_window_changes_the_answer(tmp_path):
    """The window is really applied: the same weights with the window removed from the
    config generate something else for a prompt longer than the window."""
    build("Mistral", {"sliding_window": WINDOW}, tmp_path)
    config_file = tmp_path / "config.json"
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def generate() -> list[int]:
        return load(tmp_path).generate([PROMPTS[0]], params)[0].outputs[0].token_ids

    windowed = generate()
    config_file.write_text(
        json.dumps(json.loads(config_file.read_text()) | {"sliding_window": None})
    )
    assert generate() != windowed


def test_generation_config_eos_list_ends_generation(tmp_path):
    reference = build("Qwen2", {}, tmp_path)
    expected = reference_tokens(reference, PROMPTS[0])
    stop_at = expected[5]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, stop_at]}))
    loaded = load_model(str(tmp_path), torch.float32)
    assert loaded.config.eos_token_ids == (2, stop_at)
    out = load(tmp_path).generate(
        [PROMPTS[0]], SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0)
    )
    first = expected.index(stop_at)
    assert out[0].outputs[0].token_ids == expected[: first + 1]
    assert out[0].outputs[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"model_type": "falcon"},
            r"model_type 'falcon' is not Llama-family; supported: .*"
            r"gemma2, gemma3, gemma3_text, gpt_oss, granitemoehybrid, lfm2, lfm2_moe, llama, mamba2, mistral, mixtral, "
            r"nemotron_h, olmoe, phi3, qwen2, qwen2_moe, qwen3, qwen3_5_moe_text, qwen3_5_text, qwen3_moe, "
            r"qwen3_next",
        ),
        (
            {"quantization_config": {"quant_method": "awq", "bits": 4}},
            r"quantization 'awq' is not supported; supported: float8 checkpoints .* unquantized",
        ),
    ],
)
def test_unsupported_model_type_and_quantization_are_refused(tmp_path, change, message):
    build("Qwen2", {}, tmp_path)
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | change))
    with pytest.raises(UnsupportedModelError, match=message):
        load_model(str(tmp_path), torch.float32)


def test_gemma2_logprobs_follow_the_final_logit_cap(tmp_path):
    """Soft-capping the final logits never changes the greedy token; it shows in the
    logprobs, which must be transformers' log-softmax of its capped logits."""
    family, extra = ARCHITECTURES["gemma2"]
    reference = build(family, extra, tmp_path)
    with torch.inference_mode():
        logits = reference(torch.tensor([PROMPTS[0]])).logits[0, -1]
    expected = torch.log_softmax(logits.float(), dim=-1)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5, ignore_eos=True)
    (token,) = llm.generate([PROMPTS[0]], params)[0].outputs[0].logprobs
    assert [t for t, _ in token.top_logprobs] == expected.topk(5).indices.tolist()
    for token_id, logprob in token.top_logprobs:
        assert abs(logprob - float(expected[token_id])) < 1e-4
