"""The KV tier's file store (--kv-offload-dir): one file per block, in a directory that
outlives the process and that several pods may share over one volume.

A file is named by its tier key (the block's chained hash under the engine's namespace,
see `kv_tier`) and holds a header (magic, the namespace, the block hash, the payload's
length and its CRC-32) before the block's bytes. A read checks all of them: a file that is
truncated, corrupted, or written under another namespace (another model, dtype, block
size or shard) is a miss, counted and removed, never served. Writes go through a bounded
queue to a thread of their own, so that the step never waits on the disk: a full queue
drops the write (counted), and each file is written to a temporary name and renamed, so
that a reader (this pod after a crash, or another pod) never sees half a block. A
directory that cannot be written (full, read-only) is logged and counted, never a failed
request. The directory is kept under its size cap least recently used first: reads and
writes of this process order its index, which starts from the files' modification times.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import struct
import threading
import zlib
from collections import OrderedDict
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_MAGIC = b"PFKV\x01"
# magic, namespace digest, block hash, payload bytes, CRC-32 of the payload; padded to 96
# bytes, so that the payload read after it is aligned for any element type.
_HEADER = struct.Struct("<5s32s32sQI15x")
_SUFFIX = ".kvblock"


def _power_of_two(n: int) -> bool:
    return n & (n - 1) == 0


class FileTier:
    def __init__(
        self, root: str, max_bytes: int, namespace: bytes, max_queue_size: int = 256
    ) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.namespace = namespace
        self.num_hits = 0  # blocks served from files
        self.num_invalid = 0  # truncated, corrupted or foreign files: missed and removed
        self.num_dropped_writes = 0  # writes the full queue turned away
        self.num_write_errors = 0  # writes the directory refused (full, read-only)
        self.bytes_read = 0
        self.bytes_written = 0
        self._lock = threading.Lock()  # the index, shared by the step and the writer
        self._index: OrderedDict[str, int] = OrderedDict()  # file name -> bytes, LRU first
        self._stored_bytes = 0
        self._queue: queue.Queue[tuple[bytes, bytes, torch.Tensor] | None] = queue.Queue(
            max_queue_size
        )
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._scan()
        except OSError as exc:
            self._write_failed(f"cannot use {self.root}: {exc}")
        self._thread = threading.Thread(target=self._run, name="kv-tier-writer", daemon=True)
        self._thread.start()

    @property
    def stored_bytes(self) -> int:
        return self._stored_bytes

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def path_of(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / (name + _SUFFIX)

    def knows(self, key: bytes) -> bool:
        """Whether this process has seen the block's file (written or read it, or found
        it at start-up)."""
        with self._lock:
            return self.path_of(key).name in self._index

    def read(self, key: bytes, block_hash: bytes) -> torch.Tensor | None:
        """The block's bytes, or None: no such file, or one that fails its checks."""
        path = self.path_of(key)
        try:
            with open(path, "rb") as file:
                data = bytearray(file.read())
        except FileNotFoundError:
            return None
        except OSError as exc:
            logger.warning("KV tier: cannot read %s: %s", path, exc)
            return None
        problem = self._check(data, block_hash)
        if problem is not None:
            self.num_invalid += 1
            logger.warning("KV tier: %s %s; recomputing the block", path, problem)
            self._remove(path)
            return None
        self.num_hits += 1
        self.bytes_read += len(data)
        with self._lock:
            if path.name in self._index:
                self._index.move_to_end(path.name)
            else:  # another pod's, written since the scan: it counts toward the cap too
                self._index[path.name] = len(data)
                self._stored_bytes += len(data)
        return torch.frombuffer(data, dtype=torch.uint8, offset=_HEADER.size)

    def _check(self, data: bytearray, block_hash: bytes) -> str | None:
        """What is wrong with a block file's bytes, or None."""
        if len(data) < _HEADER.size:
            return f"is truncated ({len(data)} bytes, less than its header)"
        magic, namespace, stored_hash, length, crc = _HEADER.unpack_from(data)
        if magic != _MAGIC:
            return "is not a PageFleet KV block file"
        if namespace != self.namespace or stored_hash != block_hash:
            return "holds another model's or configuration's block"
        if len(data) - _HEADER.size != length:
            return f"is truncated ({len(data) - _HEADER.size} of {length} payload bytes)"
        if zlib.crc32(memoryview(data)[_HEADER.size :]) != crc:
            return "fails its checksum"
        return None

    def write(self, key: bytes, block_hash: bytes, block: torch.Tensor) -> None:
        """Queue a block's bytes (a CPU uint8 tensor no one writes to again) for writing;
        a full queue drops it."""
        try:
            self._queue.put_nowait((key, block_hash, block))
        except queue.Full:
            self.num_dropped_writes += 1
            if _power_of_two(self.num_dropped_writes):  # 1, 2, 4, ...: a trace, not a flood
                logger.warning(
                    "KV tier: write queue full: %d block writes dropped so far",
                    self.num_dropped_writes,
                )

    def flush(self) -> None:
        """Wait until every queued write is done (or failed)."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop."""
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            key, block_hash, block = item
            try:
                self._write(key, block_hash, block)
            except OSError as exc:
                self._write_failed(f"cannot write to {self.root}: {exc}")
            finally:
                self._queue.task_done()

    def _write(self, key: bytes, block_hash: bytes, block: torch.Tensor) -> None:
        path = self.path_of(key)
        if path.exists():  # written before, by this pod or another
            with self._lock:
                if path.name in self._index:
                    self._index.move_to_end(path.name)
            return
        payload = block.numpy()
        header = _HEADER.pack(
            _MAGIC, self.namespace, block_hash, payload.nbytes, zlib.crc32(payload)
        )
        path.parent.mkdir(exist_ok=True)
        temp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(temp, "wb") as file:
                file.write(header)
                file.write(payload)
            os.replace(temp, path)
        except OSError:
            self._remove(temp)
            raise
        size = len(header) + payload.nbytes
        self.bytes_written += size
        with self._lock:
            self._index[path.name] = size
            self._stored_bytes += size
        self._shrink()

    def _shrink(self) -> None:
        """Remove the least recently used files until the directory fits its cap."""
        while True:
            with self._lock:
                if self._stored_bytes <= self.max_bytes or not self._index:
                    return
                name, size = self._index.popitem(last=False)
                self._stored_bytes -= size
            self._remove(self.root / name[:2] / name)

    def _scan(self) -> None:
        """Index the files already there (a restart, or other pods'), oldest first."""
        found = []
        for path in self.root.glob(f"??/*{_SUFFIX}"):
            try:
                stat = path.stat()
            except OSError:
                continue
            found.append((stat.st_mtime, path.name, stat.st_size))
        for _, name, size in sorted(found):
            self._index[name] = size
            self._stored_bytes += size
        self._shrink()

    def _write_failed(self, message: str) -> None:
        self.num_write_errors += 1
        if _power_of_two(self.num_write_errors):
            logger.warning("KV tier: %s (%d write errors so far)", message, self.num_write_errors)

    def _remove(self, path: Path) -> None:
        # Gone already (another pod took it), or the directory is read-only.
        with contextlib.suppress(OSError):
            path.unlink()
        with self._lock:
            size = self._index.pop(path.name, None)
            if size is not None:
                self._stored_bytes -= size
