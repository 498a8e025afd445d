"""The contract between the model and a kernel backend: one `KernelBackend` per backend.

Per forward pass the model builds one `AttentionMetadata` (the batch layout; it and
`LoRAMapping` live in `metadata`), calls the backend's `prepare` once, then per layer
`write_kv_cache` and `paged_attention`; the norms, rotary embedding and MLP activation
around them are the backend's layer ops, and its optional matmuls (a few float32 rows,
4-bit and Q8_0 weights), fused decoder layer, batched LoRA operator and mixture-of-experts
operator are declared next to them: `None` where a backend has no such kernel, so that a
caller reads what a backend offers instead of probing for it. Tensor layouts are those of
the package docstring.

The backends: `torch_backend()` (PyTorch: every feature, the ground truth, the fallback),
`cpu_backend()` (C++ decode attention, layer ops and matmuls on the CPU, built on first
use) and `triton_backend()` (Triton kernels on CUDA). Each is built once per process.
"""

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pagefleet_kernels.metadata import AttentionMetadata, LoRAMapping


# -- the attention ------------------------------------------------------------------------
class Prepare(Protocol):
    def __call__(
        self, metadata: AttentionMetadata, block_size: int, sliding_windows: set[int | None]
    ) -> None:
        """Once per forward pass, before the first layer: build whatever depends on the
        batch layout alone (for each sliding window the model's layers use; None: none)
        into `metadata.plan_cache`, so that no layer rebuilds it."""


class WriteKVCache(Protocol):
    def __call__(
        self,
        key: torch.Tensor,  # (T, Hkv, D)
        value: torch.Tensor,  # (T, Hkv, D)
        key_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # (T,) int64
        key_scale: torch.Tensor | None = None,  # (num_blocks, block_size, Hkv) when int8/fp8
        value_scale: torch.Tensor | None = None,
    ) -> None: ...


class PagedAttention(Protocol):
    def __call__(
        self,
        query: torch.Tensor,  # (T, Hq, D)
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        scale: float,
        query_lens: list[int] | None = None,
        key_scale: torch.Tensor | None = None,
        value_scale: torch.Tensor | None = None,
        *,
        plan_cache: dict | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,  # (Hq,): one more softmax logit per head
    ) -> torch.Tensor: ...  # (T, Hq, D)


# -- the layer ops (see pagefleet_kernels.layer_ops for each one's meaning) -----------------
# rms_norm(x (rows, n), weight (n,), eps, unit_offset) -> (rows, n)
RMSNormOp = Callable[[torch.Tensor, torch.Tensor, float, bool], torch.Tensor]
# add_rms_norm(x, h, weight, eps, unit_offset) -> (x + h, its norm)
AddRMSNormOp = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float, bool], tuple[torch.Tensor, torch.Tensor]
]
# rope(x (T, H, D), cos (T, D), sin (T, D), sin's first half negated) -> (T, H, D)
RopeOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# act_and_mul(gate_up (T, 2I), gelu) -> (T, I)
ActAndMulOp = Callable[[torch.Tensor, bool], torch.Tensor]
# dequantize_int4(nibbles of each part, scales and zeros of each part, group) -> (N, K)
DequantizeInt4Op = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor], int], torch.Tensor]
# quantize_activations_int8(x (rows, K) float32) -> x^, rounded per 32 inputs
QuantizeActivationsOp = Callable[[torch.Tensor], torch.Tensor]

# -- the optional matmuls: each returns None for an x it cannot take (another device or
# dtype, strided rows, inside torch.compile), and the caller multiplies another way ------
# linear(x (M, K) float32, weight (N, K) float32 as it lies) -> (M, N)
FewRowLinearOp = Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]
# int8_matmul(x (M, K), codes (N, K) int8, scales (N, K / group) float32, group,
# int8_activations) -> (M, N): GGUF's Q8_0, w = code * scale
Int8MatmulOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, bool], torch.Tensor | None]


