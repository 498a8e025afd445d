"""The linear methods, one class per weight format: y = x W^T (+ bias), for a parallel
linear layer (`layers.linear`) whose weight is not a float matrix as it lies.

- `PrepackedLinear`: a float weight in oneDNN's blocked layout (CPU), made from a float
  layer by its `prepack`.
- `Int8RowLinear`: int8 codes with one scale per output row (weight-only int8).
- `Fp8Linear`: float8 e4m3 weights with a scale per output row (FP8 checkpoints kept in
  float8), multiplied by `torch._scaled_mm`.
- `Int4Linear`: 4-bit codes (GGUF's Q4_0/Q4_1); `Q8_0Linear`: GGUF's Q8_0, held as two
  4-bit parts (see `pagefleet_serve.model.quant`) plus, where the backend multiplies Q8_0
  codes itself, those codes.

A layer is built with a float weight; a quantized matrix the loader hands it makes it use
the quantized class of its format (`quantized_linear`), and prepacking a float one
`PrepackedLinear`. Each class keeps only the
layouts its own products read and chooses among its few paths (a few rows, a wide batch)
by the rows' count and dtype alone; which kernels it calls comes from the
`pagefleet_kernels.backend.KernelBackend` it was given, read once when it is built or its
tensors change (`.to()`, int8 activations, compilation), never per call.
"""

import torch
import torch.nn.functional as F
from pagefleet_kernels.backend import KernelBackend
from torch import nn

from pagefleet_serve.model.quant import INT4_OFFSET, QuantizedWeight

