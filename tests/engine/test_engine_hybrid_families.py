"""The hybrid families beyond LFM2 and Mamba2, each served over the state slots and
token-exact against transformers' own class: a tiny random checkpoint (hidden 64, random
norm weights so that every layer changes the next token) with every layer kind of its
family. A short and a 300-token prompt served in one batch (the long one prefilled in
chunks, the state carried across them) give transformers' greedy tokens; the 300-token
prompt again resumes from a state checkpoint (288 tokens skipped) with the same tokens.

The engine paths themselves (preemption, forks, aborts, the full pool) are the business of
`test_engine_hybrid.py`; here each family's maths over them."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine.test_engine_hybrid import (
    GREEDY,
    LONG,
    SHORT,
    TINY,
    assert_released,
    reference,
    save,
    serve,
)

# Every family's: 3 layers, hidden 64, 4 attention heads over 2 K/V heads, weights far from
# uniform logits (no greedy near-ties).
_COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _granite(**overrides):
    """Granite 4.0-H: Mamba2, attention, Mamba2 (2 groups, state 16, chunks of 32), the
    multipliers away from 1."""
    import transformers

    settings = _COMMON | dict(
        intermediate_size=32,
        shared_intermediate_size=48,
        layer_types=["mamba", "attention", "mamba"],
        mamba_n_heads=8,
        mamba_n_groups=2,
        mamba_d_state=16,
        mamba_d_head=16,
        mamba_chunk_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.2,
        logits_scaling=2.0,
    )
    return transformers.GraniteMoeHybridConfig(**(settings | overrides))


def _qwen3_next(model_type: str, **overrides):
    """Qwen3-Next's shape: Gated DeltaNet (2 key heads of 16, 4 value heads of 24),
    gated attention (heads of 16, rope on the first quarter), DeltaNet."""
    from transformers import AutoConfig

    settings = _COMMON | dict(
        intermediate_size=96,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=24,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        max_position_embeddings=512,
    )
    return AutoConfig.for_model(model_type, **(settings | overrides))


_EXPERTS = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)


def _nemotron_h():
    """Nemotron-H: Mamba2, MLP, attention, MLP (relu2 MLPs, 2 groups, chunks of 32)."""
    import transformers

    settings = _COMMON | dict(
        intermediate_size=96,
        head_dim=16,
        layer_types=["mamba", "mlp", "attention", "mlp"],
        mamba_num_heads=8,
        mamba_head_dim=16,
        n_groups=2,
        ssm_state_size=16,
        chunk_size=32,
    )
    del settings["num_hidden_layers"]  # the layer types' count
    return transformers.NemotronHConfig(**settings)


def _lfm2_moe():
    """LFM2-MoE: convolution, attention, convolution; a dense MLP on the first, experts
    (sigmoid router, a random expert bias that moves the choice) on the others."""
    import transformers

    settings = _COMMON | dict(
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_dense_layers=1,
        routed_scaling_factor=1.5,
        layer_types=["conv", "full_attention", "conv"],
        conv_L_cache=3,
        max_position_embeddings=512,
    )
    return transformers.Lfm2MoeConfig(**settings)


# name -> (the config, the layers with K/V, the layers with state slots)
FAMILIES = {
    # The experts and the shared MLP; attention without positions (Granite 4.0-H's).
    "granite-moe": (_granite, [1], [0, 2]),
    # No experts (granite-4.0-h-micro's shape): the shared MLP alone; rotary attention.
    "granite-dense": (
        lambda: _granite(num_local_experts=0, position_embedding_type="rope"),
        [1],
        [0, 2],
    ),
    # Experts and a shared expert on the first two layers, a dense MLP on the last.
    "qwen3-next": (
        lambda: _qwen3_next("qwen3_next", **_EXPERTS, mlp_only_layers=[2]),
        [1],
        [0, 2],
    ),
    "qwen3.5": (lambda: _qwen3_next("qwen3_5_text"), [1], [0, 2]),
    "qwen3.5-moe": (lambda: _qwen3_next("qwen3_5_moe_text", **_EXPERTS), [1], [0, 2]),
    "lfm2-moe": (_lfm2_moe, [1], [0, 2]),
    # The MLP blocks keep nothing: no K/V, no state.
    "nemotron-h": (_nemotron_h, [2], [0]),
}


def with_mtp_layer(file):
    """Add a tensor of a multi-token-prediction layer, as the released checkpoints of the
    families whose transformers class ignores them have: the engine skips it too."""
    tensors = load_file(file)
    tensors["mtp.fc.weight"] = torch.ones(64, 128)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(transformers model, engine) of one family's tiny checkpoint."""
    config, kv_layers, state_layers = FAMILIES[request.param]
    path, model = save(config(), tmp_path_factory.mktemp(request.param))
    if any("mtp" in key for key in model._keys_to_ignore_on_load_unexpected or ()):
        with_mtp_layer(path / "model.safetensors")
    llm = serve(path)
    yield model, llm, kv_layers, state_layers
    del llm


