"""Attention kernels over the paged KV cache.

`torch_attention` holds the PyTorch backend the engine runs on the CPU, tuned (batched
decode buckets, one plan per forward pass); the Triton kernels are tested against it, and
both against a naive per-sequence loop in the tests. `backend` states the contract (one
`KernelBackend` per backend: attention, layer ops, optional matmuls). Every implementation
shares one layout:

- key_cache / value_cache: (num_blocks, block_size, num_kv_heads, head_dim)
- slot_mapping: (num_tokens,) int64, slot = block_id * block_size + offset
- block_tables: (num_seqs, max_blocks_per_seq) int32/int64, padded with 0
- seq_lens: (num_seqs,) context length of each sequence *including* this step's tokens
- query_start_loc: (num_seqs + 1,) int64 offsets of each sequence's query tokens
"""

from pagefleet_kernels.backend import KernelBackend
from pagefleet_kernels.metadata import AttentionMetadata
from pagefleet_kernels.torch_attention import paged_attention, write_kv_cache

__all__ = ["AttentionMetadata", "KernelBackend", "paged_attention", "write_kv_cache"]
