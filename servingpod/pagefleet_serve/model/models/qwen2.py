"""Qwen2 / Qwen2.5: Llama's maths with biases on q, k and v (never on o), and the Qwen
configs' sliding window (`use_sliding_window`, from layer `max_window_layers` on)."""

from dataclasses import dataclass

from pagefleet_serve.model.config import ModelConfig
from pagefleet_serve.model.loader.gguf_names import GGUFLayout
from pagefleet_serve.model.models.llama import LlamaForCausalLM


class QwenSliding:
    """How every Qwen config says which layers slide (a mixin of their configs)."""

    @classmethod
    def sliding_fields(cls, hf: dict) -> dict:
        if not hf.get("use_sliding_window", False):
            return {}
        return super().sliding_fields(hf)  # type: ignore[misc]

    @classmethod
    def sliding_layer_types(cls, hf: dict) -> list[str]:
        """Older configs: from layer max_window_layers on."""
        first = hf.get("max_window_layers", 0)
        kinds = ("full_attention", "sliding_attention")
        return [kinds[i >= first] for i in range(hf["num_hidden_layers"])]


@dataclass(frozen=True)
class Qwen2Config(QwenSliding, ModelConfig):
    @classmethod
    def family_fields(cls, hf: dict) -> dict:
        return {"qkv_bias": True, "o_bias": False}


class Qwen2ForCausalLM(LlamaForCausalLM):
    config_class = Qwen2Config
    gguf = GGUFLayout()