def test_greedy_parity_short_and_long_prompts_in_one_batch(family):
    model, llm, kv_layers, state_layers = family
    runner = llm.engine.runner
    assert runner.kv_layers == kv_layers
    assert [i for i, specs in enumerate(runner.state_specs) if specs] == state_layers
    caches = runner.kv_caches
    assert [i for i, cache in enumerate(caches) if isinstance(cache, dict)] == state_layers
    assert runner.kv_cache.shape[0] == len(kv_layers)  # the K/V of these layers alone
    outs = llm.generate([SHORT, LONG, TINY], GREEDY)
    for prompt, out in zip([SHORT, LONG, TINY], outs, strict=True):
        assert out.outputs[0].token_ids == reference(model, prompt)
    assert_released(llm)


def test_the_long_prompt_again_resumes_from_a_state_checkpoint(family):
    model, llm, _, _ = family
    llm.generate([LONG], GREEDY)  # its checkpoint, whatever ran before
    before = llm.stats().prefix_cache_hits
    (out,) = llm.generate([LONG], GREEDY)
    assert llm.stats().prefix_cache_hits - before == 288
    assert out.outputs[0].token_ids == reference(model, LONG)
    assert_released(llm)


def test_qwen3_next_configs_without_layer_types_follow_the_attention_interval():
    """The released Qwen3-Next config.json files predate `layer_types`: every
    `full_attention_interval`-th layer is attention, as transformers reads them."""
    import transformers
    from pagefleet_serve.model.models.qwen3_next import Qwen3NextConfig

    for interval in (4, 3):
        theirs = transformers.Qwen3NextConfig(num_hidden_layers=8, full_attention_interval=interval)
        hf = theirs.to_dict()
        del hf["layer_types"]
        hf["full_attention_interval"] = interval
        assert Qwen3NextConfig.family_fields(hf)["layer_types"] == tuple(theirs.layer_types)


def test_nemotron_h_configs_with_the_pattern_string_read_alike():
    """Older Nemotron-H config.json files give the layers as `hybrid_override_pattern`
    (M Mamba2, * attention, - MLP): the same layers as transformers' layer types."""
    import transformers
    from pagefleet_serve.model.models.nemotron_h import NemotronHConfig

    theirs = transformers.NemotronHConfig(hybrid_override_pattern="M-M*-M")
    hf = theirs.to_dict()
    ours = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp"}
    expected = tuple(ours[kind] for kind in theirs.layer_types)
    assert expected == ("mamba", "mlp", "mamba", "attention", "mlp", "mamba")
    for key in ("layer_types", "layers_block_type"):
        hf.pop(key, None)
    hf["hybrid_override_pattern"] = "M-M*-M"
    assert NemotronHConfig.family_fields(hf)["layer_types"] == expected
