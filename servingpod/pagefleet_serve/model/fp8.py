"""FP8 checkpoints as they are published: which `quantization_config`s are float8 weights
with scales, and the weights those scales stand for.

Three formats name their tensors alike (`<module>.weight` in float8 e4m3 beside a float32
scale) and differ in the scale's name and shape:

- `compressed-tensors` (llm-compressor, the `-FP8` / `-FP8-dynamic` checkpoints):
  `weight_scale`, one per tensor (shape () or (1,)) or one per output channel (out, 1);
  static activation scales (`input_scale`) are not needed to dequantize.
- `fbgemm_fp8`: `weight_scale`, per output channel (out, 1); `input_scale_ub` unused.
- `fp8` (transformers' fine-grained FP8, DeepSeek-V3 and Qwen3-FP8): `weight_scale_inv`,
  one per `weight_block_size` block of the matrix; despite its name the weight is
  `float8 * weight_scale_inv`.

With `quantization="fp8"` (what `auto` means on CUDA) the per-tensor and per-channel
formats stay float8: `kept` hands each weight over with a scale per output row, and
`linear.Fp8Linear` multiplies it with `torch._scaled_mm`, the activations scaled to float8
per token as they come (dynamic scales). Otherwise (the CPU's default, and block-scaled
weights everywhere) the loader dequantizes each weight as it streams the checkpoint (one
tensor in float32 at a time) into the dtype the engine computes in, and the model runs as
the dequantized model does. Anything else in a `quantization_config` is refused by name.
"""

import math
from dataclasses import dataclass

import torch

from pagefleet_serve.model.quant import QuantizedWeight

# The scale of `<module>.weight`, by format.
SCALE_SUFFIX = {
    "compressed-tensors": ".weight_scale",
    "fbgemm_fp8": ".weight_scale",
    "fp8": ".weight_scale_inv",
}
# Tensors a float8 checkpoint carries that dequantizing does not read: static activation
# scales and bounds, and compressed-tensors' KV-cache scales (the engine measures its own).
UNUSED_SUFFIXES = (".input_scale", ".input_scale_ub", ".k_scale", ".v_scale")


class Fp8FormatError(ValueError):
    """A quantization_config this loader does not read, or tensors that do not fit it."""


@dataclass(frozen=True)
class Fp8Scheme:
    method: str  # a key of SCALE_SUFFIX
    block: tuple[int, int] | None = None  # fp8's weight_block_size (rows, columns)

    @property
    def scale_suffix(self) -> str:
        return SCALE_SUFFIX[self.method]

    def is_scale(self, name: str) -> bool:
        return name.endswith(self.scale_suffix)

    def is_unused(self, name: str) -> bool:
        return name.endswith(UNUSED_SUFFIXES)

    def weight_of(self, scale_name: str) -> str:
        return scale_name[: -len(self.scale_suffix)] + ".weight"


def fp8_scheme(quantization: dict) -> Fp8Scheme:
    """The float8 scheme of a config.json's `quantization_config`; Fp8FormatError naming
    what is not float8 weights with scales."""
    method = quantization.get("quant_method", "unknown")
    if method == "fbgemm_fp8":
        return Fp8Scheme(method)
    if method == "fp8":
        if quantization.get("fmt", "e4m3") != "e4m3":
            raise Fp8FormatError(f"fp8 fmt {quantization['fmt']!r}: only e4m3 is read")
        block = quantization.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(block) < 1):
            raise Fp8FormatError(f"fp8 weight_block_size {block!r} is not two positive sizes")
        return Fp8Scheme(method, None if block is None else (int(block[0]), int(block[1])))
    if method == "compressed-tensors":
        groups = quantization.get("config_groups") or {}
        if not groups:
            raise Fp8FormatError("compressed-tensors without config_groups")
        for name, group in groups.items():
            weights = group.get("weights") or {}
            kind = (weights.get("type"), weights.get("num_bits"), weights.get("strategy"))
            if kind[:2] != ("float", 8) or kind[2] not in ("tensor", "channel"):
                raise Fp8FormatError(
                    f"compressed-tensors group {name!r} has {kind[0]} {kind[1]}-bit weights "
                    f"with strategy {kind[2]!r}: only 8-bit float weights scaled per tensor or "
                    "per channel are read"
                )
            if weights.get("symmetric") is False:
                raise Fp8FormatError(f"compressed-tensors group {name!r}: asymmetric weights")
        return Fp8Scheme(method)
    raise Fp8FormatError(
        f"quantization {method!r} is not supported; supported: float8 checkpoints "
        "(compressed-tensors float-quantized, fbgemm_fp8, fp8), unquantized "
        "float32/float16/bfloat16 safetensors, or a GGUF file"
    )


def dequantize(
    name: str, weight: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme
) -> torch.Tensor:
    """`weight` (float8 e4m3, (out, in)) times its scale, in float32."""
    if weight.dtype != torch.float8_e4m3fn:
        raise Fp8FormatError(f"{name} has a scale but is {weight.dtype}, not float8_e4m3fn")
    values = weight.to(torch.float32)
    scale = scale.to(torch.float32)
    rows = values.shape[0]
    if scheme.block is None and scale.numel() == 1:
        return values * scale.reshape(())
    if scheme.block is None:
        if scale.numel() != rows or values.dim() != 2:
            raise Fp8FormatError(
                f"{name}: a scale of shape {tuple(scale.shape)} for a {tuple(values.shape)} "
                "weight is neither per tensor nor per output channel"
            )
        return values * scale.reshape(rows, 1)
    block_rows, block_columns = scheme.block
    columns = values.shape[1]
    expected = (math.ceil(rows / block_rows), math.ceil(columns / block_columns))
    if tuple(scale.shape) != expected:
        raise Fp8FormatError(
            f"{name}: a block scale of shape {tuple(scale.shape)} for a "
            f"{tuple(values.shape)} weight in {scheme.block} blocks (expected {expected})"
        )
    per_element = scale.repeat_interleave(block_rows, 0)[:rows]
    return values * per_element.repeat_interleave(block_columns, 1)[:, :columns]


def kept(
    name: str, weight: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme
) -> QuantizedWeight:
    """`weight` left in float8 with one float32 scale per output row (a per-tensor scale
    repeated), as `linear.Fp8Linear` multiplies it; block-scaled (`fp8`) weights are not
    kept (their scales vary along the input too): `dequantize` them."""
    if scheme.block is not None:
        raise Fp8FormatError(f"{name}: block-scaled float8 weights are dequantized, not kept")
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise Fp8FormatError(f"{name} has a scale but is {weight.dtype}, not float8_e4m3fn")
    rows, columns = weight.shape
    scale = scale.to(torch.float32)
    if scale.numel() == 1:
        scale = scale.reshape(1, 1).expand(rows, 1)
    elif scale.numel() != rows:
        raise Fp8FormatError(
            f"{name}: a scale of shape {tuple(scale.shape)} for a {tuple(weight.shape)} "
            "weight is neither per tensor nor per output channel"
        )
    return QuantizedWeight(
        codes=weight.contiguous(),
        scale=scale.reshape(rows, 1).contiguous(),
        zero=None,
        bits=8,
        group_size=columns,
    )
