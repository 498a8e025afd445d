"""What every decoder-only family in `model.models` shares: the embedding, a pipeline stage's run of decoder
layers, the final norm and the LM head over the paged KV cache, and the walk over the
checkpoint that hands each tensor to its parameter's weight loader.

The batch is flattened: `input_ids` / `positions` hold every scheduled token of every
sequence; the kernel backend attends using `AttentionMetadata` to find each token's
sequence and context. A family subclasses `CausalLM` with its decoder layer (`layer_class`)
and, where its checkpoint names differ, its mapping from them (`stacked_params_mapping`,
`checkpoint_name`, `load_weight`).
"""

from collections.abc import Iterable

import torch
from pagefleet_kernels.kv_cache import LayerKVCache
from pagefleet_kernels.metadata import AttentionMetadata
from torch import nn

from pagefleet_serve.model.config import ModelConfig
from pagefleet_serve.model.context import current_context
from pagefleet_serve.model.layers.fused import bind_fused_layer
from pagefleet_serve.model.layers.linear import LinearBase, ParallelLMHead, VocabParallelEmbedding
from pagefleet_serve.model.layers.linear_methods import use_int8_activations
from pagefleet_serve.model.layers.moe import FusedMoE, expert_param
from pagefleet_serve.model.layers.norm import RMSNorm
from pagefleet_serve.model.layers.rotary import RotaryEmbedding
from pagefleet_serve.model.layers.state import StateSpec
from pagefleet_serve.model.weights import Weight, is_kept_quantized
from pagefleet_serve.model_uri import UnsupportedModelError
from pagefleet_serve.parallel_shape import ModelShape, check_shape

# What a pipeline stage may leave out (the first stage holds the embedding, the last the
# final norm and the head).
_STAGE_PARTS = ("embed_tokens", "norm", "lm_head")


