"""model/safetensors_reader.py against the safetensors package's own writer and reader:
every dtype read whole, straight into place or converted, several files in parallel, and
malformed files refused by name."""

import pytest
import torch
from pagefleet_serve.model.loader.safetensors_reader import (
    SafetensorsFormatError,
    read_files,
    read_header,
)
from safetensors.torch import load_file, save_file

TENSORS = {
    "f32": torch.randn(5, 7),
    "bf16": torch.randn(3, 4).to(torch.bfloat16),
    "f16": torch.randn(9).to(torch.float16),
    "i64": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    "flag": torch.tensor([True, False, True]),
    "scalar": torch.tensor(2.5),
    "empty": torch.zeros(0, 4),
    "f8": torch.randn(4, 4).to(torch.float8_e4m3fn),
}


def test_every_dtype_is_read_as_the_safetensors_package_reads_it(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(TENSORS, path, metadata={"format": "pt"})
    reference = load_file(path)
    entries = read_header(path)
    assert [e.offset for e in entries] == sorted(e.offset for e in entries)
    assert {e.name for e in entries} == set(TENSORS)
    same = {}
    as_float32 = {}

    def place(entry):
        same[entry.name] = torch.empty(entry.shape, dtype=entry.dtype)
        return same[entry.name]

    read_files([path], place)
    for name, tensor in reference.items():
        assert same[name].dtype == tensor.dtype
        assert torch.equal(
            same[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)
        ), name

    def convert(entry):
        if entry.dtype in (torch.bool, torch.float8_e4m3fn):
            return None  # skipped
        as_float32[entry.name] = torch.empty(entry.shape, dtype=torch.float32)
        return as_float32[entry.name]

    read_files([path], convert)
    assert set(as_float32) == set(TENSORS) - {"flag", "f8"}
    for name, tensor in as_float32.items():
        assert torch.equal(tensor, reference[name].to(torch.float32)), name


def test_rows_of_a_fused_matrix_are_filled_in_place_from_parallel_files(tmp_path):
    parts = [torch.randn(4, 6) for _ in range(3)]
    files = []
    for index, part in enumerate(parts):
        files.append(tmp_path / f"model-{index}.safetensors")
        save_file({f"part{index}": part, f"bias{index}": torch.randn(6)}, files[-1])
    fused = torch.zeros(12, 6)

    def place(entry):
        if entry.name.startswith("part"):
            index = int(entry.name[4:])
            return fused[4 * index : 4 * index + 4]
        return None

    read_files(files, place)
    assert torch.equal(fused, torch.cat(parts))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda raw: raw[:5], "too short for a safetensors header"),
        (lambda raw: (2**40).to_bytes(8, "little") + raw[8:], "is not plausible"),
        (lambda raw: raw[:8] + b"[" + raw[9:], "unreadable header"),
        (lambda raw: raw[:-10], "byte range does not hold"),
    ],
)
def test_a_malformed_file_is_refused_naming_it(tmp_path, damage, message):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.randn(8, 8)}, path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(SafetensorsFormatError, match=message) as caught:
        read_files([path], lambda entry: torch.empty(entry.shape))
    assert str(path) in str(caught.value)
