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
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import torch

from pagefleet_serve.model.config import ModelConfig
from pagefleet_serve.model_uri import ModelURIError, parse_model_uri

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
# A PEFT config is about a kilobyte.
MAX_CONFIG_BYTES = 1 << 20
_TENSOR = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)


class LoRAError(ValueError):
    """An adapter that cannot be served, or an adapter operation refused; `status` is the
    HTTP status the API answers with (400: the adapter or the request is at fault)."""

    status = 400


class LoRAFileError(LoRAError):
    """An adapter's files that cannot be read as one: missing, not regular files, too
    large, or outside the allowed root. The message names the server's paths (for its
    log); a client that chose the path is told only `public_message`."""

    def public_message(self, uri: str) -> str:
        shown = uri if len(uri) <= 200 else f"{uri[:200]}..."
        return (
            f"adapter {shown!r}: is not an adapter directory this server may read "
            f"({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}, regular files of bounded size, "
            "under --allowed-lora-root)"
        )


class LoRAFull(LoRAError):
    """As many adapters served as the server allows (--max-lora-adapters)."""

    status = 429


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
    allowed_root: str | None = None  # a read back stays under it, as the first read did


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter read into host memory, checked against the model."""

    name: str
    lora_id: int  # unique in the process: a reloaded name gets a new one (prefix cache)
    path: str  # as given
    rank: int
    # (layer, module, part) -> (A (r, in), scale * B (out of the part, r)), float32
    weights: dict[tuple[int, str, int | None], tuple[torch.Tensor, torch.Tensor]]
    allowed_root: str | None = None  # where it was read from must lie under this


def resolve_adapter(uri: str, allowed_root: str | None = None) -> Path:
    """The local directory of an adapter: a path, file://, pvc:// (mounted) or hf://
    (downloaded into the Hugging Face cache, its adapter files only). A local one must lie
    under `allowed_root` when one is given, symlinks followed. LoRAError."""
    try:
        parsed = parse_model_uri(uri)
        if parsed.scheme == "builtin":
            raise LoRAError(f"{uri!r} is a built-in model, not a LoRA adapter")
        if parsed.scheme == "hf":
            return _download(parsed.repo_id, parsed.revision, uri)
        from pagefleet_serve.model.loader.resolve import resolve_model_uri

        path = resolve_model_uri(uri).path
    except ModelURIError as exc:
        raise LoRAFileError(f"adapter {uri!r}: {exc}") from None
    if path is None or not path.is_dir():
        raise LoRAFileError(f"adapter {uri!r}: {path} is not a directory holding {ADAPTER_CONFIG}")
    if allowed_root is not None:
        _check_under(path, allowed_root)
    return path


def _check_under(path: Path, allowed_root: str) -> None:
    root = Path(allowed_root).resolve()
    if not path.resolve().is_relative_to(root):
        raise LoRAFileError(f"{path} is not under the allowed root {root} (symlinks followed)")


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
    name: str,
    lora_id: int,
    uri: str,
    config: ModelConfig,
    max_rank: int,
    allowed_root: str | None = None,
) -> LoRAAdapter:
    """Read and check a PEFT adapter for a model of `config`; LoRAError saying what is
    wrong (a rank over `max_rank` included), LoRAFileError for files it may not read."""
    path = resolve_adapter(uri, allowed_root)
    where = f"adapter {name!r}: {ADAPTER_CONFIG}"
    settings = _read_config(path / ADAPTER_CONFIG, where, allowed_root)
    rank = settings.get("r")
    if type(rank) is not int or rank < 1:
        raise LoRAError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAError(
            f"adapter {name!r} has rank {rank}, more than the server's max_lora_rank "
            f"{max_rank} (--max-lora-rank)"
        )
    alpha = settings.get("lora_alpha", 8)
    if type(alpha) not in (int, float) or not math.isfinite(alpha) or alpha <= 0:
        raise LoRAError(f"{where}: lora_alpha must be a positive finite number, got {alpha!r}")
    rslora = settings.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise LoRAError(f"{where}: use_rslora must be true or false, got {rslora!r}")
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    limit = _max_weights_bytes(config, max_rank)
    tensors = _read_tensors(path / ADAPTER_WEIGHTS, limit, allowed_root)
    weights = _pair(tensors, config, rank, scale, f"adapter {name!r}: {ADAPTER_WEIGHTS}")
    return LoRAAdapter(name, lora_id, uri, rank, weights, allowed_root)


def _read_file(file: Path, limit: int, allowed_root: str | None) -> bytes:
    """A regular file's bytes, at most `limit` of them. Opened without blocking and checked
    before a byte is read: a FIFO or a device (a symlink to /dev/zero) is refused, never
    read. LoRAFileError."""
    if allowed_root is not None:
        _check_under(file, allowed_root)
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        other = (
            " (adapter_model.bin, PyTorch's pickle, is not read)"
            if file.name == ADAPTER_WEIGHTS and file.with_suffix(".bin").exists()
            else ""
        )
        raise LoRAFileError(f"{file} does not exist{other}") from None
    except OSError as exc:
        raise LoRAFileError(f"cannot read {file}: {exc}") from None
    with os.fdopen(fd, "rb") as opened:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise LoRAFileError(f"{file} is not a regular file")
        if info.st_size > limit:
            raise LoRAFileError(f"{file} has {info.st_size} bytes, more than {limit}")
        try:
            data = opened.read(limit + 1)
        except OSError as exc:
            raise LoRAFileError(f"cannot read {file}: {exc}") from None
    if len(data) > limit:
        raise LoRAFileError(f"{file} grew past {limit} bytes while read")
    return data


def _max_weights_bytes(config: ModelConfig, max_rank: int) -> int:
    """The largest adapter file this model can have: every module of every layer adapted
    at `max_rank` in float64, and a header's worth more."""
    per_layer = sum(
        fan_in * len(outs) + sum(outs) for fan_in, outs in fused_layout(config).values()
    )
    return config.num_layers * max_rank * per_layer * 8 + (1 << 20)


