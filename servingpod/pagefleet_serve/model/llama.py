"""A Llama-family decoder over the paged KV cache, in plain PyTorch.

One model class serves Llama, Mistral, Qwen2/2.5, Qwen3, Phi-3, Gemma 2 and Gemma 3: they
differ only in switches of `ModelConfig` (q/k/v and o biases, per-head q/k RMSNorm,
sliding-window layers with their own rope base, Gemma's (1 + weight) norms around both
sublayers, GeGLU, scaled embeddings, attention and final logit soft-capping) and in
whether the checkpoint already has q/k/v and gate/up fused (Phi-3).

The batch is flattened: `input_ids` / `positions` hold every scheduled token of every
sequence; the attention backend uses `AttentionMetadata` to find each token's sequence and
context; the backend's `layer_ops` (pagefleet_kernels.layer_ops, or their C++ versions with
the CPU backend, their Triton ones with the Triton backend) do the norms, rotary embedding
and MLP activation. Weight names follow Hugging Face's LlamaForCausalLM; q/k/v and gate/up
are fused at load time (one matmul each).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from pagefleet_kernels import layer_ops
from pagefleet_kernels.backend import AttentionMetadata
from torch import nn

from pagefleet_serve.model.quant import DEQUANTIZE_ROWS_FLOAT32, QuantizedLinear, QuantizedWeight

HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
# Up to this many float32 rows on the CPU, logits are the product with the vocabulary
# matrix as it lies (see `compute_logits`; measured slower than MKL's GEMM from 12 rows).
FEW_LOGIT_ROWS = 8
# The batch size oneDNN is told to expect when a weight is prepacked; any batch runs. 64
# measured as fast as 1 at one and eight rows and faster from 64 rows up.
PREPACK_BATCH_HINT = 64
# Up to this many float32 rows, a prepacked layer multiplies with its weight as it lies
# through the backend's `linear` (the C++ CPU ops), where it has one (see `Linear`).
FEW_ROWS_NATIVE = 8


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
    # long_factor, original_max_position_embeddings, attention_factor), freqs (GGUF).
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
        """What cos and sin are multiplied by (longrope's attention scaling; else 1)."""
        return float(dict(self.rope_scaling or ()).get("attention_factor", 1.0))

    def layer_sliding_window(self, layer: int) -> int | None:
        if self.sliding_layers is not None and not self.sliding_layers[layer]:
            return None
        return self.sliding_window


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
    elif scaling.get("rope_type") == "freqs":  # GGUF's rope_freqs tensor: divisors per dim
        inv_freq = inv_freq / torch.tensor(scaling["divisors"], dtype=torch.float32)
    return inv_freq.float()


class Linear(nn.Linear):
    """A linear layer, bias-free unless asked.

    On the CPU, `prepack` reorders the weight once into oneDNN's blocked layout and multiplies
    with it from then on (`torch.ops.mkldnn._linear_pointwise`, what inductor's CPU freezing
    uses; vLLM's CPU backend prepacks its oneDNN weights the same way). `F.linear` reorders
    the weight on every call: the 120 matmuls of a SmolLM2 decode step measured 1.9x / 1.9x
    / 1.4x / 1.1x faster prepacked at batch 1 / 8 / 64 / 2048 (bfloat16, identical results;
    float32 1.3-2.0x, within rounding of MKL's). Unpacked, a single bfloat16/float16 row is computed as two rows (a
    broadcast, no copy): PyTorch sends one row to a matrix-vector routine several times
    slower than a two-row product.

    A float32 step of a few rows (decode at small batches) is bound by reading the weight,
    and oneDNN's prepacked matmul read it at 10-12 GB/s on a 2-core AVX2 EPYC that streams
    about twice that. Where the backend has a `linear` for such rows (the C++ CPU ops), a
    float32 weight is therefore kept as it lies next to its packed copy, and up to
    `FEW_ROWS_NATIVE` rows go to that kernel: a SmolLM2 step's 121 matmuls took 1.2-1.6x
    less time at 1-4 rows and 1.1-1.25x less at 8 (two runs), the same at 16, and more from
    32 rows on (oneDNN's blocking). The cost is memory: float32 layers held twice (SmolLM2: 425 MB;
    a tied LM head is the embedding itself)."""

    packed_weight: torch.Tensor | None = None  # oneDNN's layout, once prepacked
    few_rows = None  # the backend's x @ weight.T for a few float32 rows, once prepacked

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)

    def prepack(self, ops=None) -> None:
        """Reorder the weight for oneDNN (CPU only). The module keeps the original only for
        `ops.linear` (the layer ops of the backend: a float32 weight, when they have one);
        otherwise its reference is released. A weight another module shares (a tied
        embedding) lives on there, and the packed one is a copy."""
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(
            self.weight.detach(), PREPACK_BATCH_HINT
        )
        few_rows = getattr(ops, "linear", None)
        if few_rows is not None and self.weight.dtype == torch.float32:
            self.few_rows = few_rows
        else:
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            if self.few_rows is not None and x.dim() == 2 and x.shape[0] <= FEW_ROWS_NATIVE:
                y = self.few_rows(x, self.weight)
                if y is not None:
                    return y if self.bias is None else y + self.bias
            return torch.ops.mkldnn._linear_pointwise(
                x, self.packed_weight, self.bias, "none", [], ""
            )
        if x.shape[0] == 1 and x.dtype != torch.float32 and x.device.type == "cpu":
            return F.linear(x.expand(2, -1), self.weight, self.bias)[:1]
        return F.linear(x, self.weight, self.bias)


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


