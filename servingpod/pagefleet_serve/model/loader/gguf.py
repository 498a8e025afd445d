"""GGUF files: the metadata as a Hugging Face config, the tensors under Hugging Face names
(each family's `GGUFLayout` says where its files differ), read as the weight loaders take
them.

Q4_0/Q4_1/Q8_0 matrices are kept quantized with `quantization="auto"` (the model multiplies
their codes), everything else is dequantized into the parameters' dtype, a slice of rows at
a time. A tensor-parallel rank reads its own rows, or whole blocks of its columns
(`GGUFWeight.cut`).
"""

from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from pagefleet_serve.model.config import ModelConfig
from pagefleet_serve.model.layers.rotary import rope_scaling
from pagefleet_serve.model.loader.gguf_names import CONFIG_KEYS, GLOBAL_NAMES, LAYER_NAMES
from pagefleet_serve.model.quant import (
    GGUF_BLOCK_BYTES,
    QuantizedWeight,
    dequantize_gguf,
    from_gguf,
)
from pagefleet_serve.model.registry import gguf_architecture, gguf_architectures, model_class
from pagefleet_serve.model.uri import UnsupportedModelError
from pagefleet_serve.model.weights import Ranges, take

# GGUF block types kept quantized with quantization="auto".
GGUF_KEPT_QUANTIZED = ("Q4_0", "Q4_1", "Q8_0")
_LONGROPE = {
    "rope_factors_short.weight": "short_factor",
    "rope_factors_long.weight": "long_factor",
}
# Rows of a GGUF tensor dequantized at a time (a few MiB of float32 for a wide matrix).
_DEQUANTIZE_ROWS = 2048


def is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


