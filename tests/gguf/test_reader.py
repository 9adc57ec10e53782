"""Reading valid files: ours, gguf-py's, v2, and through gguf-py's reader as the peer."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from gguf_factories import every_kv_type, kv_str, kv_u32, raw_gguf, tinfo

from k3kit.errors import FormatError
from k3kit.gguf.reader import GGUFFile, TensorInfo


def _value(k):
    return k.value.tolist() if isinstance(k.value, np.ndarray) else k.value


def test_every_kv_type_round_trips(small_gguf):
    f = GGUFFile.open(small_gguf)
    want = {k.key: k for k in every_kv_type()}
    assert list(f.kv) == list(want)
    for key, k in want.items():
        got = f.kv[key]
        assert (got.vtype, got.item_type) == (k.vtype, k.item_type), key
        assert _value(got) == _value(k), key
    assert f.kv["toy.u64"].value == 2**63 + 5
    assert f.kv["toy.arr_bool"].value.dtype == bool


def test_tensor_infos_and_views(small_gguf):
    f = GGUFFile.open(small_gguf)
    a, b = f.tensors
    assert (a.name, a.shape, a.np_shape, a.ggml_type, a.nbytes) == ("a.weight", (32, 3), (3, 32), Q.F32, 384)
    assert (b.shape, b.ggml_type, b.nbytes, b.n_elements) == ((64, 2), Q.Q8_0, 4 * 34, 128)
    assert a.offset % 32 == 0 and a.offset == f.data_offset
    want = np.random.default_rng(0).standard_normal((3, 32)).astype(np.float32)
    v = f.view(a)
    assert v.dtype == np.uint8 and not v.flags.writeable
    np.testing.assert_array_equal(v.view(np.float32).reshape(a.np_shape), want)
    with pytest.raises(ValueError):
        v[0] = 1


def test_view_is_lazy(small_gguf):
    f = GGUFFile.open(small_gguf)
    assert f._mm is None  # parsing mapped nothing
    f.view(f.tensors[0])
    assert f._mm is not None
    f.close()
    assert f._mm is None


def test_gguf_py_reads_our_file(small_gguf):
    ours = GGUFFile.open(small_gguf)
    r = gguf.GGUFReader(small_gguf)
    assert r.fields["toy.str"].contents() == "héllo ✓"
    assert r.fields["toy.arr_i32"].contents() == [1, -2, 3]
    assert r.fields["tokenizer.ggml.tokens"].contents() == ["<s>", "a", "", "éé"]
    assert r.fields["toy.u64"].contents() == 2**63 + 5
    for rt, t in zip(r.tensors, ours.tensors, strict=True):
        assert rt.name == t.name and rt.tensor_type == t.ggml_type
        assert int(rt.data_offset) == t.offset
        np.testing.assert_array_equal(np.asarray(rt.data).reshape(-1).view(np.uint8), ours.view(t))


def test_we_read_gguf_py_file(gguf_py_file):
    f = GGUFFile.open(gguf_py_file)
    r = gguf.GGUFReader(gguf_py_file)
    assert f.kv["general.architecture"].value == "llama"
    assert f.kv["llama.block_count"].value == 2
    assert f.kv["tokenizer.ggml.tokens"].value == ["a", "b", "c"]
    assert [t.name for t in f.tensors] == [t.name for t in r.tensors]
    for rt, t in zip(r.tensors, f.tensors, strict=True):
        assert t.shape == tuple(int(d) for d in rt.shape)
        np.testing.assert_array_equal(np.asarray(rt.data).reshape(-1).view(np.uint8), f.view(t))
    np.testing.assert_array_equal(f.view(f.tensors[0]).view(np.float32), np.arange(64, dtype=np.float32))


def test_version_2_is_read(small_gguf, tmp_path):
    raw = bytearray(small_gguf.read_bytes())
    raw[4:8] = struct.pack("<I", 2)
    p = tmp_path / "v2.gguf"
    p.write_bytes(raw)
    f = GGUFFile.open(p)
    assert f.version == 2 and len(f.tensors) == 2


def test_custom_alignment_is_honoured(tmp_path):
    data = bytes(range(64)) * 3
    raw = raw_gguf([kv_u32("general.alignment", 64), kv_str("general.architecture", "x")],
                   [tinfo("a", (32,), Q.F32, 0), tinfo("b", (16,), Q.F32, 128)],
                   data, alignment=64)
    p = tmp_path / "a64.gguf"
    p.write_bytes(raw)
    f = GGUFFile.open(p)
    assert f.alignment == 64 and f.data_offset % 64 == 0
    assert bytes(f.view(f.tensors[1])) == data[128:192]


def test_invalid_utf8_in_values_survives_as_surrogates(tmp_path):
    bad_value = struct.pack("<Q", 1) + b"k" + struct.pack("<IQ", V.STRING, 2) + b"\xff\xfe"
    p = tmp_path / "u.gguf"
    p.write_bytes(raw_gguf([bad_value], []))
    v = GGUFFile.open(p).kv["k"].value
    assert v.encode("utf-8", "surrogateescape") == b"\xff\xfe"
    # and k3kit's writer puts the same bytes back
    from k3kit.gguf.writer import encode_kv

    assert encode_kv(GGUFFile.open(p).kv["k"]) == bad_value


def test_invalid_utf8_key_is_a_format_error(tmp_path):
    raw = raw_gguf([b"\x02\x00\x00\x00\x00\x00\x00\x00\xff\xfe" + struct.pack("<II", V.UINT32, 1)], [])
    p = tmp_path / "k.gguf"
    p.write_bytes(raw)
    with pytest.raises(FormatError, match="not valid UTF-8"):
        GGUFFile.open(p)


def test_tensorinfo_properties():
    t = TensorInfo("x", (32, 3, 2), Q.Q8_0, 0, 6 * 34)
    assert t.n_elements == 192 and t.np_shape == (2, 3, 32)


def test_large_tokenizer_parses(tmp_path):
    from k3kit.gguf.writer import kv, write_gguf

    toks = [f"tok{i}\u0120" for i in range(50_000)]
    p = write_gguf(tmp_path / "tok.gguf", [kv("tokenizer.ggml.tokens", V.ARRAY, toks, V.STRING),
                                           kv("tokenizer.ggml.scores", V.ARRAY,
                                              np.arange(50_000, dtype=np.float32), V.FLOAT32)], [])
    f = GGUFFile.open(p)
    assert f.kv["tokenizer.ggml.tokens"].value == toks
    np.testing.assert_array_equal(f.kv["tokenizer.ggml.scores"].value, np.arange(50_000, dtype=np.float32))


def test_parse_reads_headers_only(tmp_path):
    """A 16 GiB (sparse) tensor costs nothing to open: only header bytes are read."""
    import tracemalloc

    shape = (4096, 4096, 256)  # 2^32 F32 elements = 16 GiB
    head = raw_gguf([kv_str("general.architecture", "x")], [tinfo("big", shape, Q.F32, 0)])
    p = tmp_path / "sparse.gguf"
    with open(p, "wb") as f:
        f.write(head)
        f.truncate(len(head) + (16 << 30))
    tracemalloc.start()
    g = GGUFFile.open(p)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert g.tensors[0].nbytes == 16 << 30 and peak < 4 << 20
    v = g.view(g.tensors[0])
    assert v.shape == (16 << 30,) and v[-1] == 0  # mapped lazily; touching one page reads one page