class AddLoRAOp(Protocol):
    def __call__(
        self,
        y: torch.Tensor,  # (T, N), added to in place
        x: torch.Tensor,  # (T, K)
        lora_a: torch.Tensor,  # (slots, R, K)
        lora_b: torch.Tensor,  # (slots, N, R), the adapter's scale folded in
        mapping: LoRAMapping,
        parts: tuple[int, ...] = (),
    ) -> None:
        """y += each row's x @ lora_a[slot]^T @ lora_b[slot]^T for the rows that have a slot
        (Punica's shrink and expand). `parts`: the output sizes of a fused linear's parts
        (q, k, v; gate, up), over which lora_b is block-diagonal: part p's outputs read
        ranks [p R / P, (p + 1) R / P) of the P parts and hold zeros at the others, which an
        operator may skip (the dense product is the same)."""


class FusedMoEOp(Protocol):
    def __call__(
        self,
        x: torch.Tensor,  # (T, H)
        gate_up: torch.Tensor,  # (E, 2I, H)
        down: torch.Tensor,  # (E, H, I)
        topk_weights: torch.Tensor,  # (T, k) in x's dtype
        topk_ids: torch.Tensor,  # (T, k) int64
        gelu: bool = False,
        *,
        gate_up_bias: torch.Tensor | None = None,  # (E, 2I)
        down_bias: torch.Tensor | None = None,  # (E, H)
        activation: Callable[[torch.Tensor], torch.Tensor] | None = None,  # (P, 2I) -> (P, I)
    ) -> torch.Tensor:
        """(T, H): each token's chosen experts' gated MLPs, weighted and summed; every
        backend's also takes gpt-oss's variant (expert biases, `moe.ClampedSwiGLU`). See
        pagefleet_kernels.moe."""


@dataclass(frozen=True)
class Int4Matmul:
    """x (M, K) times the transpose of a 4-bit weight given as parts summed (a Q8_0 matrix
    is two), in float32, returned in x's dtype; with `int8_activations` x^ (see
    `layer_ops.quantize_activations_int8`) times the codes, in integer dot products."""

    # (x, nibbles of each part, each part's weight_layout, group, int8_activations)
    matmul: Callable[
        [torch.Tensor, Sequence[torch.Tensor], Sequence[torch.Tensor], int, bool],
        torch.Tensor | None,
    ]
    # A part's PyTorch scales and zeros (K / group, N, 2), w = (code - 8) * scale + zero,
    # as `matmul` reads them (float32, built once per weight).
    weight_layout: Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class FusedDecoderLayer:
    """A decoder layer's work around its attention as two native calls (the same ops in the
    same order as the model's eager ones, the same bits), for float32 rows whose four
    matmuls each have a native binding: `attention_inputs(x, cos, sin)` -> q, k, v and
    `attention_outputs(x, attended)` -> the layer's output."""

    # bind_linear(*, nibbles=(), scales_and_shifts=(), codes=None, scales=None, bias=None,
    # group_size, int8_activations): one 4-bit (`Int4Matmul`'s arguments) or Q8_0
    # (`int8_matmul`'s) weight with its bias, as the fused layer multiplies it.
    bind_linear: Callable[..., object]
    # bind_layer(input_norm, post_attention_norm, eps, unit_offset, qkv, o, gate_up, down
    # (bind_linear's), heads, kv_heads, head_dim, gelu) -> the layer's two calls.
    bind_layer: Callable[..., object]


@dataclass(frozen=True)
class KernelBackend:
    """What one backend computes for the model. Required fields every backend has; the
    optional ones are None where it has no kernel for them (the model then multiplies
    with PyTorch's own operators)."""

    name: str  # as `--attention-backend` names it: torch, cpu, triton
    # Attention over the paged KV cache: once per forward pass, then per layer.
    prepare: Prepare
    write_kv_cache: WriteKVCache
    paged_attention: PagedAttention
    # The layer ops around the matmuls.
    rms_norm: RMSNormOp
    add_rms_norm: AddRMSNormOp
    rope: RopeOp
    act_and_mul: ActAndMulOp
    # What 4-bit weights need on every backend: the matrix for wide batches, and the
    # rounding of int8 activations.
    dequantize_int4: DequantizeInt4Op
    quantize_activations_int8: QuantizeActivationsOp
    # Optional native matmuls and the fused decoder layer.
    linear: FewRowLinearOp | None = None
    int4_matmul: Int4Matmul | None = None
    int8_matmul: Int8MatmulOp | None = None
    fused_decoder_layer: FusedDecoderLayer | None = None
    # The batched LoRA operator (multi-LoRA serving); None: this backend serves no adapters.
    add_lora: AddLoRAOp | None = None
    # The mixture-of-experts operator; None: the model runs `moe.fused_moe` (the reference).
    fused_moe: FusedMoEOp | None = None


