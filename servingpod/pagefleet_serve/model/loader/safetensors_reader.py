"""Whole tensors of safetensors files read straight into the tensors that keep them.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's
dtype, shape and byte range in the data that follows) and the raw data. The `safetensors`
package's `get_tensor` copies a tensor out of the file's memory map, and the loader then
copied it again into the model's dtype or its place in a fused matrix. Here each tensor is
read once, with `os.preadv` in large sequential reads in file order, into its destination
when the dtypes agree (else into one buffer, converted by one copy), and the files of a
sharded checkpoint are read by parallel threads (reads and copies release the GIL).

Only whole tensors: a tensor-parallel rank's slices and float8 weights with their scales
go through `safetensors`' slices (model/loader.py).
"""

import json
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# A header is JSON text; anything far larger than any real one is not a safetensors file.
_MAX_HEADER_BYTES = 100 * 2**20
# One read call at most this much (the kernel's readahead makes them sequential anyway).
_READ_BYTES = 64 * 2**20
MAX_PARALLEL_FILES = 4


class SafetensorsFormatError(ValueError):
    """A file that is not a well-formed safetensors file; the message names it."""


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # in the file, from its start
    nbytes: int


def read_header(path: Path) -> list[Entry]:
    """The file's tensors, in the order of their data (metadata left out)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise SafetensorsFormatError(f"{path}: too short for a safetensors header")
        length = int.from_bytes(raw, "little")
        if length > _MAX_HEADER_BYTES:
            raise SafetensorsFormatError(f"{path}: a header of {length} bytes is not plausible")
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise SafetensorsFormatError(f"{path}: unreadable header: {exc}") from None
        size = os.fstat(f.fileno()).st_size
    data = 8 + length
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _dtype(path, name, info.get("dtype"))
        shape = tuple(int(d) for d in info["shape"])
        first, end = (int(x) for x in info["data_offsets"])
        nbytes = end - first
        if nbytes != _numel(shape) * dtype.itemsize or data + end > size or first < 0:
            raise SafetensorsFormatError(f"{path}: {name}'s byte range does not hold {shape}")
        entries.append(Entry(name, dtype, shape, data + first, nbytes))
    entries.sort(key=lambda e: e.offset)
    return entries


def expected_entries(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> list[Entry]:
    """The entries of a file not on disk yet, from its tensors' names, dtypes ("F32", ...)
    and shapes as known elsewhere (the Hub's copy of its header): their offsets are
    unknown (-1) until `read_files` reads the file's own header."""
    entries = []
    for name, (kind, shape) in tensors.items():
        dtype = _dtype(path, name, kind)
        entries.append(Entry(name, dtype, shape, -1, _numel(shape) * dtype.itemsize))
    return entries


def _dtype(path: Path, name: str, kind) -> torch.dtype:
    dtype = _DTYPES.get(kind)
    if dtype is None:
        raise SafetensorsFormatError(f"{path}: {name} has dtype {kind!r}")
    return dtype


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel


def _read_exactly(fd: int, target: torch.Tensor, offset: int, path: Path) -> None:
    view = memoryview(target.reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done : done + _READ_BYTES]], offset + done)
        if count == 0:
            raise SafetensorsFormatError(f"{path}: ends inside a tensor")
        done += count


def read_into(path: Path, placed: Iterable[tuple[Entry, torch.Tensor]]) -> None:
    """Fill each destination with its entry's data (converted to the destination's dtype);
    the destinations have the entries' shapes."""
    fd = os.open(path, os.O_RDONLY)
    try:
        for entry, destination in placed:
            if entry.nbytes == 0:
                continue
            if tuple(destination.shape) != entry.shape:
                raise ValueError(f"{entry.name}: {entry.shape} into {tuple(destination.shape)}")
            direct = destination.dtype == entry.dtype and destination.is_contiguous()
            buffer = destination if direct else torch.empty(entry.shape, dtype=entry.dtype)
            _read_exactly(fd, buffer, entry.offset, path)
            if not direct:
                destination.copy_(buffer)
    finally:
        os.close(fd)


def read_files(
    files: list[Path],
    place: Callable[[Entry], torch.Tensor | None],
    expected: dict[Path, list[Entry]] | None = None,
    arrive: Callable[[Path], object] | None = None,
) -> None:
    """Read every tensor `place` gives a destination for (None: skipped). `place` is called
    here, in this thread, for every entry of every file before any data is read; the files
    are then read by up to MAX_PARALLEL_FILES threads. `expected`: the files' entries
    when they are not on disk yet (see `expected_entries`), and `arrive(file)` returns once
    a file is; each file's own header must then list the same tensors."""
    headers = expected if expected is not None else {file: read_header(file) for file in files}
    plans = [
        (file, {e.name: d for e in headers[file] if (d := place(e)) is not None}) for file in files
    ]

    def read(file: Path, placed: dict[str, torch.Tensor]) -> None:
        if arrive is not None:
            arrive(file)
        entries = headers[file]
        if expected is not None:
            entries = read_header(file)
            got = {(e.name, e.dtype, e.shape) for e in entries}
            if got != {(e.name, e.dtype, e.shape) for e in expected[file]}:
                raise SafetensorsFormatError(
                    f"{file}: its header does not list the tensors its header on the Hub did"
                )
        read_into(file, [(e, placed[e.name]) for e in entries if e.name in placed])

    if len(plans) == 1:
        read(*plans[0])
        return
    with ThreadPoolExecutor(min(MAX_PARALLEL_FILES, len(plans)), "safetensors") as pool:
        for future in [pool.submit(read, file, placed) for file, placed in plans]:
            future.result()
