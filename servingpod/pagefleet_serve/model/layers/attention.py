"""Attention over the paged KV cache, through the kernel backend: each layer writes its
step's keys and values into its cache's slots, then attends every query token to its
sequence's cached keys (`KernelBackend.write_kv_cache`, `paged_attention`), with the
layer's sliding window, logit soft-capping and sink logits where its family has them."""

import torch
from pagefleet_kernels.metadata import AttentionMetadata
from torch import nn

from pagefleet_serve.model.context import current_context
from pagefleet_serve.model.layers.linear import parameter
from pagefleet_serve.model.weights import Weight, cut, load_into


class Attention(nn.Module):
    """This rank's `num_heads` query heads over its `num_kv_heads` key/value heads.
    `sliding_window`: keys within this many positions (the query's included); `softcap`:
    scores -> cap * tanh(scores / cap); `sinks`: a learned logit per query head joins each
    softmax's denominator (gpt-oss), this rank's heads `sink_heads` of the model's."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sink_heads: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        context = current_context()
        self.backend = context.backend
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.sinks: nn.Parameter | None = None
        self.sink_heads = sink_heads
        if sink_heads is not None:
            self.sinks = parameter((num_heads,), self.weight_loader, context.dtype)

    def forward(self, q, k, v, kv_cache, attn: AttentionMetadata) -> torch.Tensor:
        """Write k/v to the paged cache, attend: (T, heads * D)."""
        cache = kv_cache  # LayerKVCache: key, value (+ their scales when int8/fp8)
        self.backend.write_kv_cache(
            k, v, cache.key, cache.value, attn.slot_mapping, cache.key_scale, cache.value_scale
        )
        out = self._attend(q, cache, attn)
        span = attn.bidirectional
        if span is not None:
            # The rows of a bidirectional span attend again, each to its whole span: their
            # keys are all in the cache once this step's are written (a prompt's chunk
            # never ends inside a span, see engine/scheduler.py).
            out[span.rows] = self._attend(q.index_select(0, span.rows), cache, span.attn)
        return out.reshape(-1, self.num_heads * self.head_dim)

    def _attend(self, q, cache, attn: AttentionMetadata) -> torch.Tensor:
        return self.backend.paged_attention(
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

    def weight_loader(self, param: nn.Parameter, weight: Weight, shard_id=None) -> None:
        """The sink logits of this rank's heads."""
        if (
            self.sink_heads is not None
            and self.sink_heads[1] - self.sink_heads[0] != weight.shape[0]
        ):
            weight = cut(weight, 0, [self.sink_heads])
        load_into(weight, param.data)
