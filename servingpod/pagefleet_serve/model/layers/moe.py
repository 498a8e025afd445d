"""A mixture of experts in place of a layer's MLP: a router (`gate`) scores the experts,
each token runs its top k through the backend's fused MoE operator over the experts
stacked in one tensor per projection, their outputs weighted by the router.

`MoEConfig` is what the mixture families' configurations share; the experts' own weights
load per expert (`experts.{e}.gate_proj`, shard id (e, 0)), stacked by projection (GGUF's
(E, rows, columns) `experts.gate_proj`, shard id (None, 0)) or stacked and fused already
(transformers' `experts.gate_up_proj`, shard id (None, None)), each rank keeping its part
of every expert's intermediate size.
"""

import re
from dataclasses import dataclass

import torch
from pagefleet_kernels import moe
from torch import nn

from pagefleet_serve.model.config import ModelConfig
from pagefleet_serve.model.context import current_context
from pagefleet_serve.model.layers.activation import is_gelu
from pagefleet_serve.model.layers.linear import ReplicatedLinear, parameter
from pagefleet_serve.model.layers.linear_methods import (
    PREPACK_BATCH_HINT,
    can_prepack,
    quantized_linear,
)
from pagefleet_serve.model.weights import (
    Quantized,
    Weight,
    cut,
    dequantized,
    is_kept_quantized,
    load,
    load_into,
    shape_of,
)

# An expert's projection, or every expert's stacked: `experts.{e}.gate_proj.weight`,
# `experts.gate_proj.weight` (GGUF), `experts.gate_up_proj` (transformers' stacked form).
_EXPERT_NAME = re.compile(
    r"(.*\.experts)\.(?:(\d+)\.)?(gate_proj|up_proj|down_proj|gate_up_proj)(?:\.weight)?"
)
_EXPERT_PROJECTIONS = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "gate_up_proj": ("gate_up_proj", None),
    "down_proj": ("down_proj", None),
}


def expert_param(name: str) -> tuple[str, tuple[int | None, int | None]] | None:
    """'layers.3.mlp.experts.5.up_proj.weight' -> ('layers.3.mlp.experts.gate_up_proj',
    (5, 1)): the stacked parameter a checkpoint tensor of the experts goes to, and its shard
    id (see `FusedMoE.weight_loader`); None for any other tensor."""
    match = _EXPERT_NAME.fullmatch(name)
    if match is None:
        return None
    projection, part = _EXPERT_PROJECTIONS[match[3]]
    expert = None if match[2] is None else int(match[2])
    return f"{match[1]}.{projection}", (expert, part)


@dataclass(frozen=True)
class MoEConfig(ModelConfig):
    """A mixture's experts (0: a dense MLP on every layer), how many each token runs, their
    intermediate size (None: intermediate_size), the router's scores and whether the top k
    are renormalized to sum to one; which layers are sparse (None: every one)."""

    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    router_scoring: str = "softmax"  # or "sigmoid", "top_k_softmax"
    norm_topk_prob: bool = False
    sparse_layers: tuple[bool, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, num_experts = {self.num_experts}], got "
                f"{self.num_experts_per_tok}"
            )
        if self.router_scoring not in moe.ROUTER_SCORINGS:
            raise ValueError(
                f"router_scoring must be one of {moe.ROUTER_SCORINGS}, got {self.router_scoring!r}"
            )
        if self.sparse_layers is not None and len(self.sparse_layers) != self.num_layers:
            raise ValueError(
                f"sparse_layers has {len(self.sparse_layers)} entries for {self.num_layers} layers"
            )

    def layer_is_sparse(self, layer: int) -> bool:
        """Whether the layer's MLP is the mixture of experts."""
        if not self.num_experts:
            return False
        return self.sparse_layers is None or self.sparse_layers[layer]

    @classmethod
    def family_fields(cls, hf: dict) -> dict:
        """The experts, the router (renormalized by norm_topk_prob) and which layers are
        sparse (Qwen's decoder_sparse_step and mlp_only_layers: the others dense)."""
        num_layers = hf["num_hidden_layers"]
        num_experts = hf.get("num_local_experts") or hf.get("num_experts") or 0
        step = hf.get("decoder_sparse_step") or 1
        dense = set(hf.get("mlp_only_layers") or ())
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
        return {
            "num_experts": num_experts,
            "num_experts_per_tok": hf["num_experts_per_tok"] if num_experts else 0,
            "moe_intermediate_size": hf.get("moe_intermediate_size"),
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
            "sparse_layers": None if all(sparse) else sparse,
        }


