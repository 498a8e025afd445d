"""GGUF files of every architecture we serve, written the way llama.cpp's converter writes
them (its tensor names from the gguf package, q/k rows permuted for llama's rope, Gemma's
norms stored as 1 + weight, the architecture's metadata keys), read by transformers'
GGUF integration and by PageFleet: greedy tokens identical for 48 tokens in float32.

Where transformers' GGUF mapping ignores a metadata key that llama.cpp writes (Qwen3's
key_length, Phi-3's sliding window, Gemma 2's soft-caps, Gemma's query scale, which
llama.cpp takes to be head_dim), the test hands
transformers the value from the file by hand, so both read the same model."""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch
from pagefleet_serve import SamplingParams
from pagefleet_serve.model.loader.model_loader import load_model
from pagefleet_serve.model.uri import UnsupportedModelError

from tests.engine.test_engine_architectures import (
    LONGROPE,
    MAX_NEW_TOKENS,
    PROMPTS,
    WINDOW,
    build,
    load,
    reference_tokens,
)

GEMMA = {"pad_token_id": 0, "tie_word_embeddings": True, "query_pre_attn_scalar": 16}
# name: (transformers family, its config, GGUF architecture, general.name, config values
# transformers must be told because its GGUF mapping does not read them)
CASES = {
    # A linear rope scaling in the metadata, which transformers does not read.
    "llama": (
        "Llama",
        {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}},
        "llama",
        "tiny-llama",
        {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}},
    ),
    # llama.cpp writes Mistral as `llama` (without its window). transformers would read a
    # file named "mistral" as Mistral, but its gguf-py lookup then fails: it reads Llama.
    "mistral": ("Mistral", {}, "llama", "tiny-mistral", {}),
    "qwen2": ("Qwen2", {}, "qwen2", "tiny-qwen2", {}),
    "qwen3": ("Qwen3", {}, "qwen3", "tiny-qwen3", {"head_dim": 16}),
    "phi3": (
        "Phi3",
        {"sliding_window": WINDOW, "pad_token_id": 0},
        "phi3",
        "tiny-phi3",
        {"sliding_window": WINDOW, "pad_token_id": 0},
    ),
    "gemma2": (
        "Gemma2",
        GEMMA | {"sliding_window": WINDOW, "attn_logit_softcapping": 1.0},
        "gemma2",
        "tiny-gemma2",
        {
            "attn_logit_softcapping": 1.0,
            "final_logit_softcapping": 30.0,
            "query_pre_attn_scalar": 16,
        },
    ),
    # llama.cpp's Gemma 3 pattern: every sixth layer global, the others sliding.
    "gemma3": (
        "Gemma3Text",
        GEMMA | {"sliding_window": WINDOW, "num_hidden_layers": 6},
        "gemma3",
        "tiny-gemma3",
        {"query_pre_attn_scalar": 16},
    ),
}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter: rows of each head interleaved for its GPT-J style rope."""
    shape = weight.shape
    return weight.reshape(num_heads, 2, shape[0] // num_heads // 2, *shape[1:]).swapaxes(1, 2)


def longrope_attention_factor(config) -> float:
    factor = config.max_position_embeddings / config.original_max_position_embeddings
    return math.sqrt(1 + math.log(factor) / math.log(config.original_max_position_embeddings))


def write_gguf(model, path, arch: str, name: str, expert_type=None) -> None:
    """`expert_type`: a gguf.GGMLQuantizationType for a mixture's stacked experts (float32
    when None)."""
    c = model.config

    def add_experts(tensor_name: str, data: np.ndarray) -> None:
        data = np.ascontiguousarray(data)
        if expert_type is None:
            writer.add_tensor(tensor_name, data)
        else:
            quantized = gguf.quants.quantize(data, expert_type)
            writer.add_tensor(
                tensor_name, quantized, raw_shape=quantized.shape, raw_dtype=expert_type
            )

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_embedding_length(c.hidden_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_bos_token_id(c.bos_token_id)
    writer.add_eos_token_id(c.eos_token_id)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if getattr(c, "sliding_window", None):
        writer.add_sliding_window(c.sliding_window)
    if getattr(c, "attn_logit_softcapping", None):
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
    if getattr(c, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if experts:  # a mixture, as llama.cpp's converter writes one
        writer.add_expert_count(experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_feed_forward_length(
            getattr(c, "moe_intermediate_size", None) or c.intermediate_size
        )
        if getattr(c, "shared_expert_intermediate_size", None):
            writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if rope["rope_type"] == "longrope":  # as llama.cpp's Phi-3 converter writes it
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_attn_factors(longrope_attention_factor(c))
        for kind in ("long", "short"):
            factors = np.array(rope[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(model_arch, c.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        data = tensor.float().numpy()
        if base.endswith(".mlp.experts"):  # transformers' stacked experts -> ffn_*_exps
            block = f"blk.{hf_name.split('.')[2]}"
            if suffix == "gate_up_proj":
                gate, up = np.split(data, 2, axis=1)
                add_experts(f"{block}.ffn_gate_exps.weight", gate)
                add_experts(f"{block}.ffn_up_exps.weight", up)
            else:
                add_experts(f"{block}.ffn_down_exps.weight", data)
            continue
        gguf_name = f"{names.get_name(base)}.{suffix}"
        if arch == "llama" and ".attn_q." in gguf_name:
            data = llama_cpp_permute(data, c.num_attention_heads)
        elif arch == "llama" and ".attn_k." in gguf_name:
            data = llama_cpp_permute(data, c.num_key_value_heads)
        elif arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            data = data + 1.0
        writer.add_tensor(gguf_name, np.ascontiguousarray(data.reshape(tensor.shape)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_greedy_parity_with_transformers(case, tmp_path):
    import transformers

    family, extra, arch, name, told = CASES[case]
    model = build(family, extra, tmp_path / "hf")
    path = tmp_path / f"{case}.gguf"
    write_gguf(model, path, arch, name)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager", **told
    ).eval()
    expected_type = "llama" if arch == "llama" else model.config.model_type
    assert reference.config.model_type == expected_type

    llm = load(path, max_num_batched_tokens=16, enable_prefix_caching=False)
    config = llm.engine.model_config
    if "sliding_window" in extra:
        assert config.sliding_window == WINDOW
    if case == "gemma3":
        assert config.sliding_layers == (True,) * 5 + (False,)
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True):
        assert out.outputs[0].token_ids == reference_tokens(reference, prompt), case
    llm.engine.block_manager.check_no_leaks()


def test_gguf_of_an_unsupported_architecture_names_the_supported_ones(tmp_path):
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        UnsupportedModelError,
        match=r"architecture 'falcon' is not supported; supported GGUF architectures: "
        r"gemma2, gemma3, llama, phi3, qwen2, qwen2moe, qwen3, qwen3moe",
    ):
        load_model(f"file://{path}", torch.float32)


def test_phi3_longrope_gguf_generates_what_its_directory_does(tmp_path):
    """transformers' GGUF loader ignores longrope's factor tensors; PageFleet reads them
    (and the original context length and attention factor) into the same rope as the
    Hugging Face directory of the model, itself tested against transformers."""
    model = build("Phi3", LONGROPE, tmp_path / "hf")
    path = tmp_path / "phi3-longrope.gguf"
    write_gguf(model, path, "phi3", "tiny-phi3-128k")
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = []
    for source in (path, tmp_path / "hf"):
        llm = load(source, enable_prefix_caching=False)
        scaling = dict(llm.engine.model_config.rope_scaling)
        assert (
            scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == 32
        )
        outputs.append([out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)])
    assert outputs[0] == outputs[1]