def _declare(name: str, attention, ops, quantized_ops, **optional) -> KernelBackend:
    """A backend of the functions of modules: `attention`'s prepare/write/attend, `ops`'s
    layer ops, `quantized_ops`'s dequantize_int4 and quantize_activations_int8."""
    return KernelBackend(
        name=name,
        prepare=attention.prepare,
        write_kv_cache=attention.write_kv_cache,
        paged_attention=attention.paged_attention,
        rms_norm=ops.rms_norm,
        add_rms_norm=ops.add_rms_norm,
        rope=ops.rope,
        act_and_mul=ops.act_and_mul,
        dequantize_int4=quantized_ops.dequantize_int4,
        quantize_activations_int8=quantized_ops.quantize_activations_int8,
        **optional,
    )


@functools.cache
def torch_backend() -> KernelBackend:
    """PyTorch end to end: `torch_attention` and the eager `layer_ops`; no native matmuls."""
    from pagefleet_kernels import layer_ops, lora_ops, moe, torch_attention

    return _declare(
        "torch",
        torch_attention,
        layer_ops,
        layer_ops,
        add_lora=lora_ops.add_lora,
        fused_moe=moe.fused_moe,
    )


@functools.cache
def cpu_backend() -> KernelBackend:
    """The C++ decode attention of `cpu_attention` and the C++ ops of `cpu_layer_ops`. The
    matmuls and the fused layer are declared when the layer-ops extension builds (the
    attention one must: `cpu_attention.available()`); the layer ops fall back to the eager
    ones per call for what they do not take."""
    from pagefleet_kernels import cpu_attention, cpu_layer_ops, lora_ops, moe

    if not cpu_attention.available():
        raise RuntimeError("the C++ attention kernel could not be built here (no compiler?)")
    # The adapters' operator: one C++ call for float32 when the extension builds, PyTorch's
    # matmuls batched over the slots a step reads otherwise.
    native: dict[str, object] = {
        "add_lora": cpu_layer_ops.add_lora
        if cpu_layer_ops.available()
        else lora_ops.add_lora_padded
    }
    # Tokens grouped by expert, each expert's matmuls on its rows (few rows through the C++
    # matmul when it builds).
    few_rows = cpu_layer_ops.linear if cpu_layer_ops.available() else None
    native["fused_moe"] = functools.partial(
        moe.grouped_fused_moe, linear=few_rows, act_and_mul=cpu_layer_ops.act_and_mul
    )
    if cpu_layer_ops.available():
        native |= {
            "linear": cpu_layer_ops.linear,
            "int4_matmul": Int4Matmul(cpu_layer_ops.int4_matmul, cpu_layer_ops.scales_and_shifts),
            "int8_matmul": cpu_layer_ops.int8_matmul,
            "fused_decoder_layer": FusedDecoderLayer(
                cpu_layer_ops.quantized_linear, cpu_layer_ops.decoder_layer
            ),
        }
    return _declare("cpu", cpu_attention, cpu_layer_ops, cpu_layer_ops, **native)


@functools.cache
def triton_backend() -> KernelBackend:
    """`triton_attention` and the Triton layer ops; 4-bit weights are dequantized and
    their activations rounded by the eager ops (once per matmul: not worth a kernel)."""
    from pagefleet_kernels import (
        layer_ops,
        triton_attention,
        triton_layer_ops,
        triton_lora,
        triton_moe,
    )

    return _declare(
        "triton",
        triton_attention,
        triton_layer_ops,
        layer_ops,
        add_lora=triton_lora.add_lora,
        fused_moe=triton_moe.fused_moe,
    )
