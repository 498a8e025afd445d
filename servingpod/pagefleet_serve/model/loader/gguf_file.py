"""A GGUF file's metadata and tensors, read from a memory map.

The `gguf` package's GGUFReader builds a numpy view of every part of every metadata field:
about 250,000 of them for SmolLM2's 49k-token vocabulary and its merges, several seconds
per load, paid by every process that starts an engine. This reader walks the header with
`struct` and maps only the tensors' data. It follows GGUF versions 2 and 3 (little-endian),
and gives tensors the shapes GGUFReader gives them, so `gguf.quants.dequantize` takes
their data as it is. An array of strings (the vocabulary, its merges) is a `StringArray`:
its strings' places found, each decoded only when read (a load reads none of them).
"""

import math
import mmap
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

_SCALAR_FORMATS = {
    gguf.GGUFValueType.UINT8: "<B",
    gguf.GGUFValueType.INT8: "<b",
    gguf.GGUFValueType.UINT16: "<H",
    gguf.GGUFValueType.INT16: "<h",
    gguf.GGUFValueType.UINT32: "<I",
    gguf.GGUFValueType.INT32: "<i",
    gguf.GGUFValueType.FLOAT32: "<f",
    gguf.GGUFValueType.BOOL: "<?",
    gguf.GGUFValueType.UINT64: "<Q",
    gguf.GGUFValueType.INT64: "<q",
    gguf.GGUFValueType.FLOAT64: "<d",
}
# Tensor types stored as plain numbers (the rest are blocks of bytes).
_ELEMENT_DTYPES = {
    gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F16: np.float16,
    gguf.GGMLQuantizationType.F64: np.float64,
    gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16,
    gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: gguf.GGMLQuantizationType
    # (rows, columns) of numbers for the plain types; (rows, bytes per row) of uint8 for
    # block-quantized ones. Read-only, backed by the file.
    data: np.ndarray


class StringArray(Sequence):
    """A metadata array of strings, decoded from the file as its items are read; equal to
    the list of them."""

    def __init__(self, data: np.ndarray, places: list[tuple[int, int]]) -> None:
        self._data = data
        self._places = places  # (offset, length) of each string

    def __len__(self) -> int:
        return len(self._places)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        start, length = self._places[index]
        return self._data[start : start + length].tobytes().decode("utf-8", errors="replace")

    def __eq__(self, other: object) -> bool:
        return list(self) == other if isinstance(other, (list, StringArray)) else NotImplemented

    def __repr__(self) -> str:
        return f"StringArray({len(self)} strings)"


class GGUFFile:
    """`fields`: metadata key -> Python value (lists for arrays); `tensors` in file order."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._data = np.frombuffer(self._map, np.uint8)
        self._offset = 0
        try:
            self._read()
        except (struct.error, ValueError) as exc:
            raise ValueError(f"{self.path.name}: not a readable GGUF file: {exc}") from None

    def release(self, tensor: GGUFTensor) -> None:
        """Drop the tensor's pages from this process's resident memory once its data has
        been copied out (a later read faults them in again from the page cache): without
        it, a load holds the whole file on top of the weights made from it."""
        start = tensor.data.ctypes.data - self._data.ctypes.data
        first = start - start % mmap.PAGESIZE
        self._map.madvise(mmap.MADV_DONTNEED, first, start + tensor.data.nbytes - first)

    def _read(self) -> None:
        magic, version = self._unpack("<4sI")
        if magic != b"GGUF":
            raise ValueError(f"magic is {magic!r}, not b'GGUF'")
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(
                f"version {version} (byte-swapped: {version & 0xFFFF == 0}) is not "
                f"supported; versions {SUPPORTED_VERSIONS} little-endian are"
            )
        tensor_count, field_count = self._unpack("<QQ")
        self.fields: dict[str, object] = {}
        for _ in range(field_count):
            key = self._string()
            self.fields[key] = self._value(gguf.GGUFValueType(self._unpack("<I")[0]))
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._data, self._offset)
        self._offset += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        raw = self._data[self._offset : self._offset + length].tobytes()
        if len(raw) != length:
            raise ValueError("the file ends inside a string")
        self._offset += length
        return raw.decode("utf-8", errors="replace")

    def _value(self, kind: gguf.GGUFValueType):
        if kind in _SCALAR_FORMATS:
            return self._unpack(_SCALAR_FORMATS[kind])[0]
        if kind == gguf.GGUFValueType.STRING:
            return self._string()
        element = gguf.GGUFValueType(self._unpack("<I")[0])
        (count,) = self._unpack("<Q")
        if element in _SCALAR_FORMATS:  # numbers: one frombuffer, not `count` unpacks
            dtype = np.dtype(_SCALAR_FORMATS[element])
            values = np.frombuffer(self._data, dtype, count, self._offset)
            self._offset += count * dtype.itemsize
            return values.tolist()
        if element == gguf.GGUFValueType.STRING:
            return self._string_array(count)
        return [self._value(element) for _ in range(count)]

    def _string_array(self, count: int) -> StringArray:
        """`count` strings' places, walked by their lengths (none decoded)."""
        places, offset, end, unpack = [], self._offset, len(self._data), struct.unpack_from
        for _ in range(count):
            (length,) = unpack("<Q", self._data, offset)
            offset += 8
            if offset + length > end:
                raise ValueError("the file ends inside a string")
            places.append((offset, length))
            offset += length
        self._offset = offset
        return StringArray(self._data, places)

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        (dims,) = self._unpack("<I")
        shape = self._unpack(f"<{dims}Q")
        kind, offset = self._unpack("<IQ")
        return name, shape, kind, offset

    def _tensor(self, start: int, name: str, shape: tuple, kind: int, offset: int) -> GGUFTensor:
        tensor_type = gguf.GGMLQuantizationType(kind)
        rows_first = tuple(reversed(shape))  # GGUF lists the fastest-varying dimension first
        count = math.prod(shape)
        if tensor_type in _ELEMENT_DTYPES:
            dtype = np.dtype(_ELEMENT_DTYPES[tensor_type])
        else:
            block_size, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
            dtype, count = np.dtype(np.uint8), count // block_size * block_bytes
            rows_first = gguf.quants.quant_shape_to_byte_shape(rows_first, tensor_type)
        data = np.frombuffer(self._data, dtype, count, start + offset)
        return GGUFTensor(name, tensor_type, data.reshape(rows_first))
