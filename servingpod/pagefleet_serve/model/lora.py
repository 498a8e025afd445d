"""LoRA adapters in PEFT's format: read, checked against the model, and named.

An adapter is a directory: `adapter_config.json` (r, lora_alpha, use_rslora, ...) and
`adapter_model.safetensors` (for each adapted projection of each layer, A (r, in) and
B (out, r)). Its delta on a projection's output is scale * B @ A @ x, scale = lora_alpha / r
(lora_alpha / sqrt(r) with rsLoRA): what PEFT's `merge_and_unload` adds to the weight.

The model multiplies q/k/v and gate/up as one fused matrix each, and an adapter is read
as the parts of those it adapts (`fused_layout`); the device slots and the layers' wrappers
that add the deltas are `model.layers.lora`'s. The adapter's scale is folded into B once,
here.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from pagefleet_serve.model.config import ModelConfig
from pagefleet_serve.model.uri import ModelURIError, parse_model_uri

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT's target module -> the model's linear it adapts and which part of it (None: all of
# it, for checkpoints whose projections come fused, as Phi-3's).
TARGETS: dict[str, tuple[str, int | None]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "qkv_proj": ("qkv_proj", None),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "gate_up_proj": ("gate_up_proj", None),
    "down_proj": ("down_proj", 0),
}
_TENSOR = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)


class LoRAError(ValueError):
    """An adapter that cannot be served, or an adapter operation refused; `status` is the
    HTTP status the API answers with (400: the adapter or the request is at fault)."""

    status = 400


class LoRANotFound(LoRAError):
    status = 404


class LoRABusy(LoRAError):
    status = 409


def fused_layout(config: ModelConfig) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Each adaptable linear of a layer: (its inputs, the outputs of each of its parts)."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inner = config.hidden_size, config.intermediate_size
    return {
        "qkv_proj": (hidden, (q, kv, kv)),
        "o_proj": (q, (hidden,)),
        "gate_up_proj": (hidden, (inner, inner)),
        "down_proj": (inner, (hidden,)),
    }


@dataclass(frozen=True)
class ServedLoRA:
    """An adapter served by name, in host memory or not: its id and where it is read from
    (again, when host memory has dropped it)."""

    name: str
    lora_id: int
    path: str


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter read into host memory, checked against the model."""

    name: str
    lora_id: int  # unique in the process: a reloaded name gets a new one (prefix cache)
    path: str  # as given
    rank: int
    # (layer, module, part) -> (A (r, in), scale * B (out of the part, r)), float32
    weights: dict[tuple[int, str, int | None], tuple[torch.Tensor, torch.Tensor]]


def resolve_adapter(uri: str) -> Path:
    """The local directory of an adapter: a path, file://, pvc:// (mounted) or hf://
    (downloaded into the Hugging Face cache, its adapter files only). LoRAError."""
    try:
        parsed = parse_model_uri(uri)
        if parsed.scheme == "builtin":
            raise LoRAError(f"{uri!r} is a built-in model, not a LoRA adapter")
        if parsed.scheme == "hf":
            return _download(parsed.repo_id, parsed.revision, uri)
        from pagefleet_serve.model.loader.resolve import resolve_model_uri

        path = resolve_model_uri(uri).path
    except ModelURIError as exc:
        raise LoRAError(f"adapter {uri!r}: {exc}") from None
    if path is None or not path.is_dir():
        raise LoRAError(f"adapter {uri!r}: {path} is not a directory holding {ADAPTER_CONFIG}")
    return path


def _download(repo_id: str | None, revision: str | None, uri: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                repo_id, revision=revision, allow_patterns=[ADAPTER_CONFIG, ADAPTER_WEIGHTS]
            )
        )
    except Exception as exc:  # noqa: BLE001 - huggingface_hub raises its HTTP client's errors
        raise LoRAError(f"adapter {uri!r} could not be downloaded: {exc}") from None