class FusedMoE(nn.Module):
    """Every expert's gated MLP, stacked: gate_up_proj (E, 2I, H) = [gate | up] and down_proj
    (E, H, I), each expert's slice as `F.linear` takes it (I: this rank's part); with `bias`
    (gpt-oss) their biases gate_up_proj_bias (E, 2I) and down_proj_bias (E, H)."""

    # After `prepack`: each expert's [gate | up] and down matrices in oneDNN's blocked
    # layout (the stacked parameters are dropped).
    packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
    # After `keep_quantized`: each expert's [gate | up] and down as quantized layers.
    quantized: tuple[nn.ModuleList, nn.ModuleList] | None = None

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, bias: bool = False
    ) -> None:
        super().__init__()
        context = current_context()
        self.parallel, self.backend = context.parallel, context.backend
        self.num_experts = num_experts
        self.first, end = self.parallel.intermediate(intermediate_size)
        self.local = local = end - self.first

        def stacked(*shape: int) -> nn.Parameter:
            return parameter((num_experts, *shape), self.weight_loader, context.dtype)

        self.gate_up_proj = stacked(2 * local, hidden_size)
        self.down_proj = stacked(hidden_size, local)
        self.gate_up_proj_bias = stacked(2 * local) if bias else None
        self.down_proj_bias = stacked(hidden_size) if bias else None
        self._quantized: dict = {}  # (projection, part) -> stacked quantized weight

    def weight_loader(self, param: nn.Parameter, weight: Weight, shard_id=None) -> None:
        """`shard_id` (expert, part): the checkpoint's tensor is expert `expert`'s (None:
        every expert's, stacked), and [gate | up]'s part `part` (0 gate, 1 up; None: both,
        or down)."""
        expert, part = shard_id or (None, None)
        rows = 0 if expert is not None else 1  # the output dim of the checkpoint's tensor
        fused = param is self.gate_up_proj or param is self.gate_up_proj_bias
        if self.parallel.parallel:
            # A rank's part of the experts is expanded: their quantized blocks are not cut
            # along the intermediate size.
            weight = dequantized(weight)
            first, end = self.first, self.first + self.local
            if fused and part is None:
                half = shape_of(weight)[rows] // 2
                weight = cut(weight, rows, [(first, end), (half + first, half + end)])
            elif fused:
                weight = cut(weight, rows, [(first, end)])
            elif param is self.down_proj:
                weight = cut(weight, len(shape_of(weight)) - 1, [(first, end)])
        # Stacked quantized experts (GGUF's) may be kept; one expert's own (a float8
        # checkpoint's: there is no float8 grouped product) is expanded into its slice.
        if expert is None and is_kept_quantized(weight):
            self._quantized[("gate_up" if fused else "down", part)] = load(weight, param.dtype)
            return
        out = param.data if expert is None else param.data[expert]
        if part is not None:
            span = slice(part * self.local, (part + 1) * self.local)
            out = out[span] if expert is not None else out[:, span]
        load_into(weight, out)

    def finish_loading(self) -> None:
        """GGUF's stacked gate, up and down, when all three came kept quantized, are held as
        the quantized layers of their format (`keep_quantized`); otherwise the quantized
        ones are expanded into the stacked tensors."""
        if not self._quantized:
            return
        parts = {("gate_up", 0), ("gate_up", 1), ("down", None)}
        if set(self._quantized) == parts:
            gate, up = self._quantized[("gate_up", 0)], self._quantized[("gate_up", 1)]
            fused = [
                type(g).cat_rows([g, u]) for g, u in zip(gate.experts(), up.experts(), strict=True)
            ]
            self.keep_quantized(fused, self._quantized[("down", None)].experts())
        else:
            for (projection, part), weight in self._quantized.items():
                param = self.gate_up_proj if projection == "gate_up" else self.down_proj
                out = param.data
                if part is not None:
                    out = out[:, part * self.local : (part + 1) * self.local]
                out.copy_(weight.dequantize())
        self._quantized = {}

    def keep_quantized(self, gate_up: list[Quantized], down: list[Quantized]) -> None:
        """Hold each expert's matrices as the quantized layers of their format (GGUF's 4- and
        8-bit blocks, multiplied by the backend's kernels, as the dense layers are) instead
        of the stacked float tensors: a Q4 mixture keeps its 4.5 bits a weight."""
        backend = self.backend
        self.gate_up_layers = nn.ModuleList(quantized_linear(w, None, backend) for w in gate_up)
        self.down_layers = nn.ModuleList(quantized_linear(w, None, backend) for w in down)
        self.quantized = (self.gate_up_layers, self.down_layers)
        del self.gate_up_proj, self.down_proj

    def prepack(self) -> bool:
        """Reorder 16-bit experts' matrices once for oneDNN on the CPU, as
        `linear_methods.PrepackedLinear` does the dense layers' (one to eight bfloat16 rows
        of a 1024 x 1024 matrix: 35-60 us against 71-97 for `F.linear`); float32 ones stay
        as they lie for the backend's few-row matmul. Whether it packed."""
        if self.quantized is not None:
            return False
        dtype = self.gate_up_proj.dtype
        if dtype == torch.float32 or not self.gate_up_proj.is_cpu or not can_prepack(dtype):
            return False

        def pack(stacked: torch.Tensor) -> list[torch.Tensor]:
            reorder = torch.ops.mkldnn._reorder_linear_weight
            return [reorder(weight, PREPACK_BATCH_HINT) for weight in stacked.detach()]

        self.packed = (pack(self.gate_up_proj), pack(self.down_proj))
        del self.gate_up_proj, self.down_proj
        return True


