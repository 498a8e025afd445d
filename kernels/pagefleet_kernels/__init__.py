"""Attention kernels over the paged KV cache.

`reference` holds the PyTorch implementations the engine runs on the CPU; they are also
the ground truth the Triton kernels are tested against. Every implementation shares one
layout:

- key_cache / value_cache: (num_blocks, block_size, num_kv_heads, head_dim)
- slot_mapping: (num_tokens,) int64, slot = block_id * block_size + offset
- block_tables: (num_seqs, max_blocks_per_seq) int32/int64, padded with 0
- seq_lens: (num_seqs,) context length of each sequence *including* this step's tokens
- query_start_loc: (num_seqs + 1,) int64 offsets of each sequence's query tokens
"""

from pagefleet_kernels.reference import paged_attention, write_kv_cache

__all__ = ["paged_attention", "write_kv_cache"]
