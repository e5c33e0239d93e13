"""engine/models/gguf_file.py: the header walk gives gguf-py's reader's tensors (names, types,
shapes, offsets, bytes) and metadata scalars, steps over every kind of array, and refuses a file
that is cut short or not a GGUF."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from tiny_gguf import write_tiny_gguf

from engine.models.gguf_file import SkippedArray, read_gguf_layout
from engine.models.loader import embedded_gguf_path


def assert_same_as_gguf_py(path) -> None:
    layout = read_gguf_layout(str(path))
    reader = gguf.GGUFReader(str(path))

    assert [t.name for t in layout.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(layout.tensors, reader.tensors, strict=True):
        assert ours.tensor_type == theirs.tensor_type, ours.name
        assert list(ours.shape) == theirs.shape.tolist(), ours.name
        assert (ours.data_offset, ours.n_bytes) == (theirs.data_offset, theirs.n_bytes), ours.name
        assert (ours.data.dtype, ours.data.shape) == (theirs.data.dtype, theirs.data.shape)
        assert np.array_equal(ours.data.view(np.uint8), np.asarray(theirs.data).view(np.uint8))
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(layout.metadata) == list(fields)
    for key, field in fields.items():
        value = layout.metadata[key]
        if isinstance(value, SkippedArray):
            assert (field.types[0], field.types[1]) == (gguf.GGUFValueType.ARRAY, value.item_type)
            if value.item_type != gguf.GGUFValueType.ARRAY:  # gguf-py counts a nest's leaves
                assert value.count == len(field.data), key
        else:
            assert value == field.contents(), key


def test_tiny_files_read_as_gguf_py_reads_them(tmp_path):
    for architecture in ("llama", "qwen2"):
        path = tmp_path / f"{architecture}.gguf"
        write_tiny_gguf(path, architecture)
        assert_same_as_gguf_py(path)


def test_every_metadata_type_is_read_or_stepped_over(tmp_path):
    path = tmp_path / "metadata.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    writer.add_uint8("t.u8", 7)
    writer.add_int16("t.i16", -3)
    writer.add_float32("t.f32", 0.5)
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_int64("t.i64", -2**40)
    writer.add_string("t.text", "héllo")
    writer.add_array("t.tokens", ["<s>", "", "日本", "x" * 300])
    writer.add_array("t.scores", [0.5, -1.0, 2.0])
    writer.add_array("t.nested", [[1, 2], [3, 4, 5]])
    writer.add_array("t.nested_text", [["a", "bc"], ["def"]])
    writer.add_tensor("a.weight", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.add_tensor("b.weight", np.ones((4, 32), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    assert_same_as_gguf_py(path)
    layout = read_gguf_layout(str(path))
    assert layout.metadata["t.text"] == "héllo" and layout.metadata["general.alignment"] == 64
    assert layout.metadata["t.tokens"] == SkippedArray(gguf.GGUFValueType.STRING, 4)
    assert layout.metadata["t.nested_text"] == SkippedArray(gguf.GGUFValueType.ARRAY, 2)
    assert layout.tensors[0].data.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_a_file_cut_short_or_not_gguf_is_refused(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    data = path.read_bytes()

    for name, content in [("empty.gguf", b""), ("text.gguf", b"not a gguf at all"),
                          ("header.gguf", data[:200]), ("tensors.gguf", data[:len(data) // 2])]:
        broken = tmp_path / name
        broken.write_bytes(content)
        with pytest.raises(ValueError, match="GGUF"):
            read_gguf_layout(str(broken))


@pytest.mark.slow
def test_embedded_file_reads_as_gguf_py_reads_it():
    """The shipped file's 49k-token vocabulary and merges are stepped over, not decoded."""
    assert_same_as_gguf_py(embedded_gguf_path())
