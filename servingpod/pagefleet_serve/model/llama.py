"""A Llama-family decoder over the paged KV cache, in plain PyTorch.

One model class serves Llama, Mistral, Qwen2/2.5, Qwen3, Phi-3, Gemma 2 and Gemma 3: they
differ only in switches of `ModelConfig` (q/k/v and o biases, per-head q/k RMSNorm,
sliding-window layers with their own rope base, Gemma's (1 + weight) norms around both
sublayers, GeGLU, scaled embeddings, attention and final logit soft-capping) and in
whether the checkpoint already has q/k/v and gate/up fused (Phi-3). The mixture-of-experts
families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss) are the same decoder with
`MoEBlock` in place of the MLP on their sparse layers: a router, the backend's fused MoE
operator over the experts stacked in one tensor per projection, and Qwen2-MoE's gated
shared expert. gpt-oss adds attention sinks, YaRN rope, a biased router whose softmax is
over its top k, and experts with biases and a clamped SwiGLU.

The batch is flattened: `input_ids` / `positions` hold every scheduled token of every
sequence; the kernel backend (`pagefleet_kernels.backend.KernelBackend`) attends using
`AttentionMetadata` to find each token's sequence and context, and does the norms, rotary
embedding and MLP activation with its layer ops. The matmuls are the linear layers of
`pagefleet_serve.model.linear`, one class per weight format, and a layer's work around its
attention may run as the backend's fused decoder layer (`pagefleet_serve.model.fused`).
Weight names follow Hugging Face's LlamaForCausalLM; q/k/v and gate/up are fused at load
time (one matmul each).
"""

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from pagefleet_kernels import moe
from pagefleet_kernels.backend import AttentionMetadata, KernelBackend, torch_backend
from torch import nn

from pagefleet_serve.model.fused import FusedAroundAttention, bind_fused_layer
from pagefleet_serve.model.linear import (
    PREPACK_BATCH_HINT,
    Linear,
    LMHead,
    can_prepack,
    prepack_linears,
    prepare_for_compile,
    quantized_linear,
    use_int8_activations,
)
from pagefleet_serve.model.quant import QuantizedWeight
from pagefleet_serve.model.tensor_parallel import NO_PARALLEL, TensorParallel, check_shardable

if TYPE_CHECKING:
    from pagefleet_serve.model.lora import LayerLoRA, LoRABatch

HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # (key, value) pairs: llama3 (factor, freq factors...), linear, longrope (short_factor,
    # long_factor, original_max_position_embeddings, attention_factor), yarn (factor,
    # beta_fast, beta_slow, original_max_position_embeddings, truncate, attention_factor),
    # freqs (GGUF).
    rope_scaling: tuple[tuple[str, object], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # Every id that ends a generation (the config's and generation_config's); includes
    # eos_token_id.
    eos_token_ids: tuple[int, ...] = ()
    qkv_bias: bool = False  # Qwen2, and Llama/Qwen3 with attention_bias
    o_bias: bool = False  # Llama/Qwen3 with attention_bias
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k, before rope
    sliding_window: int | None = None  # keys within this many positions, the query's included
    # Per layer, whether it uses the sliding window; None: every layer does (when set).
    sliding_layers: tuple[bool, ...] | None = None
    # Gemma 2: norms scale by (1 + weight) in float32, and also follow attention and MLP.
    norm_unit_offset: bool = False
    sandwich_norms: bool = False
    hidden_act: str = "silu"  # or "gelu_pytorch_tanh" (GeGLU)
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size)
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this); None: head_dim
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None
    # Gemma 3: the sliding-window layers rotate with this base and no rope scaling.
    local_rope_theta: float | None = None
    # OLMoE: q_norm / k_norm span the whole q / k projection, not each head; then q, k and v
    # are clamped to [-clip_qkv, clip_qkv].
    qk_norm_whole: bool = False
    clip_qkv: float | None = None
    # Mixture of experts (0: a dense MLP on every layer): the experts of a sparse layer,
    # how many each token runs, their intermediate size (None: intermediate_size), the
    # router's scores and whether the top k are renormalized to sum to one.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    router_scoring: str = "softmax"  # or "sigmoid"
    norm_topk_prob: bool = False
    # Qwen2-MoE: a shared expert every token runs, scaled by sigmoid(a gate); 0: none.
    shared_expert_intermediate_size: int = 0
    # Per layer, whether its MLP is the experts; None: every layer's is (when num_experts).
    sparse_layers: tuple[bool, ...] | None = None
    # gpt-oss: a learned logit per query head (`self_attn.sinks`) joins each softmax's
    # denominator; the router has a bias; each expert's projections have biases; the
    # experts' activation is moe.ClampedSwiGLU(swiglu_alpha, swiglu_limit) (None: SwiGLU
    # or GeGLU by hidden_act).
    attention_sinks: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.sliding_layers is not None and len(self.sliding_layers) != self.num_layers:
            raise ValueError(
                f"sliding_layers has {len(self.sliding_layers)} entries for "
                f"{self.num_layers} layers"
            )
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
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            raise ValueError(f"swiglu_limit must be > 0 or None, got {self.swiglu_limit}")

    @property
    def expert_activation(self) -> moe.ClampedSwiGLU | None:
        """The experts' activation when it is not hidden_act's gated one (gpt-oss's)."""
        if self.swiglu_limit is None:
            return None
        return moe.ClampedSwiGLU(self.swiglu_alpha, self.swiglu_limit)

    @property
    def longrope_switch(self) -> int | None:
        """Phi-3 longrope: a sequence whose context exceeds this many positions rotates its
        new tokens with the long factors; None for every other rope."""
        scaling = dict(self.rope_scaling or ())
        if scaling.get("rope_type") != "longrope":
            return None
        return scaling["original_max_position_embeddings"]

    @property
    def rope_attention_factor(self) -> float:
        """What cos and sin are multiplied by (longrope's and YaRN's attention scaling;
        else 1)."""
        return float(dict(self.rope_scaling or ()).get("attention_factor", 1.0))

    def layer_sliding_window(self, layer: int) -> int | None:
        if self.sliding_layers is not None and not self.sliding_layers[layer]:
            return None
        return self.sliding_window

    def layer_is_sparse(self, layer: int) -> bool:
        """Whether the layer's MLP is the mixture of experts."""
        if not self.num_experts:
            return False
        return self.sparse_layers is None or self.sparse_layers[layer]