def _prepacked_linear(rows: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")


def _layer_linear(rows: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    return layer(rows)


class MoEBlock(nn.Module):
    """A sparse layer's MLP: the router and the experts. Under tensor parallelism the
    experts' output is a partial sum, all-reduced once (with whatever `partial_output`
    adds, a family's shared expert)."""

    def __init__(
        self,
        config: MoEConfig,
        router_bias: bool = False,
        expert_bias: bool = False,
        activation: moe.ClampedSwiGLU | None = None,
    ) -> None:
        """`activation`: the experts' own (gpt-oss's clamped SwiGLU); None: SwiGLU or GeGLU
        by hidden_act."""
        super().__init__()
        context = current_context()
        size = config.moe_intermediate_size or config.intermediate_size
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, bias=router_bias)
        self.experts = FusedMoE(config.num_experts, config.hidden_size, size, expert_bias)
        self.activation = activation
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.scoring = config.router_scoring
        self.gelu = is_gelu(config.hidden_act)
        self.fused_moe = context.backend.fused_moe or moe.fused_moe
        self.act_and_mul = context.backend.act_and_mul
        parallel = context.parallel
        self.all_reduce = parallel.all_reduce if parallel.parallel else None
        # The last forward's tokens per expert, when `record_expert_load` (benchmarks).
        self.record_expert_load = False
        self.expert_load: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.partial_output(x)
        return y if self.all_reduce is None else self.all_reduce(y)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts: (weights (T, k) float32, ids (T, k)), by the router's
        scores (a family with its own rule overrides this)."""
        return moe.route(self.gate(x), self.top_k, self.renormalize, self.scoring)

    def partial_output(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of the output: its part of every expert's."""
        weights, ids = self.route(x)
        if self.record_expert_load:
            self.expert_load = moe.expert_load(ids, self.experts.num_experts)
        experts, weights = self.experts, weights.to(x.dtype)
        variant = {
            "gate_up_bias": experts.gate_up_proj_bias,
            "down_bias": experts.down_proj_bias,
            "activation": self.activation,
        }
        # Per-expert matrices (quantized layers, or prepacked on the CPU for oneDNN's
        # matmul): the grouped path, each expert on its rows.
        per_expert = (
            (experts.quantized, _layer_linear)
            if experts.quantized is not None
            else (experts.packed, _prepacked_linear)
        )
        if per_expert[0] is not None:
            (gate_up, down), linear = per_expert
            return moe.grouped_fused_moe(
                x,
                gate_up,
                down,
                weights,
                ids,
                self.gelu,
                **variant,
                linear=linear,
                act_and_mul=self.act_and_mul,
                few_rows=None,
            )
        return self.fused_moe(
            x, experts.gate_up_proj, experts.down_proj, weights, ids, self.gelu, **variant
        )