def read_adapter(
    name: str, lora_id: int, uri: str, config: ModelConfig, max_rank: int
) -> LoRAAdapter:
    """Read and check a PEFT adapter for a model of `config`; LoRAError naming the file
    and what is wrong (a rank over `max_rank` included)."""
    path = resolve_adapter(uri)
    settings = _read_config(path / ADAPTER_CONFIG)
    rank = settings.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"{path / ADAPTER_CONFIG}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAError(
            f"adapter {name!r} has rank {rank}, more than the server's max_lora_rank "
            f"{max_rank} (--max-lora-rank)"
        )
    alpha = settings.get("lora_alpha", 8)
    scale = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    tensors = _read_tensors(path / ADAPTER_WEIGHTS)
    return LoRAAdapter(name, lora_id, uri, rank, _pair(tensors, config, rank, scale, path))


def _read_config(file: Path) -> dict:
    try:
        settings = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise LoRAError(f"cannot read {file}: {exc}") from None
    if not isinstance(settings, dict):
        raise LoRAError(f"{file}: expected a JSON object")
    refused = {
        "use_dora": "DoRA adapters",
        "fan_in_fan_out": "transposed (fan_in_fan_out) weights",
        "modules_to_save": "modules_to_save (whole layers saved beside the adapter)",
        "rank_pattern": "a rank_pattern (ranks per module)",
        "alpha_pattern": "an alpha_pattern (alphas per module)",
    }
    for key, what in refused.items():
        if settings.get(key):
            raise LoRAError(f"{file}: {what} are not supported ({key}: {settings[key]!r})")
    if settings.get("bias", "none") != "none":
        raise LoRAError(f"{file}: bias {settings['bias']!r} is not supported, only 'none'")
    return settings


def _read_tensors(file: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not file.exists():
        other = (
            " (adapter_model.bin, PyTorch's pickle, is not read)"
            if file.with_suffix(".bin").exists()
            else ""
        )
        raise LoRAError(f"{file} does not exist{other}")
    try:
        return load_file(file)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise LoRAError(f"cannot read {file}: {exc}") from None


def _pair(
    tensors: dict[str, torch.Tensor], config: ModelConfig, rank: int, scale: float, path: Path
) -> dict[tuple[int, str, int | None], tuple[torch.Tensor, torch.Tensor]]:
    """The file's A and B tensors, paired per (layer, module, part) and checked."""
    file = path / ADAPTER_WEIGHTS
    layout = fused_layout(config)
    found: dict[tuple[int, str, int | None], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR.search(key)
        target = TARGETS.get(match[2]) if match else None
        if match is None or target is None:
            raise LoRAError(
                f"{file}: tensor {key!r} adapts a module PageFleet does not adapt; "
                f"supported: {', '.join(TARGETS)} of each layer"
            )
        layer = int(match[1])
        if layer >= config.num_layers:
            raise LoRAError(f"{file}: tensor {key!r} is for layer {layer} of {config.num_layers}")
        if target[0] in ("gate_up_proj", "down_proj") and config.layer_is_sparse(layer):
            raise LoRAError(
                f"{file}: tensor {key!r} adapts the MLP of layer {layer}, a mixture of "
                "experts, which adapters do not reach (its attention they do)"
            )
        found.setdefault((layer, *target), {})[match[3]] = tensor
    weights = {}
    for (layer, module, part), pair in sorted(found.items(), key=str):
        where = f"{file}: layer {layer} {module}" + ("" if part is None else f" part {part}")
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"{where}: has lora_{''.join(pair)} without its other half")
        fan_in, outs = layout[module]
        fan_out = sum(outs) if part is None else outs[part]
        a, b = pair["A"], pair["B"]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise LoRAError(
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the "
                f"model (expected ({rank}, {fan_in}) and ({fan_out}, {rank}))"
            )
        weights[(layer, module, part)] = (a.float(), b.float() * scale)
    if not weights:
        raise LoRAError(f"{file}: holds no LoRA tensors")
    return weights
