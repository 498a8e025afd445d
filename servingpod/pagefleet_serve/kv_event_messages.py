"""KV cache events in vLLM's wire format, for whoever routes by what a pod's cache holds
(llm-d's KV-cache indexer, `pagefleet router`): torch-free, so that a router decodes
with the same definitions the pod encodes with.

Each ZMQ message is [topic, sequence number (8 bytes, big-endian), msgpack payload]; the
payload is a batch, encoded as an array [ts, events, data_parallel_rank], each event a map
tagged by its `type` (the class name). A block is named by its hash in the pod's prefix
cache (32 bytes of sha256 over its parent's hash and its token ids): `BlockStored` lists
new full blocks of one sequence in order, each chained to the one before it, the first to
`parent_block_hash` (None at the sequence's start), with their tokens; `BlockRemoved`
lists blocks evicted; `AllBlocksCleared` empties the whole cache.
"""

from __future__ import annotations

import hashlib
from array import array

import msgspec


def hash_block(parent_hash: bytes | None, token_ids: list[int], extra_keys: bytes = b"") -> bytes:
    """A full block's name in a pod's prefix cache: its parent's and its own tokens'
    (int64) sha256, so that equal names mean equal prefixes. `extra_keys`: what else its
    K/V depends on, the hashes of the images whose tokens it holds (two images behind the
    same placeholder tokens never share a block)."""
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(array("q", token_ids).tobytes())
    digest.update(extra_keys)
    return digest.digest()


MEDIUM_GPU = "GPU"  # vLLM's name for the accelerator's KV pool, whatever the device
MEDIUM_CPU = "CPU"  # the KV tier's host memory (--kv-offloading-size)
MEDIUM_STORAGE = "STORAGE"  # the KV tier's files (--kv-offload-dir)


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """An event; encoded as a map with its class name under `type`."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


# The replay socket's answer ends with this sequence number and an empty payload.
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