def ops_of(backend):
    """The layer ops of an attention backend (see pagefleet_kernels.backend); without one
    (a model built only to load or inspect weights), the eager PyTorch ones."""
    return getattr(backend, "layer_ops", layer_ops)


class RMSNorm(nn.Module):
    """Normalized in float32, then cast back before the weight, as Hugging Face does;
    Gemma's (1 + weight) is applied in float32 (`unit_offset`)."""

    def __init__(self, size: int, eps: float, unit_offset: bool = False, ops=layer_ops) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.unit_offset = unit_offset
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps, self.unit_offset)

    def add(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + h, the norm of x + h): a residual add and the norm after it, in one op."""
        return self.ops.add_rms_norm(x, h, self.weight, self.eps, self.unit_offset)


def make_norm(config: ModelConfig, size: int, ops=layer_ops) -> RMSNorm:
    return RMSNorm(size, config.rms_norm_eps, config.norm_unit_offset, ops)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, backend, layer: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.o_bias)
        self.ops = ops_of(backend)
        if config.qk_norm:
            self.q_norm = make_norm(config, config.head_dim, self.ops)
            self.k_norm = make_norm(config, config.head_dim, self.ops)
        self.qk_norm = config.qk_norm
        self.sliding_window = config.layer_sliding_window(layer)
        self.softcap = config.attn_logit_softcapping
        self.backend = backend

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q, k, v (T, heads, D) of the normed hidden states: projected, q/k-normed, rotated."""
        qkv = self.qkv_proj(x)
        q_size, kv_size, _ = self.split
        qk = qkv[:, : q_size + kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        # q and k side by side: rotated in one pass, then split (views).
        q, k = self.ops.rope(qk, cos, sin).split((self.num_heads, self.num_kv_heads), dim=1)
        v = qkv[:, q_size + kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        return q, k, v

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
        )
        return out.reshape(-1, self.num_heads * self.head_dim)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, ops=layer_ops) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size)
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.act_and_mul(self.gate_up_proj(x), self.gelu))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend, layer: int) -> None:
        super().__init__()
        ops = ops_of(backend)
        self.input_layernorm = make_norm(config, config.hidden_size, ops)
        self.self_attn = LlamaAttention(config, backend, layer)
        # Llama: the norm before the MLP. Gemma 2 (Hugging Face's names): the norm of the
        # attention output, with two more around the MLP.
        self.post_attention_layernorm = make_norm(config, config.hidden_size, ops)
        self.sandwich_norms = config.sandwich_norms
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = make_norm(config, config.hidden_size, ops)
            self.post_feedforward_layernorm = make_norm(config, config.hidden_size, ops)
        self.mlp = LlamaMLP(config, ops)

    _fused = None  # see fused_around_attention; () where the layer has none
    _compiled = False

    def forward(self, x, cos, sin, kv_cache, attn) -> torch.Tensor:
        around = self.fused_around_attention(x) or self
        q, k, v = around.attention_inputs(x, cos, sin)
        return around.attention_outputs(x, self.self_attn.attend(q, k, v, kv_cache, attn))

    def fused_around_attention(self, x: torch.Tensor):
        """The backend's fused decoder layer (`decoder_layer` of the C++ CPU ops) for these
        rows, None where the layer's ops run one by one. It has `attention_inputs` and
        `attention_outputs` as below, computed by the same C++ ops in the same order (the
        same bits) in two calls instead of about ten, each of which costs 5-10 us from
        Python on a small CPU. It exists for float32 rows few enough for the quantized
        layers' own C++ matmuls (see `QuantizedLinear`), when all four matmuls have one."""
        if x.dtype != torch.float32 or x.shape[0] >= DEQUANTIZE_ROWS_FLOAT32:
            return None
        if self._fused is None:
            self._fused = self._bind_fused() or ()
        return self._fused or None

    def _bind_fused(self):
        make = getattr(self.self_attn.ops, "decoder_layer", None)
        attn, mlp = self.self_attn, self.mlp
        if make is None or self._compiled or self.sandwich_norms or attn.qk_norm:
            return None
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(isinstance(m, QuantizedLinear) for m in linears):
            return None
        bound = [m.fused_binding() for m in linears]
        norms = (self.input_layernorm, self.post_attention_layernorm)
        if None in bound or any(n.weight.dtype != torch.float32 for n in norms):
            return None
        norm = self.input_layernorm
        return make(
            norm.weight,
            self.post_attention_layernorm.weight,
            norm.eps,
            norm.unit_offset,
            *bound,
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            mlp.gelu,
        )

    def unbind_fused(self) -> None:
        """Bind the fused layer again on its next use: its matmuls changed (new tensors
        after `.to()`, int8 activations switched on)."""
        self._fused = None

    def _apply(self, fn, recurse=True):
        self.unbind_fused()
        return super()._apply(fn, recurse)

    # The layer around its attention: pure tensor functions, what compile_around_attention
    # compiles.
    def attention_inputs(self, x, cos, sin):
        return self.self_attn.project(self.input_layernorm(x), cos, sin)

    def attention_outputs(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        h = self.self_attn.o_proj(attended)
        if not self.sandwich_norms:
            x, normed = self.post_attention_layernorm.add(x, h)
            return x + self.mlp(normed)
        x, normed = self.pre_feedforward_layernorm.add(x, self.post_attention_layernorm(h))
        return x + self.post_feedforward_layernorm(self.mlp(normed))

    def compile_around_attention(self) -> None:
        """Compile the parts around attention with inductor (each into a few fused
        kernels); attention itself stays eager, it reads per-step metadata. Every layer
        shares the compiled code (the modules' weights are its inputs)."""
        self.attention_inputs = torch.compile(self.attention_inputs, dynamic=None)
        self.attention_outputs = torch.compile(self.attention_outputs, dynamic=None)
        self._compiled, self._fused = True, ()


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, backend) -> None:
        super().__init__()
        self.config = config
        # Given an (uninitialised) weight, Embedding skips its normal_ init, which on the meta
        # device imports torch._dynamo (~3 s of start-up); the checkpoint replaces it anyway.
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size),
        )
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, backend, i) for i in range(config.num_layers)]
        )
        self.ops = ops_of(backend)  # the backend's layer ops (also for quantized layers)
        self.norm = make_norm(config, config.hidden_size, self.ops)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
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
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.config.scale_embeddings:  # the factor rounded to the dtype, as Gemma does
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        rope = self._rope(positions, self._global_inv_freq(attn), x.dtype)
        local_rope = rope
        if self.config.local_rope_theta is not None:
            local_rope = self._rope(positions, self.inv_freq_local, x.dtype)
        windows = {layer.self_attn.sliding_window for layer in self.layers}
        self.layers[0].self_attn.backend.prepare(attn, kv_caches[0].key.shape[1], windows)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            cos, sin = local_rope if layer.self_attn.sliding_window else rope
            x = layer(x, cos, sin, kv_cache, attn)
        return self.norm(x)

    def prepack_linears(self) -> int:
        """Prepack every float linear layer for oneDNN on the CPU (see `Linear`); how many
        were packed. A tied LM head is packed as a copy, the embedding keeping its rows for
        lookups: SmolLM2 holds 56 MB more in bfloat16, and its batch-1 logits take 1.9 ms
        instead of 4.1."""
        linears = [m for m in self.modules() if type(m) is Linear]
        for linear in linears:
            linear.prepack(self.ops)
        return len(linears)

    def use_int8_activations(self) -> int:
        """Round the activations of every 4-bit matmul to int8 per 32 inputs (see
        `QuantizedLinear`); how many layers that is. A model without 4-bit weights is
        refused: the setting would change nothing."""
        layers = [m for m in self.modules() if isinstance(m, QuantizedLinear) and m.num_int4_parts]
        if not layers:
            raise ValueError(
                "activation_quantization 'int8' applies to 4-bit weights, and this model has "
                "none kept 4-bit: use quantization 'auto' with a Q4_0/Q4_1/Q8_0 GGUF"
            )
        for layer in layers:
            layer.round_activations_to_int8()
        for layer in self.layers:
            layer.unbind_fused()
        return len(layers)

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

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head, rows = self.lm_head, hidden.shape[0]
        few = 1 < rows <= FEW_LOGIT_ROWS and hidden.dtype == torch.float32
        plain = type(head) is Linear and head.bias is None and head.packed_weight is None
        if few and hidden.device.type == "cpu" and plain:
            # MKL's float32 GEMM packs the (transposed) weight on every call: for a few rows
            # of the vocabulary matrix, far larger than the caches, that doubles the memory
            # traffic (5 rows of SmolLM2's 49152 x 576: 23-26 ms vs 13-15 ms for the
            # product with the weight as it lies, one row 14 ms either way). Speculative
            # verification scores 1 + k rows of each sequence.
            logits = (head.weight @ hidden.T).T
        else:
            logits = head(hidden).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_hf_state_dict(self, weights: dict[str, torch.Tensor | QuantizedWeight]) -> None:
        """Load Hugging Face LlamaForCausalLM names (`model.` prefix optional), fusing
        q/k/v (weights and biases) and gate/up where they come apart (the loader fuses them
        as it streams, Phi-3 checkpoints come fused). A matrix given as a QuantizedWeight turns
        its layer into a QuantizedLinear (the embedding table is expanded: a lookup reads
        a few rows, not the whole table)."""
        weights = {k.removeprefix("model."): v for k, v in weights.items()}
        weights = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
        for i in range(self.config.num_layers):
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
        if self.config.tie_word_embeddings:
            weights.setdefault("lm_head.weight", weights["embed_tokens.weight"])
            if not isinstance(weights["lm_head.weight"], QuantizedWeight):
                weights["lm_head.weight"] = weights["embed_tokens.weight"]
        embedding = weights["embed_tokens.weight"]
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

    def _quantize_layer(self, path: str, weight: QuantizedWeight, weights: dict) -> None:
        """Swap the Linear at `path` for a QuantizedLinear of `weight` (and its bias)."""
        parent_path, _, attr = path.rpartition(".")
        parent = self.get_submodule(parent_path) if parent_path else self
        bias = weights.pop(path + ".bias", None)
        setattr(parent, attr, QuantizedLinear(weight, bias, self.ops))


def _cat_rows(parts: list) -> torch.Tensor | QuantizedWeight:
    """Fuse matrices (or biases) along their output rows, quantized or not."""
    if isinstance(parts[0], QuantizedWeight):
        return QuantizedWeight.cat_rows(parts)
    return torch.cat(parts)
