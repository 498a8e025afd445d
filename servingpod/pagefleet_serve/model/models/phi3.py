"""Phi-3: Llama's maths (with longrope on its 128k-context models, see layers.rotary), from
checkpoints that hold q/k/v and gate/up fused already: `qkv_proj` and `gate_up_proj` load
whole (shard id None), each rank cutting its heads and its part of both halves."""

from pagefleet_serve.model.loader.gguf_names import GGUFLayout
from pagefleet_serve.model.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    gguf = GGUFLayout(tensors=(("attn_qkv", "self_attn.qkv_proj"), ("ffn_up", "mlp.gate_up_proj")))
