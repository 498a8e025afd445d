"""A KV tier below the prefix cache: blocks the device computed, kept in host memory
(--kv-offloading-size, vLLM's flag) and in files (--kv-offload-dir, `kv_tier_files`) after
the device cache lets them go, and loaded back into device blocks when a prompt's prefix
misses the device cache but hits the tier.

A block is found by its chained hash (`block_manager`), under a namespace digest of
everything that changes its bytes: the model (its URI, name and configuration), the dtype
and KV cache dtype, the block size, the quantization and this shard's place. Two engines
share a block only when all of these agree, so a file written by another model, or by
this one in another dtype, is never found (and, renamed into place, fails its header).
Blocks computed under a LoRA adapter stay on the device: an adapter's id, which seeds
their hashes, names it in this process only.

A request's blocks that only the files hold are read ahead when it arrives, by a reader
thread (`prefetch`), into a staging area its admission takes them from: the scheduler
passes over the request until its read is done, so the other requests' steps never wait
on the disk.

Every block the prefix cache names (and that the tier does not hold yet) is copied out
once after the step that computed it: into host memory at once (least recently used out
first, within the cap), to its file by the writer thread. A block leaving the device
cache is then in the tier already, and a finished request's blocks are too.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from pagefleet_serve.engine.kv_tier_files import FileTier
from pagefleet_serve.kv_event_messages import MEDIUM_CPU, MEDIUM_STORAGE
from pagefleet_serve.messages import KVTierStats

GIB = 2**30
# What blocks read ahead may hold until their requests are admitted (the oldest go first:
# a request that no longer needs its blocks, aborted or served by the device, leaves them).
_STAGING_BYTES = GIB


def tier_namespace(**identity: object) -> bytes:
    """The digest of what changes a block's bytes (see the module's doc)."""
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).digest()


class _HostBlocks:
    """Blocks in host memory, least recently used first, within `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.stored_bytes = 0

    def get(self, key: bytes) -> torch.Tensor | None:
        block = self.blocks.get(key)
        if block is not None:
            self.blocks.move_to_end(key)
        return block

    def pop(self, key: bytes) -> torch.Tensor | None:
        block = self.blocks.pop(key, None)
        if block is not None:
            self.stored_bytes -= block.numel()
        return block

    def put(self, key: bytes, block: torch.Tensor) -> None:
        if key in self.blocks or block.numel() > self.max_bytes:
            return
        self.blocks[key] = block
        self.stored_bytes += block.numel()
        while self.stored_bytes > self.max_bytes:
            _, evicted = self.blocks.popitem(last=False)
            self.stored_bytes -= evicted.numel()


class KVTier:
    def __init__(
        self,
        namespace: bytes,
        block_size: int,
        host_bytes: int = 0,
        directory: str | None = None,
        directory_max_bytes: int = 0,
    ) -> None:
        """`host_bytes`: the host-memory cap (0: none); `directory`: the file store's
        (None: none), kept under `directory_max_bytes`."""
        self.namespace = namespace
        self.block_size = block_size
        self.host = _HostBlocks(host_bytes) if host_bytes else None
        self.files = (
            FileTier(directory, directory_max_bytes, namespace) if directory is not None else None
        )
        # Read ahead by the reader thread, until admission takes them.
        self._staged = _HostBlocks(_STAGING_BYTES)
        self._staged_lock = threading.Lock()
        self._reads: dict[str, Future[None]] = {}  # request id -> its read ahead
        self._reader = (
            ThreadPoolExecutor(1, thread_name_prefix="kv-tier-reader") if self.files else None
        )
        self.query_tokens = 0  # tokens looked up here (the device cache missed them)
        self.hit_tokens = {MEDIUM_CPU: 0, MEDIUM_STORAGE: 0}
        self.bytes_loaded = {MEDIUM_CPU: 0, MEDIUM_STORAGE: 0}
        self.bytes_stored = {MEDIUM_CPU: 0, MEDIUM_STORAGE: 0}

    def key(self, block_hash: bytes) -> bytes:
        return hashlib.sha256(self.namespace + block_hash).digest()

    def prefetch(self, request_id: str, block_hashes: list[bytes]) -> None:
        """Start reading the files of a new request's blocks that host memory lacks,
        from the first, up to the first the files lack (the reader thread's work). Only
        when the first one's file is there: a new prompt's request is not held up behind
        another's slow read."""
        if self._reader is None:
            return
        wanted = [
            (self.key(block_hash), block_hash)
            for block_hash in block_hashes
            if self.host is None or self.key(block_hash) not in self.host.blocks
        ]
        if wanted and self.files.path_of(wanted[0][0]).exists():
            self._reads[request_id] = self._reader.submit(self._read_ahead, wanted)

    def _read_ahead(self, wanted: list[tuple[bytes, bytes]]) -> None:
        for key, block_hash in wanted:
            block = self.files.read(key, block_hash)
            if block is None:
                return
            with self._staged_lock:
                self._staged.put(key, block)

    def ready(self, request_id: str) -> bool:
        """Whether the request's read ahead (if any) is done."""
        read = self._reads.get(request_id)
        if read is None:
            return True
        if not read.done():
            return False
        del self._reads[request_id]
        return True

    def forget(self, request_id: str) -> None:
        """The request ended: its read ahead no longer matters."""
        self._reads.pop(request_id, None)

    def wait_for_reads(self, timeout: float) -> None:
        """With nothing else to run, wait a moment for a read ahead to finish."""
        if self._reads:
            wait(list(self._reads.values()), timeout=timeout, return_when=FIRST_COMPLETED)

    def fetch(self, block_hashes: list[bytes]) -> list[tuple[torch.Tensor, str]]:
        """The bytes of the blocks the tier holds, from the first of `block_hashes` up to
        the first it misses, each with the medium it came from: host memory, or the files
        (read ahead: the step never reads a file), whose blocks host memory keeps from then
        on."""
        found = []
        for block_hash in block_hashes:
            key = self.key(block_hash)
            block = self.host.get(key) if self.host is not None else None
            if block is not None:
                found.append((block, MEDIUM_CPU))
                continue
            with self._staged_lock:
                block = self._staged.pop(key)
            if block is None:
                break
            if self.host is not None:
                self.host.put(key, block)
            found.append((block, MEDIUM_STORAGE))
        return found

    def count(self, num_query_tokens: int, loaded: list[tuple[torch.Tensor, str]]) -> None:
        """A prompt looked up `num_query_tokens` tokens here and took `loaded`."""
        self.query_tokens += num_query_tokens
        for block, medium in loaded:
            self.hit_tokens[medium] += self.block_size
            self.bytes_loaded[medium] += block.numel()

    def wants(self, block_hash: bytes) -> bool:
        """Whether a block the device computed should be copied out (some medium lacks it)."""
        key = self.key(block_hash)
        if self.host is not None and key not in self.host.blocks:
            return True
        return self.files is not None and not self.files.knows(key)

    def store(self, block_hash: bytes, block: torch.Tensor) -> None:
        """Keep a block's bytes (a CPU uint8 tensor of its own, never written again)."""
        key = self.key(block_hash)
        if self.host is not None and key not in self.host.blocks:
            self.host.put(key, block)
            self.bytes_stored[MEDIUM_CPU] += block.numel()
        if self.files is not None:
            self.files.write(key, block_hash, block)

    def stats(self) -> KVTierStats:
        files = self.files
        return KVTierStats(
            query_tokens=self.query_tokens,
            cpu_hit_tokens=self.hit_tokens[MEDIUM_CPU],
            storage_hit_tokens=self.hit_tokens[MEDIUM_STORAGE],
            cpu_bytes_loaded=self.bytes_loaded[MEDIUM_CPU],
            storage_bytes_loaded=self.bytes_loaded[MEDIUM_STORAGE],
            cpu_bytes_stored=self.bytes_stored[MEDIUM_CPU],
            storage_bytes_written=files.bytes_written if files else 0,
            cpu_stored_bytes=self.host.stored_bytes if self.host else 0,
            storage_stored_bytes=files.stored_bytes if files else 0,
            storage_queue_depth=files.queue_depth if files else 0,
            storage_dropped_writes=files.num_dropped_writes if files else 0,
            storage_write_errors=files.num_write_errors if files else 0,
            storage_invalid_blocks=files.num_invalid if files else 0,
        )

    def close(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=True, cancel_futures=True)
        if self.files is not None:
            self.files.close()