def rope_inv_freq(config: ModelConfig, local: bool = False, long: bool = False) -> torch.Tensor:
    """The rotary frequencies of the global layers, or of the sliding-window layers when
    `local` (Gemma 3's `local_rope_theta`, unscaled); longrope's long factors when `long`."""
    dim = config.head_dim
    theta = config.local_rope_theta if local else config.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    scaling = {} if local else dict(config.rope_scaling or ())
    if scaling.get("rope_type") == "longrope":  # a divisor per frequency, short or long
        factors = scaling["long_factor" if long else "short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
    if scaling.get("rope_type") == "linear":  # positions divided by the factor
        inv_freq = inv_freq / scaling["factor"]
    elif scaling.get("rope_type") == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(is_medium, smoothed, scaled)
    elif scaling.get("rope_type") == "yarn":
        inv_freq = _yarn_inv_freq(theta**exponents, scaling, dim, theta)
    elif scaling.get("rope_type") == "freqs":  # GGUF's rope_freqs tensor: divisors per dim
        inv_freq = inv_freq / torch.tensor(scaling["divisors"], dtype=torch.float32)
    return inv_freq.float()


def _yarn_inv_freq(pos_freqs: torch.Tensor, scaling: dict, dim: int, theta: float) -> torch.Tensor:
    """YaRN (as transformers computes it): the frequencies that turn fewer than beta_slow
    times over the original context are divided by `factor` (interpolated), those that
    turn more than beta_fast times kept (extrapolated), a linear ramp between."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:  # the dimension turning that many times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling["beta_fast"]), correction_dim(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated


class RMSNorm(nn.Module):
    """Normalized in float32, then cast back before the weight, as Hugging Face does;
    Gemma's (1 + weight) is applied in float32 (`unit_offset`)."""

    def __init__(self, size: int, eps: float, unit_offset: bool, backend: KernelBackend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.unit_offset = unit_offset
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.rms_norm(x, self.weight, self.eps, self.unit_offset)

    def add(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + h, the norm of x + h): a residual add and the norm after it, in one op."""
        return self.backend.add_rms_norm(x, h, self.weight, self.eps, self.unit_offset)


def make_norm(config: ModelConfig, size: int, backend: KernelBackend) -> RMSNorm:
    return RMSNorm(size, config.rms_norm_eps, config.norm_unit_offset, backend)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        backend: KernelBackend,
        layer: int,
        tp: TensorParallel = NO_PARALLEL,
    ) -> None:
        """`tp`: this rank's heads only (see model.tensor_parallel); o_proj's output is then
        a partial sum, which the layer all-reduces."""
        super().__init__()
        q_first, q_end = tp.q_heads(config.num_heads, config.num_kv_heads)
        kv_first, kv_end = tp.kv_heads(config.num_heads, config.num_kv_heads)
        self.num_heads = q_end - q_first
        self.num_kv_heads = kv_end - kv_first
        self.head_dim = config.head_dim
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        q_size, kv_size = self.num_heads * config.head_dim, self.num_kv_heads * config.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.qkv_bias)
        # Row-parallel: rank 0 alone adds the bias, once in the sum.
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.o_bias and tp.rank == 0)
        if config.qk_norm:  # over each head, or (OLMoE) over the whole projection
            whole = config.qk_norm_whole
            self.q_norm = make_norm(config, q_size if whole else config.head_dim, backend)
            self.k_norm = make_norm(config, kv_size if whole else config.head_dim, backend)
        self.qk_norm = config.qk_norm
        self.qk_norm_whole = config.qk_norm_whole
        # A whole-projection norm split over the ranks: its mean square sums over them.
        self.whole_sizes = (
            config.num_heads * config.head_dim,
            config.num_kv_heads * config.head_dim,
        )
        self.norm_all_reduce = tp.all_reduce if tp.parallel and config.qk_norm_whole else None
        self.clip_qkv = config.clip_qkv
        self.sliding_window = config.layer_sliding_window(layer)
        self.softcap = config.attn_logit_softcapping
        self.sinks: nn.Parameter | None = None
        if config.attention_sinks:  # this rank's heads' sink logits
            self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.backend = backend

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lora: "LayerLoRA | None" = None
    ):
        """q, k, v (T, heads, D) of the normed hidden states: projected (plus each row's
        adapter delta), q/k-normed, rotated."""
        qkv = self.qkv_proj(x)
        if lora is not None:
            lora.add("qkv_proj", qkv, x)
        q_size, kv_size, _ = self.split
        qk = qkv[:, : q_size + kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm_whole:
            q, k = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size]
            q_whole, k_whole = self.whole_sizes
            q, k = (
                self._whole_norm(q, self.q_norm, q_whole),
                self._whole_norm(k, self.k_norm, k_whole),
            )
            qk = torch.cat((q, k), dim=1).view_as(qk)
        elif self.qk_norm:
            q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        v = qkv[:, q_size + kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        if self.clip_qkv is not None:
            qk, v = qk.clamp(-self.clip_qkv, self.clip_qkv), v.clamp(-self.clip_qkv, self.clip_qkv)
        # q and k side by side: rotated in one pass, then split (views).
        q, k = self.backend.rope(qk, cos, sin).split((self.num_heads, self.num_kv_heads), dim=1)
        return q, k, v

    def _whole_norm(self, x: torch.Tensor, norm: RMSNorm, whole: int) -> torch.Tensor:
        """OLMoE's RMSNorm over a whole projection, of which this rank holds `x`'s columns
        (and their weights): the squares summed over the ranks, in float32."""
        if self.norm_all_reduce is None:
            return norm(x)
        square = self.norm_all_reduce(x.float().square().sum(-1, keepdim=True))
        normed = x.float() * torch.rsqrt(square / whole + norm.eps)
        return norm.weight * normed.to(x.dtype)

    def attend(self, q, k, v, kv_cache, attn: AttentionMetadata) -> torch.Tensor:
        """Write k/v to the paged cache, attend: (T, heads * D), before o_proj."""
        cache = kv_cache  # LayerKVCache: key, value (+ their scales when int8/fp8)
        self.backend.write_kv_cache(
            k, v, cache.key, cache.value, attn.slot_mapping, cache.key_scale, cache.value_scale
        )
        out = self.backend.paged_attention(
            q,
            cache.key,
            cache.value,
            attn.block_tables,
            attn.seq_lens,
            attn.query_start_loc,
            self.scale,
            attn.query_lens,
            cache.key_scale,
            cache.value_scale,
            plan_cache=attn.plan_cache,
            sliding_window=self.sliding_window,
            softcap=self.softcap,
            sinks=self.sinks,
        )
        return out.reshape(-1, self.num_heads * self.head_dim)


class LlamaMLP(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        backend: KernelBackend,
        intermediate_size: int | None = None,
        tp: TensorParallel = NO_PARALLEL,
    ) -> None:
        """`tp`: this rank's part of the intermediate size; the output is a partial sum."""
        super().__init__()
        first, end = tp.intermediate(intermediate_size or config.intermediate_size)
        intermediate_size = end - first
        self.gate_up_proj = Linear(config.hidden_size, 2 * intermediate_size)
        self.down_proj = Linear(intermediate_size, config.hidden_size)
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"
        self.backend = backend

    def forward(self, x: torch.Tensor, lora: "LayerLoRA | None" = None) -> torch.Tensor:
        if lora is None:
            return self.down_proj(self.backend.act_and_mul(self.gate_up_proj(x), self.gelu))
        gate_up = lora.add("gate_up_proj", self.gate_up_proj(x), x)
        inner = self.backend.act_and_mul(gate_up, self.gelu)
        return lora.add("down_proj", self.down_proj(inner), inner)


class MoEExperts(nn.Module):
    """Every expert's gated MLP, stacked: gate_up_proj (E, 2I, H) = [gate | up] and down_proj
    (E, H, I), each expert's slice as `F.linear` takes it (transformers' own stacked names;
    per-expert checkpoint tensors are stacked at load); with `bias` (gpt-oss) their biases
    gate_up_proj_bias (E, 2I) and down_proj_bias (E, H)."""

    # After `prepack`: each expert's [gate | up] and down matrices in oneDNN's blocked
    # layout (the stacked parameters are dropped).
    packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
    # After `keep_quantized`: each expert's [gate | up] and down as quantized layers.
    quantized: tuple[nn.ModuleList, nn.ModuleList] | None = None

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, bias: bool = False
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False
        )
        self.gate_up_proj_bias: nn.Parameter | None = None
        self.down_proj_bias: nn.Parameter | None = None
        if bias:
            self.gate_up_proj_bias = nn.Parameter(
                torch.empty(num_experts, 2 * intermediate_size), requires_grad=False
            )
            self.down_proj_bias = nn.Parameter(
                torch.empty(num_experts, hidden_size), requires_grad=False
            )

    def keep_quantized(
        self, gate_up: list[QuantizedWeight], down: list[QuantizedWeight], backend: KernelBackend
    ) -> None:
        """Hold each expert's matrices as the quantized layers of their format (GGUF's 4- and
        8-bit blocks, multiplied by the backend's kernels, as the dense layers are) instead
        of the stacked float tensors: a Q4 mixture keeps its 4.5 bits a weight."""
        self.gate_up_layers = nn.ModuleList(quantized_linear(w, None, backend) for w in gate_up)
        self.down_layers = nn.ModuleList(quantized_linear(w, None, backend) for w in down)
        self.quantized = (self.gate_up_layers, self.down_layers)
        del self.gate_up_proj, self.down_proj

    def prepack(self) -> bool:
        """Reorder 16-bit experts' matrices once for oneDNN on the CPU, as
        `linear.PrepackedLinear` does the dense layers' (one to eight bfloat16 rows of a
        1024 x 1024 matrix: 35-60 us against 71-97 for `F.linear`); float32 ones stay as
        they lie for the backend's few-row matmul. Whether it packed."""
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
    """A sparse layer's MLP: the router (`gate`) scores the experts, each token runs its top
    k through the backend's fused MoE operator, their outputs weighted by the router; with
    a shared expert (Qwen2-MoE) every token also runs it, scaled by sigmoid(its gate)."""

    def __init__(
        self, config: ModelConfig, backend: KernelBackend, tp: TensorParallel = NO_PARALLEL
    ) -> None:
        """`tp`: this rank's part of every expert's intermediate size (the router is
        replicated); the output is a partial sum."""
        super().__init__()
        first, end = tp.intermediate(config.moe_intermediate_size or config.intermediate_size)
        intermediate_size = end - first
        self.gate = Linear(config.hidden_size, config.num_experts, bias=config.router_bias)
        self.experts = MoEExperts(
            config.num_experts, config.hidden_size, intermediate_size, config.expert_bias
        )
        self.activation = config.expert_activation
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.scoring = config.router_scoring
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"
        self.shared_expert: LlamaMLP | None = None
        if config.shared_expert_intermediate_size:
            size = config.shared_expert_intermediate_size
            self.shared_expert = LlamaMLP(config, backend, intermediate_size=size, tp=tp)
            self.shared_expert_gate = Linear(config.hidden_size, 1)
        self.fused_moe = backend.fused_moe or moe.fused_moe
        self.act_and_mul = backend.act_and_mul
        # The last forward's tokens per expert, when `record_expert_load` (benchmarks).
        self.record_expert_load = False
        self.expert_load: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = moe.route(self.gate(x), self.top_k, self.renormalize, self.scoring)
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
            y = moe.grouped_fused_moe(
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
        else:
            y = self.fused_moe(
                x, experts.gate_up_proj, experts.down_proj, weights, ids, self.gelu, **variant
            )
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        backend: KernelBackend,
        layer: int,
        tp: TensorParallel = NO_PARALLEL,
    ) -> None:
        super().__init__()
        self.backend = backend
        # The sum of the ranks' partial outputs of o_proj and of the MLP (identity at 1 rank).
        self.all_reduce = tp.all_reduce
        self.tensor_parallel = tp.parallel
        self.input_layernorm = make_norm(config, config.hidden_size, backend)
        self.self_attn = LlamaAttention(config, backend, layer, tp)
        # Llama: the norm before the MLP. Gemma 2 (Hugging Face's names): the norm of the
        # attention output, with two more around the MLP.
        self.post_attention_layernorm = make_norm(config, config.hidden_size, backend)
        self.sandwich_norms = config.sandwich_norms
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = make_norm(config, config.hidden_size, backend)
            self.post_feedforward_layernorm = make_norm(config, config.hidden_size, backend)
        self.mlp: LlamaMLP | MoEBlock = (
            MoEBlock(config, backend, tp)
            if config.layer_is_sparse(layer)
            else LlamaMLP(config, backend, tp=tp)
        )

    # The backend's fused form of the work around attention, bound to this layer's weights
    # (see pagefleet_serve.model.fused); None: the ops run one by one.
    fused: FusedAroundAttention | None = None
    compiled = False

    def forward(self, x, cos, sin, kv_cache, attn, lora: "LayerLoRA | None" = None) -> torch.Tensor:
        if lora is not None:  # the fused layer knows no adapters (and nothing is compiled)
            q, k, v = self.attention_inputs(x, cos, sin, lora)
            return self.attention_outputs(x, self.self_attn.attend(q, k, v, kv_cache, attn), lora)
        # The fused layer's `attention_inputs` and `attention_outputs` compute what this
        # layer's do, for the rows it takes.
        fused = self.fused
        around = (fused is not None and fused.for_rows(x)) or self
        q, k, v = around.attention_inputs(x, cos, sin)
        return around.attention_outputs(x, self.self_attn.attend(q, k, v, kv_cache, attn))

    def bind_fused(self) -> None:
        """Bind the fused layer to the current weights: after loading, and again whenever
        its matmuls change (new tensors after `.to()`, int8 activations switched on). A
        sparse layer has none: the fused kernel computes a dense MLP; nor has a tensor-
        parallel one, whose partial sums are all-reduced between its ops."""
        if isinstance(self.mlp, LlamaMLP) and not self.tensor_parallel:
            self.fused = bind_fused_layer(self, self.backend)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.bind_fused()
        return self

    # The layer around its attention: pure tensor functions, what compile_around_attention
    # compiles.
    def attention_inputs(self, x, cos, sin, lora: "LayerLoRA | None" = None):
        return self.self_attn.project(self.input_layernorm(x), cos, sin, lora)

    def attention_outputs(
        self, x: torch.Tensor, attended: torch.Tensor, lora: "LayerLoRA | None" = None
    ) -> torch.Tensor:
        h = self.self_attn.o_proj(attended)
        if lora is not None:
            lora.add("o_proj", h, attended)
        h = self.all_reduce(h)
        if not self.sandwich_norms:
            x, normed = self.post_attention_layernorm.add(x, h)
            return x + self.all_reduce(self._mlp(normed, lora))
        x, normed = self.pre_feedforward_layernorm.add(x, self.post_attention_layernorm(h))
        return x + self.post_feedforward_layernorm(self.all_reduce(self._mlp(normed, lora)))

    def _mlp(self, x: torch.Tensor, lora: "LayerLoRA | None") -> torch.Tensor:
        """The MLP, with the adapters' deltas on a dense one (adapters of a sparse layer's
        MLP are refused when they are read: `model.lora`)."""
        if lora is None or not isinstance(self.mlp, LlamaMLP):
            return self.mlp(x)
        return self.mlp(x, lora)

    def compile_around_attention(self) -> None:
        """Compile the parts around attention with inductor (each into a few fused
        kernels); attention itself stays eager, it reads per-step metadata. Every layer
        shares the compiled code (the modules' weights are its inputs)."""
        prepare_for_compile(self)
        self.attention_inputs = torch.compile(self.attention_inputs, dynamic=None)
        self.attention_outputs = torch.compile(self.attention_outputs, dynamic=None)
        self.compiled, self.fused = True, None


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        backend: KernelBackend | None = None,
        tp: TensorParallel = NO_PARALLEL,
    ) -> None:
        """`backend`: the kernels (see pagefleet_serve.attention.get_kernel_backend); None:
        the torch backend (a model built only to load or inspect weights). `tp`: this
        rank's shard of the model (see model.tensor_parallel), loaded as such: in a
        pipeline, its stage's layers (`layers[i]` is the model's layer `first_layer + i`),
        the embedding on the first stage, the final norm and the head on the last."""
        super().__init__()
        check_shardable(tp.size, config.num_heads, config.num_kv_heads, config.qk_norm_whole)
        if tp.stages > config.num_layers:
            raise ValueError(
                f"pipeline_parallel_size {tp.stages} exceeds the model's {config.num_layers} "
                "layers: each stage needs one at least"
            )
        self.config = config
        self.tp = tp
        self.backend = backend = torch_backend() if backend is None else backend
        self.vocab_first, vocab_end = tp.vocab(config.vocab_size)
        vocab = vocab_end - self.vocab_first
        # Given an (uninitialised) weight, Embedding skips its normal_ init, which on the meta
        # device imports torch._dynamo (~3 s of start-up); the checkpoint replaces it anyway.
        self.embed_tokens: nn.Embedding | None = None
        if tp.first_stage or (tp.last_stage and config.tie_word_embeddings):
            self.embed_tokens = nn.Embedding(
                vocab, config.hidden_size, _weight=torch.empty(vocab, config.hidden_size)
            )
        self.first_layer, end = tp.layers(config.num_layers)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, backend, i, tp) for i in range(self.first_layer, end)]
        )
        self.norm: RMSNorm | None = None
        self.lm_head: LMHead | None = None
        if tp.last_stage:
            self.norm = make_norm(config, config.hidden_size, backend)
            self.lm_head = LMHead(config.hidden_size, vocab)
            if config.tie_word_embeddings:
                self.lm_head.weight = self.embed_tokens.weight
        self._set_rope_frequencies(torch.device("cpu"))

    def _set_rope_frequencies(self, device: torch.device) -> None:
        """The rotary frequencies, computed (never loaded) in float32 on `device`: on the
        CPU when the module is built on the meta device (meta arithmetic imports
        torch._dynamo, seconds of start-up), and again after every `to()`, which would
        cast them to the model's dtype: a bfloat16 frequency is off by up to 2^-9, which
        at position 2,000 turns the angle by about a radian."""
        with torch.device(device):
            frequencies = {"inv_freq": rope_inv_freq(self.config)}
            if self.config.local_rope_theta is not None:
                frequencies["inv_freq_local"] = rope_inv_freq(self.config, True)
            if self.config.longrope_switch is not None:
                frequencies["inv_freq_long"] = rope_inv_freq(self.config, long=True)
        for name, value in frequencies.items():
            self.register_buffer(name, value, persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._set_rope_frequencies(self.inv_freq.device)
        return self

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        kv_caches: list,  # one pagefleet_kernels.kv_cache.LayerKVCache per layer
        attn: AttentionMetadata,
        lora: "LoRABatch | None" = None,  # the rows' LoRA adapters; None: no row has one
        hidden: torch.Tensor | None = None,  # (T, H): a later pipeline stage's input
    ) -> torch.Tensor:
        """The final hidden states, normed (T, H); on a pipeline stage before the last, its
        layers' output, for the next stage."""
        if hidden is None:
            x = self._embed(input_ids)
            if self.config.scale_embeddings:  # the factor rounded to the dtype, as Gemma does
                x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        else:
            x = hidden
        rope = self._rope(positions, self._global_inv_freq(attn), x.dtype)
        local_rope = rope
        if self.config.local_rope_theta is not None:
            local_rope = self._rope(positions, self.inv_freq_local, x.dtype)
        windows = {layer.self_attn.sliding_window for layer in self.layers}
        self.backend.prepare(attn, kv_caches[0].key.shape[1], windows)
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            cos, sin = local_rope if layer.self_attn.sliding_window else rope
            x = layer(x, cos, sin, kv_cache, attn, None if lora is None else lora.layer(index))
        return x if self.norm is None else self.norm(x)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows; vocabulary-parallel, each rank's lookup of its own ids (zero
        rows for the others') summed over the ranks."""
        if not self.tp.parallel:
            return self.embed_tokens(input_ids)
        local = input_ids - self.vocab_first
        inside = (local >= 0) & (local < self.embed_tokens.num_embeddings)
        x = self.embed_tokens(torch.where(inside, local, 0)) * inside[:, None]
        return self.tp.all_reduce(x)

    def prepack_linears(self) -> int:
        """Prepack every float linear layer for oneDNN on the CPU (see
        `linear.PrepackedLinear`); how many were packed. A tied LM head is packed as a copy,
        the embedding keeping its rows for lookups: SmolLM2 holds 56 MB more in bfloat16,
        and its batch-1 logits take 1.9 ms instead of 4.1. 16-bit experts are prepacked too
        (`MoEExperts.prepack`), counted one per layer."""
        count = prepack_linears(self, self.backend)
        return count + sum(m.prepack() for m in self.modules() if isinstance(m, MoEExperts))

    def use_int8_activations(self) -> int:
        """Round the activations of every 4-bit matmul to int8 per 32 inputs (see
        `linear.Int4Linear`); how many layers that is. A model without 4-bit weights is
        refused: the setting would change nothing."""
        count = use_int8_activations(self)
        if not count:
            raise ValueError(
                "activation_quantization 'int8' applies to 4-bit weights, and this model has "
                "none kept 4-bit: use quantization 'auto' with a Q4_0/Q4_1/Q8_0 GGUF"
            )
        for layer in self.layers:
            layer.bind_fused()
        return count

    def compile_around_attention(self) -> None:
        """torch.compile every layer's work before and after its attention (see
        `LlamaDecoderLayer.compile_around_attention`); the first steps of each new batch
        shape (one token, then any other count) pay the compilation."""
        for layer in self.layers:
            layer.compile_around_attention()

    def _global_inv_freq(self, attn: AttentionMetadata) -> torch.Tensor:
        """(D/2,) frequencies, or (T, D/2) with longrope: the long factors for the tokens of
        a sequence whose context (this step's tokens included) passes the switch, as
        transformers does per forward pass; keys already cached stay as they were."""
        switch = self.config.longrope_switch
        if switch is None:
            return self.inv_freq
        # Each token's context length, from the device metadata alone; the known output
        # size spares the device a synchronisation.
        repeats = attn.query_start_loc.diff()
        num_tokens = sum(attn.query_lens)
        long = torch.repeat_interleave(attn.seq_lens, repeats, output_size=num_tokens) > switch
        return torch.where(long[:, None], self.inv_freq_long, self.inv_freq)

    def _rope(self, positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
        """cos, sin (T, D) of each token, sin's first half negated (see `layer_ops.rope`);
        `inv_freq` (D/2,) or per token (T, D/2)."""
        freqs = positions.float()[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        half = sin.shape[-1] // 2
        sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # what layer_ops.rope takes
        factor = self.config.rope_attention_factor
        if factor != 1.0:  # in float32, before the cast, as transformers does
            cos, sin = cos * factor, sin * factor
        return cos.to(dtype), sin.to(dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(rows, vocab) float32 logits; under tensor parallelism on rank 0 only (gathered
        from every rank's part), None on the other ranks."""
        logits = self.tp.gather_vocab(self.lm_head(hidden).float(), self.config.vocab_size)
        if logits is None:
            return None
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_hf_state_dict(self, weights: dict[str, torch.Tensor | QuantizedWeight]) -> None:
        """Load Hugging Face LlamaForCausalLM names (`model.` prefix optional), fusing
        q/k/v (weights and biases) and gate/up where they come apart (the loader fuses them
        as it streams, Phi-3 checkpoints come fused). A matrix given as a QuantizedWeight turns
        its layer into the quantized layer of its format (`linear.quantized_linear`; the
        embedding table is expanded: a lookup reads a few rows, not the whole table)."""
        weights = {
            _stage_name(k.removeprefix("model."), self.first_layer): v
            for k, v in weights.items()
            if not k.endswith("rotary_emb.inv_freq")
        }
        for i in range(len(self.layers)):
            p = f"layers.{i}."
            for kind in ("weight", "bias") if self.config.qkv_bias else ("weight",):
                if p + f"self_attn.q_proj.{kind}" in weights:
                    weights[p + f"self_attn.qkv_proj.{kind}"] = _cat_rows(
                        [weights.pop(p + f"self_attn.{n}_proj.{kind}") for n in "qkv"]
                    )
            if p + "mlp.gate_proj.weight" in weights:
                weights[p + "mlp.gate_up_proj.weight"] = _cat_rows(
                    [weights.pop(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")]
                )
            if p + "mlp.shared_expert.gate_proj.weight" in weights:
                weights[p + "mlp.shared_expert.gate_up_proj.weight"] = _cat_rows(
                    [weights.pop(p + f"mlp.shared_expert.{n}_proj.weight") for n in ("gate", "up")]
                )
            if p + "mlp.experts.0.gate_proj.weight" in weights:
                _stack_experts(weights, p + "mlp.experts.", self.config.num_experts)
            if p + "mlp.experts.gate_proj.weight" in weights:  # stacked apart (GGUF's)
                self._load_stacked_experts(p + "mlp.experts", weights)
        if self.config.tie_word_embeddings and self.lm_head is not None:
            weights.setdefault("lm_head.weight", weights["embed_tokens.weight"])
            if not isinstance(weights["lm_head.weight"], QuantizedWeight):
                weights["lm_head.weight"] = weights["embed_tokens.weight"]
        embedding = weights.get("embed_tokens.weight")
        if isinstance(embedding, QuantizedWeight):
            weights["embed_tokens.weight"] = embedding.dequantize()
        for name in [n for n, w in weights.items() if isinstance(w, QuantizedWeight)]:
            self._quantize_layer(name.removesuffix(".weight"), weights.pop(name), weights)
        missing, unexpected = self.load_state_dict(weights, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(
                f"weights do not fit the model's configuration: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}"
            )
        for layer in self.layers:
            layer.bind_fused()

    def _load_stacked_experts(self, path: str, weights: dict) -> None:
        """A GGUF mixture's (E, rows, columns) gate, up and down: kept quantized when all
        three are (`MoEExperts.keep_quantized`), else stacked as float tensors."""
        gate, up, down = (weights.pop(f"{path}.{n}_proj.weight") for n in ("gate", "up", "down"))
        parts = (gate, up, down)
        if all(isinstance(w, QuantizedWeight) for w in parts):
            fused = [
                QuantizedWeight.cat_rows([g, u])
                for g, u in zip(gate.experts(), up.experts(), strict=True)
            ]
            self.get_submodule(path).keep_quantized(fused, down.experts(), self.backend)
            return
        gate, up, down = (w.dequantize() if isinstance(w, QuantizedWeight) else w for w in parts)
        weights[f"{path}.gate_up_proj"] = torch.cat([gate, up], dim=1)
        weights[f"{path}.down_proj"] = down

    def _quantize_layer(self, path: str, weight: QuantizedWeight, weights: dict) -> None:
        """Swap the Linear at `path` for the quantized layer of `weight` (and its bias, left
        in `weights` too: the new layer's parameter, loaded by name with the others)."""
        parent, _, attr = path.rpartition(".")
        bias = weights.get(path + ".bias")
        self.get_submodule(parent).register_module(
            attr, quantized_linear(weight, bias, self.backend)
        )


def _stage_name(name: str, first_layer: int) -> str:
    """A checkpoint name as a pipeline stage's modules hold it: layer i is its
    `layers[i - first_layer]`."""
    if not name.startswith("layers."):
        return name
    index, rest = name.removeprefix("layers.").split(".", 1)
    return f"layers.{int(index) - first_layer}.{rest}"


def _stack_experts(weights: dict, prefix: str, num_experts: int) -> None:
    """Per-expert gate/up/down matrices (`experts.{e}.gate_proj.weight`, ...) -> the stacked
    `experts.gate_up_proj` (E, 2I, H) and `experts.down_proj` (E, H, I)."""

    def take(e: int, name: str) -> torch.Tensor:
        return weights.pop(f"{prefix}{e}.{name}_proj.weight")

    experts = range(num_experts)
    weights[prefix + "gate_up_proj"] = torch.stack(
        [torch.cat((take(e, "gate"), take(e, "up"))) for e in experts]
    )
    weights[prefix + "down_proj"] = torch.stack([take(e, "down") for e in experts])


def _cat_rows(parts: list) -> torch.Tensor | QuantizedWeight:
    """Fuse matrices (or biases) along their output rows, quantized or not."""
    if isinstance(parts[0], QuantizedWeight):
        return QuantizedWeight.cat_rows(parts)
    return torch.cat(parts)
