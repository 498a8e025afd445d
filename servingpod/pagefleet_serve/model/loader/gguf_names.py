"""How a family's GGUF files name what its Hugging Face checkpoints name: llama.cpp's
per-layer tensor names and metadata keys, and what a family's `GGUFLayout` changes of
them. Torch-free data: each family file holds its own layout."""

from dataclasses import dataclass

# Per-layer GGUF tensor names -> Hugging Face names (both .weight and .bias).
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixtures: the router, every expert's matrix stacked in one (E, rows, columns) tensor
    # per projection (see layers.moe.FusedMoE), the shared expert and its gate.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
# GGUF metadata (after the `<arch>.` prefix) -> Hugging Face config.json keys.
CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.sliding_window": "sliding_window",
    "rope.freq_base": "rope_theta",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}


@dataclass(frozen=True)
class GGUFLayout:
    """What one family's GGUF files do differently from the tables above."""

    # llama.cpp interleaves q/k rows for its GPT-J style rope (llama); NEOX-rope
    # architectures keep Hugging Face's order.
    permuted_qk: bool = False
    # Gemma: llama.cpp stores (1 + weight) for every RMSNorm; we keep Hugging Face's weight.
    norm_offset: float = 0.0
    tensors: tuple[tuple[str, str], ...] = ()  # per-layer names that differ from LAYER_NAMES
    # config.json values llama.cpp implies for the architecture instead of storing them
    config: tuple[tuple[str, object], ...] = ()
    # The registry's architecture when the file has experts (llama.cpp writes Mixtral as
    # `llama`).
    with_experts: str | None = None
    # llama.cpp's Gemma 27B models scale queries by hidden/heads, the others by head_dim;
    # the GGUF does not say which, llama.cpp tells them by their layer count (this one).
    query_scale_by_hidden_layers: int | None = None
