"""Our GGUF reader (`runtime.models.gguf_file`) against the `gguf` package's own writer and reader."""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from runtime.models.gguf_file import GGUFFile  # noqa: E402
from runtime.models.registry import ModelSource, check_model_files  # noqa: E402

Q8_0 = gguf.GGMLQuantizationType.Q8_0


def _write(path, alignment=None, vocab=300):
    """A small GGUF file through the package's writer: every scalar type, arrays, three tensor types."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "gemma3")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.25)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ▁world")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_array("t.strings", [f"tok{i}▁" for i in range(vocab)] + ["", "<0xFF>"])
    tensors = {
        "a.weight": rng.standard_normal((3, 5)).astype(np.float32),
        "b.weight": rng.standard_normal((4, 8)).astype(np.float16),
        "c.weight": rng.standard_normal((2, 64)).astype(np.float32),
    }
    w.add_tensor("a.weight", tensors["a.weight"])
    w.add_tensor("b.weight", tensors["b.weight"])
    q = gguf.quants.quantize(tensors["c.weight"], Q8_0)
    w.add_tensor("c.weight", q, raw_shape=q.shape, raw_dtype=Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def _same_as_the_package_reader(path):
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}  # its own extras
    assert ours.fields == expected
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and a.shape.tolist() == b.shape.tolist()
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data)
    return ours


@pytest.mark.parametrize("alignment", [None, 64])
def test_small_file_reads_as_written(tmp_path, alignment):
    path = tmp_path / "small.gguf"
    tensors = _write(path, alignment)
    ours = _same_as_the_package_reader(path)
    f = ours.fields
    assert (f["t.u8"], f["t.i8"], f["t.u16"], f["t.i16"]) == (200, -100, 60000, -30000)
    assert (f["t.u32"], f["t.i32"], f["t.u64"], f["t.i64"]) == (4_000_000_000, -2_000_000_000, 2**63 + 5, -(2**62))
    assert (f["t.f32"], f["t.f64"], f["t.bool"], f["t.str"]) == (0.25, 1e-300, True, "héllo ▁world")
    assert f["t.ints"] == [1, -2, 3] and f["t.floats"] == [0.5, 1.5]
    assert f["t.strings"][:2] == ["tok0▁", "tok1▁"] and f["t.strings"][-2:] == ["", "<0xFF>"]
    assert ours.field("general.architecture") == "gemma3" and ours.field("absent", 7) == 7
    data = {t.name: t.data for t in ours.tensors}
    assert np.array_equal(data["a.weight"], tensors["a.weight"])
    assert np.array_equal(data["b.weight"], tensors["b.weight"])
    back = gguf.quants.dequantize(data["c.weight"], Q8_0)
    np.testing.assert_allclose(back, tensors["c.weight"], atol=np.abs(tensors["c.weight"]).max() / 100)


def test_vocabulary_longer_than_a_header_chunk(tmp_path):
    """Strings that cross the reader's 1 MB chunks: 100,000 of them (~1.2 MB)."""
    path = tmp_path / "vocab.gguf"
    _write(path, vocab=100_000)
    strings = _same_as_the_package_reader(path).fields["t.strings"]
    assert len(strings) == 100_002 and strings[99_999] == "tok99999▁"


def _cut(path, keep):
    data = path.read_bytes()
    path.write_bytes(data[:keep(len(data))])


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.write_bytes(b"PK\x03\x04" + bytes(60)), "not a GGUF file (starts with b'PK\\x03\\x04'"),
    (lambda p: p.write_bytes(b"GGUF" + (7).to_bytes(4, "little") + bytes(16)), "GGUF version 7"),
    (lambda p: p.write_bytes(b"GGUF" + (3 << 24).to_bytes(4, "little") + bytes(16)),  # version 3, big-endian
     "GGUF version 50331648 (big-endian"),
    (lambda p: _cut(p, lambda n: 600), "truncated: the header runs past the end of the file (600 bytes)"),
    (lambda p: _cut(p, lambda n: n - 64), "truncated: tensor 'c.weight' ends at byte"),
    (lambda p: p.write_bytes(b""), "not a GGUF file (starts with b'', not b'GGUF')"),
])
def test_damaged_files_raise_value_error_saying_what(tmp_path, damage, message):
    path = tmp_path / "bad.gguf"
    _write(path)
    damage(path)
    with pytest.raises(ValueError) as err:
        GGUFFile(path)
    assert str(err.value).startswith(message), str(err.value)
    with pytest.raises(ValueError, match="is not a readable GGUF file"):  # the start-up check's wording
        check_model_files(ModelSource(name=str(path), kind="gguf", path=path))


@pytest.mark.slow
def test_the_default_model_reads_as_the_package_reads_it(gemma3_gguf_path):
    ours = _same_as_the_package_reader(gemma3_gguf_path)
    tokens = ours.fields["tokenizer.ggml.tokens"]
    assert len(tokens) == 262144 and tokens[ours.field("tokenizer.ggml.bos_token_id")] == "<bos>"
    assert ours.field("tokenizer.chat_template") is None  # the pretrained checkpoint carries none
