"""PageFleet's GGUF reader against the `gguf` package's GGUFReader: the same metadata and
the same tensor bytes, for the built-in model and for a file with every kind of value."""

import gguf
import numpy as np
import pytest
from pagefleet_serve.model.loader.gguf_file import GGUFFile
from pagefleet_serve.model.loader.resolve import builtin_gguf_path


def assert_same_as_gguf_reader(path, nested=()):
    """`nested`: keys of arrays of arrays, which GGUFReader's contents() flattens."""
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert {k: v for k, v in ours.fields.items() if k not in nested} == {
        k: v for k, v in expected.items() if k not in nested
    }
    assert len(ours.tensors) == len(theirs.tensors)
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.tensor_type) == (reference.name, reference.tensor_type)
        assert mine.data.dtype == reference.data.dtype, mine.name
        assert mine.data.shape == reference.data.shape, mine.name
        assert np.array_equal(mine.data, reference.data), mine.name


def test_builtin_model_reads_as_gguf_reads_it():
    assert_same_as_gguf_reader(builtin_gguf_path())


def test_every_value_type_and_tensor_layout(tmp_path):
    path = tmp_path / "kinds.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("k.u8", 7)
    writer.add_int8("k.i8", -7)
    writer.add_uint16("k.u16", 65535)
    writer.add_int16("k.i16", -300)
    writer.add_uint32("k.u32", 4_000_000_000)
    writer.add_int32("k.i32", -5)
    writer.add_float32("k.f32", 0.25)
    writer.add_uint64("k.u64", 2**40)
    writer.add_int64("k.i64", -(2**40))
    writer.add_float64("k.f64", 1e-300)
    writer.add_bool("k.bool", True)
    writer.add_string("k.str", "héllo ✓")
    writer.add_array("k.ints", [1, 2, 3])
    writer.add_array("k.floats", [0.5, -1.5])
    writer.add_array("k.strs", ["a", "", "ünï"])
    writer.add_array("k.nested", [[1, 2], [3]])
    writer.add_tensor("f32", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("f16", np.arange(6, dtype=np.float16).reshape(2, 3))
    writer.add_tensor("i32", np.arange(5, dtype=np.int32))
    q8 = gguf.quants.quantize(
        np.linspace(-1, 1, 128, dtype=np.float32).reshape(2, 64),
        Q8 := gguf.GGMLQuantizationType.Q8_0,
    )
    writer.add_tensor("q8", q8, raw_shape=q8.shape, raw_dtype=Q8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_as_gguf_reader(path, nested=("k.nested",))
    fields = GGUFFile(path).fields
    assert fields["k.strs"] == ["a", "", "ünï"] and fields["k.u64"] == 2**40
    # Strings in arrays are decoded as they are read: by index, slice or iteration.
    assert fields["k.strs"][2] == "ünï" and fields["k.strs"][-2:] == ["", "ünï"]
    assert len(fields["k.strs"]) == 3 and list(fields["k.strs"]) == ["a", "", "ünï"]
    assert fields["k.nested"] == [[1, 2], [3]]


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"PK\x03\x04 not a model at all", "magic"),
        (b"GGUF\x07\x00\x00\x00" + bytes(16), "version 7"),
        (b"GGUF\x03\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00\x00", "unpack"),  # cut short
    ],
)
def test_a_file_that_is_not_gguf_is_refused_by_name(tmp_path, content, problem):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"model.gguf: not a readable GGUF file: .*{problem}"):
        GGUFFile(path)