# The batch size oneDNN is told to expect when a weight is prepacked; any batch runs. 64
# measured as fast as 1 at one and eight rows and faster from 64 rows up.
PREPACK_BATCH_HINT = 64
# Up to this many float32 rows, a prepacked layer multiplies with its weight as it lies
# through the backend's `linear` (the C++ CPU ops), where it has one (see PrepackedLinear).
FEW_ROWS_NATIVE = 8
# From this many rows on, 4-bit weights are dequantized and multiplied as float (see
# Int4Linear). PyTorch's int4 matmul against dequantize + matmul, bfloat16, two threads
# (int4 / dequantized, ms): a 3072 x 576 Q4_1 matrix 0.79 / 0.84 at 32 rows, 1.69 / 1.28 at
# 64, 68.9 / 24.1 at 2,048; SmolLM2's 49152 x 576 Q8_0 head 30.3 / 47.7 at 32, 70.2 / 48.5
# at 64, 1,864 / 429 at 2,048.
DEQUANTIZE_ROWS = 64
# The same for float32 activations, which torch's int4 matmul takes through a scalar path
# (a 1536 x 576 matrix at one row: 1,129 us against 75 in bfloat16 on an AVX2 machine; 67
# ms at 64 rows). They go to the backend's own `int4_matmul` when it has one (the C++ CPU
# ops: 57 us there, 1.3x faster than the float32 matrix at one row, even at eight) and
# are dequantized from this many rows on, where oneDNN's float GEMM pulls ahead (0.8 ms
# against 0.4 at 32 rows). The fused decoder layer, made of those matmuls, takes fewer.
DEQUANTIZE_ROWS_FLOAT32 = 16
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def can_prepack(dtype: torch.dtype) -> bool:
    """Whether oneDNN here can prepack (and multiply) weights of `dtype` on the CPU: its
    bfloat16 and float16 paths need AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT, and on an
    AVX2-only CPU `_reorder_linear_weight` refuses them, so those weights stay unpacked."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return dtype == torch.float32


# -- float weights, prepacked --------------------------------------------------------------
class PrepackedLinear(nn.Module):
    """A float weight reordered once into oneDNN's blocked layout (CPU), multiplied by
    `torch.ops.mkldnn._linear_pointwise` (what inductor's CPU freezing uses; vLLM's CPU
    backend prepacks its oneDNN weights the same way). `F.linear` reorders the weight on
    every call: the 120 matmuls of a SmolLM2 decode step measured 1.9x / 1.9x / 1.4x / 1.1x
    faster prepacked at batch 1 / 8 / 64 / 2048 (bfloat16, identical results; float32
    1.3-2.0x, within rounding of MKL's).

    A float32 step of a few rows (decode at small batches) is bound by reading the weight,
    and oneDNN's prepacked matmul read it at 10-12 GB/s on a 2-core AVX2 EPYC that streams
    about twice that. Where the backend has a `linear` for such rows (the C++ CPU ops), a
    float32 weight is therefore kept as it lies next to its packed copy, and up to
    `FEW_ROWS_NATIVE` rows go to that kernel: a SmolLM2 step's 121 matmuls took 1.2-1.6x
    less time at 1-4 rows and 1.1-1.25x less at 8 (two runs), the same at 16, and more from
    32 rows on (oneDNN's blocking). The cost is memory: float32 layers held twice (SmolLM2:
    425 MB; a tied LM head is the embedding itself). Otherwise the weight is not kept (a
    weight another module shares, a tied embedding, lives on there)."""

    def __init__(self, linear: nn.Module, backend: KernelBackend) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, PREPACK_BATCH_HINT)
        self.bias = linear.bias_term
        # The backend's x @ weight.T for a few float32 rows, and the weight it reads.
        self.few_rows = backend.linear if weight.dtype == torch.float32 else None
        self.weight = linear.weight if self.few_rows is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.few_rows is not None and x.dim() == 2 and x.shape[0] <= FEW_ROWS_NATIVE:
            y = self.few_rows(x, self.weight)
            if y is not None:
                return y if self.bias is None else y + self.bias
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


# -- quantized weights (CPU only, float8 everywhere) ------------------------------------------
class QuantizedLinear(nn.Module):
    """What the quantized formats share: their shape, the bias (added after the product),
    and no binding for a fused decoder layer unless the format has a native matmul."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.group_size = weight.group_size
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def fused_binding(self):
        """The layer as the backend's fused decoder layer multiplies it (see
        `KernelBackend.fused_decoder_layer`), or None."""
        return None


def quantized_linear(
    weight: QuantizedWeight, bias: torch.Tensor | None, backend: KernelBackend
) -> QuantizedLinear:
    """The layer of `weight`'s format. Its tensors are buffers, not parameters, and not in
    the state dict: built from the checkpoint's codes at load, never loaded by name."""
    if weight.codes.dtype == torch.float8_e4m3fn:
        return Fp8Linear(weight, bias)
    if weight.bits == 4:
        return Int4Linear(weight, bias, backend)
    if weight.group_size != weight.shape[1]:
        return Q8_0Linear(weight, bias, backend)
    return Int8RowLinear(weight, bias)


class Fp8Linear(QuantizedLinear):
    """float8 e4m3 weights with one float32 scale per output row (an FP8 checkpoint's, see
    `pagefleet_serve.model.fp8`), multiplied in float8 by `torch._scaled_mm`: each row of
    x is scaled into float8's range by its own absolute maximum first (dynamic per-token
    scales, as the checkpoints' `dynamic` activations say), and the product is rescaled by
    both scales in float32. CUDA's rowwise-scaled product writes bfloat16 only, so other
    activation dtypes are computed in it there and cast; a shape the product does not take
    (dimensions not multiples of 16 on CUDA) multiplies the dequantized weight. The codes
    are held as uint8 bytes, so that `.to(dtype)` leaves them float8, and the scales stay
    float32."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        self.register_buffer("codes", weight.codes.view(torch.uint8), persistent=False)
        self.register_buffer("scale", weight.scale.reshape(1, -1).float(), persistent=False)

    @property
    def weight_fp8(self) -> torch.Tensor:
        return self.codes.view(torch.float8_e4m3fn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.is_cuda and (self.in_features % 16 or self.out_features % 16):
            w = self.weight_fp8.to(torch.float32) * self.scale.reshape(-1, 1)
            y = F.linear(flat, w.to(flat.dtype))
        else:
            x_scale = flat.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
            x_fp8 = (flat.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            out_dtype = torch.bfloat16 if flat.is_cuda else flat.dtype
            y = torch._scaled_mm(
                x_fp8,
                self.weight_fp8.t(),
                scale_a=x_scale,
                scale_b=self.scale,
                out_dtype=out_dtype,
            ).to(flat.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def _apply(self, fn, recurse=True):  # .to(dtype) would round the scales
        scale = self.scale
        super()._apply(fn, recurse)
        self.scale = scale.to(self.codes.device)
        return self

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, float8 e4m3 per row"


class Int8RowLinear(QuantizedLinear):
    """int8 codes with one float scale per output row: `torch._weight_int8pack_mm`."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        self.register_buffer("codes", weight.codes, persistent=False)
        self.register_buffer("scale", weight.scale[:, 0].contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        y = torch._weight_int8pack_mm(flat, self.codes, self.scale)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int8 per row"


def _int4_part(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int):
    """uint8 codes in [0, 15] (N, K) -> nibbles (N, K / 2) (in each group, byte j holds
    input j low and input j + group / 2 high) and PyTorch's (K / group, N, 2) scales and
    zeros for w = (code - 8) * scale + zero."""
    zero = torch.zeros_like(scale) if zero is None else zero
    halves = codes.view(codes.shape[0], -1, group).split(group // 2, dim=-1)
    nibbles = (halves[0] | (halves[1] << 4)).flatten(1)
    return nibbles, torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous()


def _codes(nibbles: torch.Tensor, group: int) -> torch.Tensor:
    """A part's nibbles (N, K / 2) -> its uint8 codes (N, K) (see `_int4_part`)."""
    halves = nibbles.view(nibbles.shape[0], -1, group // 2)
    return torch.cat((halves & 0x0F, halves >> 4), dim=-1).flatten(1)


class Int4Linear(QuantizedLinear):
    """4-bit codes in one or more parts summed (a Q8_0 matrix is two), held as nibbles with
    PyTorch's scales and zeros: (parts, N, K / 2) and (parts, K / group, N, 2).

    PyTorch's int4 matmul (`torch._weight_int4pack_mm_for_cpu`) reads its packed weight
    directly, which at a decode step's few rows is what makes 4-bit weights fast (a 3072 x
    576 matrix at one row: 51 us against 112 for bfloat16), but from 64 rows up it runs
    2.2-2.5x slower than a bfloat16 matmul. From `DEQUANTIZE_ROWS` rows on (a prefill chunk,
    a wide decode batch), the weight is therefore dequantized into the activations' dtype
    (the backend's `dequantize_int4`) and multiplied as a float matrix: 4-bit weights take
    one byte per weight instead of half a byte, still half of bfloat16's. Float32 rows,
    which PyTorch's int4 matmul takes through a slow scalar path, go to the backend's own
    `int4_matmul` (the C++ CPU ops) instead, below `DEQUANTIZE_ROWS_FLOAT32` rows: with
    that kernel the layer keeps its (scale, shift) layout and no packed copy.

    With `int8_activations` every product of the 4-bit weight takes x^, the activations
    rounded to int8 with one scale per 32 inputs (`quantize_activations_int8`), instead of
    x: the C++ matmul then multiplies the codes with integer dot products (as llama.cpp's
    Q4 x Q8 kernels do), 1.4-1.7x faster than converting each weight to float, and the
    other paths (wide batches, other backends) round x first, so every batch size computes
    with the same x^."""

    int8_activations = False
    # Inside torch.compile the backend's native kernels are opaque: torch's own multiply.
    compiled = False
    # The few-row kernels' layouts, built by `_bind` for the kernel it binds, None else:
    # torch's packed parts, or the backend's (scale, shift) pairs per part.
    LAYOUTS = ("packed", "scales_and_shifts")

    def __init__(
        self, weight: QuantizedWeight, bias: torch.Tensor | None, backend: KernelBackend
    ) -> None:
        super().__init__(weight, bias)
        self.backend = backend
        parts = [_int4_part(*part, self.group_size) for part in self._parts_of(weight)]
        nibbles, scales_and_zeros = zip(*parts, strict=True)
        self.register_buffer("nibbles", torch.stack(nibbles), persistent=False)
        self.register_buffer("scales_and_zeros", torch.stack(scales_and_zeros), persistent=False)
        for layout in self.LAYOUTS:
            self.register_buffer(layout, None, persistent=False)
        self._bind()

    @staticmethod
    def _parts_of(weight: QuantizedWeight) -> list[tuple]:
        """(codes, scale, zero) of each 4-bit part."""
        return [(weight.codes, weight.scale, weight.zero)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        wide = DEQUANTIZE_ROWS_FLOAT32 if flat.dtype == torch.float32 else DEQUANTIZE_ROWS
        y = self._few_rows(flat) if flat.shape[0] < wide else None
        if y is None:  # a wide batch, or rows the native kernel does not take (strided)
            if self.int8_activations:
                flat = self.backend.quantize_activations_int8(flat)
            y = F.linear(flat, self.dequantized().to(flat.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight (its parts summed) as a float matrix in the scales' dtype."""
        return self.backend.dequantize_int4(*self._parts, self.group_size)

    def round_activations_to_int8(self) -> None:
        """From now on, multiply x^ (see the class) instead of x."""
        self.int8_activations = True
        self._bind()

    def prepare_for_compile(self) -> None:
        """Multiply with PyTorch's own kernels, which torch.compile traces."""
        self.compiled = True
        self._bind()

    def _apply(self, fn, recurse=True):  # .to() and the like: new tensors, a new binding
        super()._apply(fn, recurse)
        self._bind()
        return self

    def _native_weights(self) -> dict | None:
        """The backend's own matmul for these weights: its layout, built here once, as the
        keyword arguments of `FusedDecoderLayer.bind_linear`; None where it has none (or
        the scales are no longer float32, or the layer is compiled)."""
        kernel = self.backend.int4_matmul
        if kernel is None or self.compiled or self.scales_and_zeros.dtype != torch.float32:
            self.scales_and_shifts = None
            return None
        if self.scales_and_shifts is None:
            shifts = [kernel.weight_layout(part) for part in self.scales_and_zeros]
            self.scales_and_shifts = torch.stack(shifts)
        return {
            "nibbles": tuple(self.nibbles.unbind(0)),
            "scales_and_shifts": tuple(self.scales_and_shifts.unbind(0)),
        }

    def _native_matmul(self, weights: dict):
        """flat -> the backend's product with `weights` (None where it cannot take flat)."""
        matmul, group, int8 = (
            self.backend.int4_matmul.matmul,
            self.group_size,
            self.int8_activations,
        )
        nibbles, shifts = weights["nibbles"], weights["scales_and_shifts"]
        return lambda flat: matmul(flat, nibbles, shifts, group, int8)

    def _bind(self) -> None:
        """Choose the few-row kernel for the current tensors and settings, keep its layout
        (building it from the nibbles if absent) and drop the other's, and bind its
        arguments once: a decode step makes ~121 of these calls, and module attribute
        lookups cost about a microsecond each."""
        self._parts = (tuple(self.nibbles.unbind(0)), tuple(self.scales_and_zeros.unbind(0)))
        self._weights = self._native_weights()
        if self._weights is not None:
            self.packed = None
            self._few_rows = self._native_matmul(self._weights)
            return
        if self.packed is None:
            packed = [
                torch._convert_weight_to_int4pack_for_cpu(_codes(n, self.group_size).int(), 1)
                for n in self.nibbles
            ]
            self.packed = torch.stack(packed)
        parts = tuple(zip(self.packed.unbind(0), self._parts[1], strict=True))
        group = self.group_size
        round_int8 = self.backend.quantize_activations_int8 if self.int8_activations else None

        def torch_int4(flat: torch.Tensor) -> torch.Tensor:
            if round_int8 is not None:
                flat = round_int8(flat)
            y = None
            for packed, scales_and_zeros in parts:
                part = torch._weight_int4pack_mm_for_cpu(flat, packed, group, scales_and_zeros)
                y = part if y is None else y.add_(part)
            return y

        self._few_rows = torch_int4

    def fused_binding(self):
        fused = self.backend.fused_decoder_layer
        if fused is None or self._weights is None:
            return None
        return fused.bind_linear(
            **self._weights,
            bias=self.bias,
            group_size=self.group_size,
            int8_activations=self.int8_activations,
        )

    def extra_repr(self) -> str:
        kind = f"{self.nibbles.shape[0]} x int4"
        if self.int8_activations:
            kind += ", int8 activations"
        return f"in={self.in_features}, out={self.out_features}, {kind}"


class Q8_0Linear(Int4Linear):
    """GGUF's Q8_0: int8 codes with a scale per 32 inputs, which PyTorch's weight-only
    kernels take in neither form. A code c in [-128, 127] is 16 * hi + lo with hi in [-8, 7]
    and lo in [0, 15], so the matrix is the sum of two 4-bit parts (see `Int4Linear`): hi
    with scale 16 * d and zero 0, lo with scale d and zero 8 * d. Two int4 products read
    one byte per weight, as int8 would, and compute with the exact weights. The backend's
    own `int8_matmul` (the C++ CPU ops) takes the codes as they are instead, a group's 32
    codes at once: where it has one, the layer keeps the codes (one byte per weight more)
    for few float32 rows and no packed parts."""

    # ... and the backend's int8 matmul's: the codes (N, K) and d (N, K / group) float32.
    LAYOUTS = (*Int4Linear.LAYOUTS, "codes", "scales")

    @staticmethod
    def _parts_of(weight: QuantizedWeight) -> list[tuple]:
        codes = weight.codes.to(torch.int16)
        hi, lo = torch.div(codes, 16, rounding_mode="floor"), codes % 16
        return [
            ((hi + INT4_OFFSET).to(torch.uint8), 16 * weight.scale, None),
            (lo.to(torch.uint8), weight.scale, INT4_OFFSET * weight.scale),
        ]

    def _native_weights(self) -> dict | None:
        if self.backend.int8_matmul is None:
            return super()._native_weights()
        if self.compiled or self.scales_and_zeros.dtype != torch.float32:
            self.codes = self.scales = None
            return None
        if self.codes is None:  # c = 16 * (hi code - 8) + lo code; d is the low part's scale
            hi, lo = (_codes(n, self.group_size).to(torch.int16) for n in self.nibbles)
            self.codes = (16 * (hi - INT4_OFFSET) + lo).to(torch.int8)
            self.scales = self.scales_and_zeros[1, :, :, 0].T.contiguous()
        return {"codes": self.codes, "scales": self.scales}

    def _native_matmul(self, weights: dict):
        if self.backend.int8_matmul is None:
            return super()._native_matmul(weights)
        matmul, group, int8 = self.backend.int8_matmul, self.group_size, self.int8_activations
        codes, scales = weights["codes"], weights["scales"]
        return lambda flat: matmul(flat, codes, scales, group, int8)


def use_int8_activations(model: nn.Module) -> int:
    """Round the activations of every 4-bit layer of `model` to int8 per 32 inputs (see
    `Int4Linear`); how many layers that is."""
    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    for layer in layers:
        layer.round_activations_to_int8()
    return len(layers)


def prepare_for_compile(module: nn.Module) -> None:
    """Bind PyTorch's own kernels in every quantized layer of `module`, which torch.compile
    is about to trace (the backend's native matmuls are opaque to it; the compiled code
    would otherwise fall back to dequantizing)."""
    for layer in module.modules():
        if isinstance(layer, Int4Linear):
            layer.prepare_for_compile()
