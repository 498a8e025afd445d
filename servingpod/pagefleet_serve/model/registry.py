"""The model families served: one table from Hugging Face `architectures` names (and
config.json `model_type`s, and llama.cpp's GGUF `general.architecture`s) to the model
class, imported only when asked for. Adding a family is a model file under `models/` and
a `register` line here (see docs/architecture.md, "How to add a model");
`pagefleet_serve.config`'s HF_MODEL_TYPES and GGUF_ARCHITECTURE_NAMES are the torch-free
copy the operator reads, kept equal to this table by the tests.
"""

import importlib
from dataclasses import dataclass

from torch import nn

from pagefleet_serve.model.config import ModelConfig
from pagefleet_serve.model.context import ModelContext, building
from pagefleet_serve.model_uri import UnsupportedModelError


@dataclass(frozen=True)
class Family:
    module: str  # importable module path
    cls: str


_FAMILIES: dict[str, Family] = {}  # architecture -> where its class is
_MODEL_TYPES: dict[str, str] = {}  # config.json model_type -> architecture
_GGUF: dict[str, str] = {}  # GGUF general.architecture -> architecture


def register(
    architecture: str,
    module: str,
    cls: str,
    model_types: tuple[str, ...] = (),
    gguf: tuple[str, ...] = (),
) -> None:
    """Serve checkpoints of `architecture` (and of each of `model_types`, and GGUF files of
    each of `gguf`) with `module`.`cls`."""
    _FAMILIES[architecture] = Family(module, cls)
    _MODEL_TYPES.update(dict.fromkeys(model_types, architecture))
    _GGUF.update(dict.fromkeys(gguf, architecture))


def _ours(name: str) -> str:
    return f"pagefleet_serve.model.models.{name}"


register("LlamaForCausalLM", _ours("llama"), "LlamaForCausalLM", ("llama",), ("llama",))
register("MistralForCausalLM", _ours("llama"), "LlamaForCausalLM", ("mistral",))
register("Qwen2ForCausalLM", _ours("qwen2"), "Qwen2ForCausalLM", ("qwen2",), ("qwen2",))
register("Qwen3ForCausalLM", _ours("qwen3"), "Qwen3ForCausalLM", ("qwen3",), ("qwen3",))
register("Phi3ForCausalLM", _ours("phi3"), "Phi3ForCausalLM", ("phi3",), ("phi3",))
register("Gemma2ForCausalLM", _ours("gemma2"), "Gemma2ForCausalLM", ("gemma2",), ("gemma2",))
register("Gemma3ForCausalLM", _ours("gemma3"), "Gemma3ForCausalLM", ("gemma3_text",), ("gemma3",))
register(
    "Gemma3ForConditionalGeneration",
    _ours("gemma3_vl"),
    "Gemma3ForConditionalGeneration",
    ("gemma3",),
)
register("MixtralForCausalLM", _ours("mixtral"), "MixtralForCausalLM", ("mixtral",))
register(
    "Qwen2MoeForCausalLM", _ours("qwen2_moe"), "Qwen2MoeForCausalLM", ("qwen2_moe",), ("qwen2moe",)
)
register(
    "Qwen3MoeForCausalLM", _ours("qwen3_moe"), "Qwen3MoeForCausalLM", ("qwen3_moe",), ("qwen3moe",)
)
register("OlmoeForCausalLM", _ours("olmoe"), "OlmoeForCausalLM", ("olmoe",))
register("GptOssForCausalLM", _ours("gpt_oss"), "GptOssForCausalLM", ("gpt_oss",))
register("Lfm2ForCausalLM", _ours("lfm2"), "Lfm2ForCausalLM", ("lfm2",))
register("Lfm2MoeForCausalLM", _ours("lfm2"), "Lfm2MoeForCausalLM", ("lfm2_moe",))
register("Mamba2ForCausalLM", _ours("mamba2"), "Mamba2ForCausalLM", ("mamba2",))
register(
    "GraniteMoeHybridForCausalLM",
    _ours("granite_hybrid"),
    "GraniteMoeHybridForCausalLM",
    ("granitemoehybrid",),
)
register("NemotronHForCausalLM", _ours("nemotron_h"), "NemotronHForCausalLM", ("nemotron_h",))
register("Qwen3NextForCausalLM", _ours("qwen3_next"), "Qwen3NextForCausalLM", ("qwen3_next",))
register("Qwen3_5ForCausalLM", _ours("qwen3_next"), "Qwen3NextForCausalLM", ("qwen3_5_text",))
register(
    "Qwen3_5MoeForCausalLM", _ours("qwen3_next"), "Qwen3NextForCausalLM", ("qwen3_5_moe_text",)
)


def model_types() -> tuple[str, ...]:
    return tuple(sorted(_MODEL_TYPES))


def gguf_architectures() -> tuple[str, ...]:
    return tuple(sorted(_GGUF))


def model_class(architecture: str) -> type[nn.Module]:
    family = _FAMILIES[architecture]
    return getattr(importlib.import_module(family.module), family.cls)


def hf_architecture(hf: dict) -> str | None:
    """The registered architecture of a config.json dict: its model_type's (which names
    the family: a Qwen2 checkpoint relabelled `falcon` is not served), or where it has none
    its `architectures` entry's; None when it is not served."""
    if "model_type" in hf:
        return _MODEL_TYPES.get(hf["model_type"])
    return next((name for name in hf.get("architectures") or () if name in _FAMILIES), None)


def gguf_architecture(name: str | None) -> str | None:
    return _GGUF.get(name)


def build_model(config: ModelConfig, context: ModelContext) -> nn.Module:
    """The model of `config`'s architecture, its layers built for `context` (the kernel
    backend, this rank's part, the parameters' dtype); its weights are not loaded."""
    if config.architecture not in _FAMILIES:
        raise UnsupportedModelError(f"architecture {config.architecture!r} is not registered")
    with building(context):
        return model_class(config.architecture)(config)