@dataclass(frozen=True)
class GGUFWeight:
    """A GGUF tensor's mapped data (or a part of it), not read yet: kept quantized, or
    dequantized less `offset` (Gemma's norms); q/k rows interleaved by llama.cpp are put
    back in Hugging Face's order per head of `head_dim` rows when read."""

    tensor: object  # gguf_file.GGUFTensor
    data: np.ndarray
    kept_quantized: bool
    offset: float = 0.0
    head_dim: int | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return _gguf_shape(self.tensor, self.data)

    def cut(self, dim: int, ranges: Ranges) -> "GGUFWeight":
        """Whole rows, or whole blocks of its columns (ValueError where a cut would split a
        block)."""
        import gguf

        data = self.data
        if dim == data.ndim - 1 and data.dtype == np.uint8:  # columns, in bytes of whole blocks
            block, block_bytes = gguf.GGML_QUANT_SIZES[self.tensor.tensor_type]
            if any(first % block or end % block for first, end in ranges):
                raise ValueError(
                    f"{self.tensor.name}: its columns {ranges} for this tensor-parallel rank "
                    f"would split its {block}-weight quantized blocks"
                )
            ranges = [(a // block * block_bytes, b // block * block_bytes) for a, b in ranges]
        return replace(self, data=np.ascontiguousarray(take(data, dim, ranges, cat=np.concatenate)))

    def dequantized(self) -> "GGUFWeight":
        return replace(self, kept_quantized=False)

    def _rows(self) -> np.ndarray:
        if self.head_dim is None:
            return self.data
        return np.ascontiguousarray(_unpermute(self.data, self.data.shape[0] // self.head_dim))

    def load(self, dtype: torch.dtype) -> torch.Tensor | QuantizedWeight:
        data, type_name = self._rows(), self.tensor.tensor_type.name
        if not self.kept_quantized:
            return _dequantize(self.tensor, dtype, self.offset, None, data)
        if data.ndim == 3:  # (experts, rows, bytes)
            return QuantizedWeight.stack([from_gguf(e, type_name) for e in data])
        return from_gguf(data, type_name)

    def load_into(self, out: torch.Tensor) -> None:
        _dequantize(self.tensor, out.dtype, self.offset, out, self._rows())


@dataclass
class GGUFCheckpoint:
    config: ModelConfig
    weights: Iterator[tuple[str, GGUFWeight]]


def open_gguf(path: Path, supported: str, keep_quantized: bool) -> GGUFCheckpoint:
    """The config of a GGUF file, and its tensors to walk (once), each tensor's pages given
    back once its weight loader has read it."""
    import gguf

    from pagefleet_serve.model.loader.gguf_file import GGUFFile

    reader = GGUFFile(path)
    arch = reader.fields.get("general.architecture")
    architecture = gguf_architecture(arch)
    if architecture is None:
        raise UnsupportedModelError(
            f"{path.name}: GGUF architecture {arch!r} is not supported; supported GGUF "
            f"architectures: {', '.join(gguf_architectures())} (any {supported})"
        )
    hf = _gguf_config(reader, arch)
    layout = model_class(architecture).gguf
    if layout.with_experts is not None and hf.get("num_experts"):
        architecture = layout.with_experts
    cls = model_class(architecture)
    layout = cls.gguf
    hf |= dict(layout.config)
    if layout.query_scale_by_hidden_layers == hf["num_hidden_layers"]:
        hf["query_pre_attn_scalar"] = hf["hidden_size"] // hf["num_attention_heads"]
    hf.setdefault("tie_word_embeddings", all(t.name != "output.weight" for t in reader.tensors))
    layer_names = LAYER_NAMES | dict(layout.tensors)
    keys, rope_freqs = {}, None  # tensor name -> Hugging Face name, for the weights
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        if tensor.name == "rope_freqs.weight":  # llama 3: a divisor per frequency
            rope_freqs = tuple(gguf.quants.dequantize(tensor.data, tensor.tensor_type).tolist())
        elif tensor.name in _LONGROPE:  # Phi-3 128k: its short and long factors
            factors = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            hf.setdefault("rope_scaling", {"rope_type": "longrope"})
            hf["rope_scaling"][_LONGROPE[tensor.name]] = tuple(factors.tolist())
        elif tensor.name in GLOBAL_NAMES:
            keys[tensor.name] = GLOBAL_NAMES[tensor.name]
        elif len(parts) == 4 and parts[0] == "blk" and parts[2] in layer_names:
            keys[tensor.name] = f"layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
        else:
            raise UnsupportedModelError(
                f"{path.name}: unexpected tensor {tensor.name!r} for GGUF architecture {arch!r}"
            )
    scaling = rope_scaling(hf, path)
    if rope_freqs is not None:
        scaling = (("divisors", rope_freqs), ("rope_type", "freqs"))
    eos = reader.fields.get("tokenizer.ggml.eos_token_id")
    hf["vocab_size"] = next(
        _gguf_shape(t)[0] for t in reader.tensors if t.name == "token_embd.weight"
    )
    hf["bos_token_id"] = reader.fields.get("tokenizer.ggml.bos_token_id")
    config = cls.config_class.from_hf(hf, scaling, () if eos is None else (eos,), architecture)
    return GGUFCheckpoint(config, _weights(reader, keys, layout, config.head_dim, keep_quantized))


def _weights(reader, keys: dict, layout, head_dim: int, keep_quantized: bool):
    for tensor in reader.tensors:
        key = keys.get(tensor.name)
        if key is None:
            continue
        kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else None
        permuted = layout.permuted_qk and kind in ("attn_q", "attn_k")
        yield (
            key,
            GGUFWeight(
                tensor,
                tensor.data,
                keep_quantized and tensor.tensor_type.name in GGUF_KEPT_QUANTIZED,
                layout.norm_offset if key.endswith("norm.weight") else 0.0,
                head_dim if permuted else None,
            ),
        )
        reader.release(tensor)


def _gguf_shape(tensor, data: np.ndarray | None = None) -> tuple[int, ...]:
    """The shape of a GGUF tensor's numbers (its data holds bytes when block-quantized), or
    of `data`, a part of its data."""
    import gguf

    data = tensor.data if data is None else data
    if data.dtype != np.uint8:
        return data.shape
    return gguf.quants.quant_shape_from_byte_shape(data.shape, tensor.tensor_type)


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
    out = out.view(_gguf_shape(tensor, data))  # llama.cpp's vectors of (1, n) weights
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
    hf = {}
    for key, hf_key in CONFIG_KEYS.items():
        value = reader.fields.get(f"{arch}.{key}")
        if value is not None:
            hf[hf_key] = value
    hf.setdefault("num_key_value_heads", hf["num_attention_heads"])
    original = reader.fields.get(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        hf["original_max_position_embeddings"] = original
    attention_factor = reader.fields.get(f"{arch}.rope.scaling.attn_factor")
    if attention_factor is not None:  # longrope's (Phi-3 128k); read by rotary._longrope
        hf["rope_attention_factor"] = attention_factor
    scaling = reader.fields.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        hf["rope_scaling"] = {
            "rope_type": scaling,
            "factor": float(reader.fields.get(f"{arch}.rope.scaling.factor", 1.0)),
        }
    return hf