def _read_config(file: Path, where: str, allowed_root: str | None) -> dict:
    try:
        settings = json.loads(_read_file(file, MAX_CONFIG_BYTES, allowed_root))
    except ValueError as exc:
        if isinstance(exc, LoRAError):
            raise
        raise LoRAError(f"{where}: not JSON: {exc}") from None
    if not isinstance(settings, dict):
        raise LoRAError(f"{where}: expected a JSON object")
    refused = {
        "use_dora": "DoRA adapters",
        "fan_in_fan_out": "transposed (fan_in_fan_out) weights",
        "modules_to_save": "modules_to_save (whole layers saved beside the adapter)",
        "rank_pattern": "a rank_pattern (ranks per module)",
        "alpha_pattern": "an alpha_pattern (alphas per module)",
    }
    for key, what in refused.items():
        if settings.get(key):
            shown = repr(settings[key])[:200]
            raise LoRAError(f"{where}: {what} are not supported ({key}: {shown})")
    if settings.get("bias", "none") != "none":
        raise LoRAError(f"{where}: bias {settings['bias']!r:.200} is not supported, only 'none'")
    return settings


def _read_tensors(file: Path, limit: int, allowed_root: str | None) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    data = _read_file(file, limit, allowed_root)
    try:
        tensors = load(data)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise LoRAError(f"{file.name}: not a safetensors file: {exc}") from None
    for key, tensor in tensors.items():
        if not tensor.is_floating_point():
            raise LoRAError(
                f"{file.name}: tensor {key!r} is {str(tensor.dtype).removeprefix('torch.')}; "
                "LoRA weights are floating point"
            )
    return tensors


def _pair(
    tensors: dict[str, torch.Tensor], config: ModelConfig, rank: int, scale: float, file: str
) -> dict[tuple[int, str, int | None], tuple[torch.Tensor, torch.Tensor]]:
    """The file's A and B tensors, paired per (layer, module, part) and checked: shapes
    that fit the model, weights finite once scaled (NaN, or an overflowing lora_alpha,
    would fail every request of the adapter)."""
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
        a, b = a.float(), b.float() * scale
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoRAError(
                f"{where}: weights are not finite once scaled by lora_alpha / r ({scale:g})"
            )
        weights[(layer, module, part)] = (a, b)
    if not weights:
        raise LoRAError(f"{file}: holds no LoRA tensors")
    return weights