class CausalLM(nn.Module):
    # Checkpoint names -> the fused parameter they are part of: (the parameter's name
    # part, the checkpoint's, the shard id).
    stacked_params_mapping: tuple[tuple[str, str, object], ...] = (
        (".qkv_proj.", ".q_proj.", "q"),
        (".qkv_proj.", ".k_proj.", "k"),
        (".qkv_proj.", ".v_proj.", "v"),
        (".gate_up_proj.", ".gate_proj.", 0),
        (".gate_up_proj.", ".up_proj.", 1),
    )
    # Whether q/k norms span the whole projection (OLMoE), which constrains the split.
    whole_qk_norm = False
    # Whether the family reads MXFP4 checkpoints (its load_weight dequantizes them).
    reads_mxfp4 = False
    # Why the family cannot be split over tensor-parallel ranks (None: it can).
    unsplit_reason: str | None = None
    # Checkpoint tensors the model does not read, by name prefix (Qwen3-Next's and
    # Nemotron-H's multi-token-prediction layers, `mtp.`, for speculation this engine does
    # not do with them).
    unused_prefixes: tuple[str, ...] = ()
    # (the checkpoint's, ours): parts of tensor names a family's checkpoints spell
    # otherwise, replaced in this order by `checkpoint_name`.
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    # The family's decoder layer: (config, the model's layer index) -> module.
    layer_class: type[nn.Module]

    def __init__(self, config: ModelConfig) -> None:
        """The model, or a pipeline stage's part of it (see model.tensor_parallel): its
        layers (`layers[i]` is the model's layer `first_layer + i`), the embedding on the
        first stage, the final norm and the head on the last."""
        super().__init__()
        context = current_context()
        parallel = context.parallel
        if parallel.size > 1 and self.unsplit_reason is not None:
            raise UnsupportedModelError(f"{self.unsplit_reason}; use tensor_parallel_size 1")
        shape = ModelShape(
            config.num_heads, config.num_kv_heads, config.num_layers, self.whole_qk_norm
        )
        check_shape(parallel.size, parallel.stages, shape)
        self.config = config
        self.backend = context.backend
        self.load_dtype = context.dtype
        tied = config.tie_word_embeddings
        self.embed_tokens: VocabParallelEmbedding | None = None
        if parallel.first_stage or (parallel.last_stage and tied):
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.first_layer, end = parallel.layers(config.num_layers)
        self.layers = nn.ModuleList(
            self.layer_class(config, i) for i in range(self.first_layer, end)
        )
        self.norm: RMSNorm | None = None
        self.lm_head: ParallelLMHead | None = None
        if parallel.last_stage:
            self.norm = self.make_norm(config.hidden_size)
            self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.rope_scaling)
        self.windows = {self.layers[i].self_attn.attn.sliding_window for i in self.kv_layers()}

    def make_norm(self, size: int) -> RMSNorm:
        return RMSNorm(size, self.config.rms_norm_eps)

    def kv_layers(self) -> list[int]:
        """The layers (indices of this stage's) that keep K/V in the paged cache: the
        attention layers. A recurrent layer keeps its state slots instead, a layer of an
        MLP alone (Nemotron-H's) nothing at all."""
        return [i for i, layer in enumerate(self.layers) if layer.keeps_kv]

    def state_specs(self) -> list[tuple[StateSpec, ...]]:
        """Per layer, the per-sequence state of a recurrent layer (a hybrid model's
        convolution or state-space mixer, see `layers.state`); empty for an attention
        layer, whose cache is the paged KV."""
        return [layer.state_specs() for layer in self.layers]

    # -- the forward pass --------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        # Per layer its cache: a pagefleet_kernels.kv_cache.LayerKVCache for an attention
        # layer, its state tensors by name for a recurrent one (rows: `attn.state`'s slots),
        # None for a layer that keeps nothing.
        kv_caches: list,
        attn: AttentionMetadata,
        hidden: torch.Tensor | None = None,  # (T, H): a later pipeline stage's input
    ) -> torch.Tensor:
        """The final hidden states, normed (T, H); on a pipeline stage before the last, its
        layers' output, for the next stage."""
        x = self.embed(input_ids) if hidden is None else hidden
        ropes = self.layer_ropes(positions, attn, x.dtype)
        paged = [cache for cache in kv_caches if isinstance(cache, LayerKVCache)]
        if paged:
            self.backend.prepare(attn, paged[0].key.shape[1], self.windows)
        for layer, kv_cache, (cos, sin) in zip(self.layers, kv_caches, ropes, strict=True):
            x = layer(x, cos, sin, kv_cache, attn)
        return x if self.norm is None else self.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def layer_ropes(self, positions: torch.Tensor, attn: AttentionMetadata, dtype: torch.dtype):
        """The (cos, sin) each layer rotates by, in layer order."""
        return [self.rotary(positions, attn, dtype)] * len(self.layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(rows, vocab) float32 logits; under tensor parallelism on rank 0 only."""
        return self.lm_head.compute_logits(hidden)

    # -- loading -----------------------------------------------------------------------
    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's name as this model's modules hold it (None: not a weight
        the model reads)."""
        if name.endswith("rotary_emb.inv_freq") or name.startswith(self.unused_prefixes):
            return None
        name = name.removeprefix("model.")
        for theirs, ours in self.checkpoint_renames:
            name = name.replace(theirs, ours)
        return name

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        """Hand every checkpoint tensor this stage holds to its parameter's weight loader;
        ValueError when they do not fit the model."""
        self._params = dict(self.named_parameters())
        self._loaded: set[str] = set()
        for checkpoint_name, weight in weights:
            name = self.checkpoint_name(checkpoint_name)
            name = None if name is None else self._stage_name(name)
            if name is not None:
                self.load_weight(name, weight)
        self.finish_checkpoint()
        tied = self.config.tie_word_embeddings and self.lm_head is not None
        if tied and self.embed_tokens is not None and "embed_tokens.weight" in self._loaded:
            self._loaded.add("lm_head.weight")
        missing = sorted(set(self._params) - self._loaded)
        if missing:
            raise ValueError(f"weights do not fit the model's configuration: missing {missing[:5]}")
        for module in self.modules():
            if isinstance(module, (LinearBase, FusedMoE)):
                module.finish_loading()
        if tied:
            self.lm_head.tie(self.embed_tokens)
        del self._params, self._loaded
        self.bind_fused()

    def finish_checkpoint(self) -> None:
        """After the last tensor: a family that waits for tensors in pairs says what is
        left alone."""

    def load_weight(self, name: str, weight: Weight) -> None:
        """One tensor, by this model's name for it: a part of a fused or stacked parameter
        by the mappings, else the parameter of that name."""
        expert = expert_param(name)
        if expert is not None:
            self.load_param(*expert, weight)
            return
        for param_part, checkpoint_part, shard_id in self.stacked_params_mapping:
            if checkpoint_part in name:
                self.load_param(name.replace(checkpoint_part, param_part), shard_id, weight)
                return
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            if is_kept_quantized(weight):  # its own codes: not the embedding's rows
                self.load_param(name, None, weight)
            return
        self.load_param(name, None, weight)
        tied = self.config.tie_word_embeddings and self.lm_head is not None
        if name == "embed_tokens.weight" and tied and is_kept_quantized(weight):
            self.load_param("lm_head.weight", None, weight)  # the head keeps the codes

    def load_param(self, name: str, shard_id, weight: Weight) -> None:
        param = self._params.get(name)
        if param is None:
            raise ValueError(f"weights do not fit the model's configuration: unexpected {name!r}")
        param.weight_loader(param, weight, shard_id)
        self._loaded.add(name)

    def _stage_name(self, name: str) -> str | None:
        """`name` as this pipeline stage holds it (layer i is its `layers[i - first]`),
        None where the stage does not hold it."""
        if name.startswith("layers."):
            index, rest = name.removeprefix("layers.").split(".", 1)
            local = int(index) - self.first_layer
            return f"layers.{local}.{rest}" if 0 <= local < len(self.layers) else None
        held = (
            name.split(".")[0] not in _STAGE_PARTS or getattr(self, name.split(".")[0]) is not None
        )
        return name if held else None

    # -- after loading ----------------------------------------------------------------
    def bind_fused(self) -> None:
        """Bind each layer's fused form (see layers.fused): after loading, and again
        whenever its matmuls change."""
        for layer in self.layers:
            layer.fused = bind_fused_layer(layer, self.backend)

    def _apply(self, fn, recurse=True):  # .to() and the like: new tensors, new bindings
        super()._apply(fn, recurse)
        self.bind_fused()
        return self

    def prepack_linears(self) -> int:
        """Prepack every float linear layer for oneDNN on the CPU (see
        `linear_methods.PrepackedLinear`); how many were packed. A tied LM head is packed as
        a copy, the embedding keeping its rows for lookups: SmolLM2 holds 56 MB more in
        bfloat16, and its batch-1 logits take 1.9 ms instead of 4.1. 16-bit experts are
        prepacked too (`FusedMoE.prepack`), counted one per layer. One layer at a time, so
        that each replaced weight is freed before the next is packed."""
        linears = [m for m in self.modules() if isinstance(m, LinearBase)]
        count = sum(linear.prepack() for linear in linears)
        return count + sum(m.prepack() for m in self.modules() if isinstance(m, FusedMoE))

    def quantize_int8(self) -> None:
        """Every projection's and the head's matrix as int8 codes with one scale per output
        row (quantization int8); a tied head gets its own codes, the embedding keeps its
        rows."""
        for name, module in self.named_modules():
            if isinstance(module, LinearBase) and name.endswith(("_proj", "lm_head")):
                module.quantize_int8()
        self.bind_fused()

    def use_int8_activations(self) -> int:
        """Round the activations of every 4-bit matmul to int8 per 32 inputs (see
        `linear_methods.Int4Linear`); how many layers that is. A model without 4-bit
        weights is refused: the setting would change nothing."""
        count = use_int8_activations(self)
        if not count:
            raise ValueError(
                "activation_quantization 'int8' applies to 4-bit weights, and this model has "
                "none kept 4-bit: use quantization 'auto' with a Q4_0/Q4_1/Q8_0 GGUF"
            )
        self.bind_fused()
        return count

    def compile_around_attention(self) -> None:
        """torch.compile every layer's work before and after its attention (see
        `LlamaDecoderLayer.compile_around_attention`); the first steps of each new batch
        shape (one token, then any other count) pay the compilation."""
        for layer in self.layers:
            layer.compile_around_attention()
