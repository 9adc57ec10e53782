"""The writer: exact bytes, alignment, streaming sources, copy fallbacks, atomicity, shards."""

from __future__ import annotations

import errno
import os

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from gguf_factories import f32_spec, k3_like_specs, quant_spec

from k3kit.errors import FormatError
from k3kit.gguf import writer
from k3kit.gguf.reader import GGUFFile
from k3kit.gguf.shards import Model
from k3kit.gguf.writer import FileRange, TensorSpec, kv, write_gguf, write_model


def test_kv_constructor_checks_types():
    assert kv("a", V.UINT8, 255).value == 255
    with pytest.raises(ValueError, match="out of range"):
        kv("a", V.UINT8, 256)
    with pytest.raises(ValueError, match="out of range"):
        kv("a", V.INT32, 2**31)
    with pytest.raises(ValueError, match="integer"):
        kv("a", V.UINT32, True)
    with pytest.raises(ValueError, match="integer"):
        kv("a", V.UINT32, 1.5)
    with pytest.raises(ValueError, match="True/False"):
        kv("a", V.BOOL, 1)
    with pytest.raises(ValueError, match="str"):
        kv("a", V.STRING, b"x")
    with pytest.raises(ValueError, match="item_type"):
        kv("a", V.ARRAY, [1])
    with pytest.raises(ValueError, match="out of range"):
        kv("a", V.ARRAY, np.array([300]), V.UINT8)
    a = kv("a", V.ARRAY, [1, 2], V.INT16)
    assert a.value.dtype == np.dtype("<i2") and a.value.tolist() == [1, 2]
    assert kv("a", V.FLOAT32, 3).value == 3.0


def test_alignment_64_written_and_honoured(tmp_path):
    specs = [f32_spec("a", 1, 40), f32_spec("b", 1, 8, seed=1)]
    p = write_gguf(tmp_path / "a.gguf", [kv("general.architecture", V.STRING, "x")], specs, alignment=64)
    f = GGUFFile.open(p)
    assert f.alignment == 64 and f.kv["general.alignment"].value == 64
    assert all((t.offset - f.data_offset) % 64 == 0 for t in f.tensors) and f.data_offset % 64 == 0
    r = gguf.GGUFReader(p)
    assert r.alignment == 64
    np.testing.assert_array_equal(r.tensors[1].data.reshape(-1), specs[1].source.reshape(-1))


def test_default_alignment_kv_kept_when_given(tmp_path):
    p = write_gguf(tmp_path / "a.gguf", [kv("general.alignment", V.UINT32, 32)], [f32_spec("a", 1, 8)])
    assert "general.alignment" in GGUFFile.open(p).kv
    p = write_gguf(tmp_path / "b.gguf", [], [f32_spec("a", 1, 8)])
    assert "general.alignment" not in GGUFFile.open(p).kv


def test_alignment_conflict_is_refused(tmp_path):
    with pytest.raises(ValueError, match="alignment"):
        write_gguf(tmp_path / "a.gguf", [kv("general.alignment", V.UINT32, 64)], [], alignment=128)
    with pytest.raises(ValueError, match="power of two"):
        write_gguf(tmp_path / "a.gguf", [], [], alignment=48)
    assert list(tmp_path.iterdir()) == []


def test_callable_source_runs_just_before_its_bytes(tmp_path):
    out = tmp_path / "s.gguf"
    tmp = tmp_path / f".s.gguf.tmp-{os.getpid()}"
    seen = []

    def make(i):
        def produce():
            seen.append((i, tmp.stat().st_size))
            return np.full(32, i, dtype=np.float32)
        return produce

    specs = [TensorSpec(f"t{i}", (32,), Q.F32, 128, make(i)) for i in range(3)]
    write_gguf(out, [], specs)
    f = GGUFFile.open(out)
    # each producer ran when the file held exactly the bytes before its tensor
    assert seen == [(i, f.tensors[i].offset) for i in range(3)]
    assert [float(f.view(t).view(np.float32)[0]) for t in f.tensors] == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("bad", ["raise", "short"])
def test_failure_leaves_no_output_and_no_temp(tmp_path, bad):
    out = tmp_path / "x.gguf"
    out.write_bytes(b"old contents")

    def boom():
        if bad == "raise":
            raise RuntimeError("producer failed")
        return b"\0" * 10

    specs = [f32_spec("a", 1, 8), TensorSpec("b", (8,), Q.F32, 32, boom)]
    with pytest.raises(RuntimeError if bad == "raise" else ValueError):
        write_gguf(out, [], specs)
    assert out.read_bytes() == b"old contents"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.gguf"]


def test_write_model_failure_in_last_shard_leaves_nothing(tmp_path):
    def boom():
        raise RuntimeError("late failure")

    specs = [f32_spec("a", 4, 32), f32_spec("b", 4, 32), TensorSpec("c", (32,), Q.F32, 128, boom)]
    with pytest.raises(RuntimeError):
        write_model(tmp_path / "m.gguf", [], specs, max_shard_bytes=600)
    assert list(tmp_path.iterdir()) == []


def _src_file(tmp_path, n=3 * 1024 + 7):
    data = np.random.default_rng(3).integers(0, 256, n, dtype=np.uint8).tobytes()
    p = tmp_path / "src.bin"
    p.write_bytes(data)
    return p, data


@pytest.mark.parametrize("path", ["copy_file_range", "sendfile", "readwrite"])
def test_file_range_copy_and_fallbacks(tmp_path, monkeypatch, path):
    src, data = _src_file(tmp_path)
    calls = {"cfr": 0, "sf": 0}
    real_cfr, real_sf = os.copy_file_range, os.sendfile

    def cfr(*a, **k):
        calls["cfr"] += 1
        if path != "copy_file_range":
            raise OSError(errno.EXDEV, "cross-device")
        return real_cfr(*a, **k)

    def sf(*a, **k):
        calls["sf"] += 1
        if path == "readwrite":
            raise OSError(errno.EINVAL, "no sendfile")
        return real_sf(*a, **k)

    monkeypatch.setattr(os, "copy_file_range", cfr)
    monkeypatch.setattr(os, "sendfile", sf)
    monkeypatch.setattr(writer, "COPY_CHUNK", 1000)  # several chunks per tensor
    monkeypatch.setattr(writer, "RW_CHUNK", 512)
    specs = [TensorSpec("a", (256, 3), Q.F32, 3072, FileRange(src, 7, 3072))]
    p = write_gguf(tmp_path / "o.gguf", [], specs)
    f = GGUFFile.open(p)
    assert bytes(f.view(f.tensors[0])) == data[7:7 + 3072]
    assert calls["cfr"] >= 1
    assert (calls["sf"] > 0) == (path != "copy_file_range")


def test_file_range_past_source_end_is_format_error(tmp_path):
    src, _ = _src_file(tmp_path, 100)
    with pytest.raises(FormatError, match="past end of file"):
        write_gguf(tmp_path / "o.gguf", [], [TensorSpec("a", (32,), Q.F32, 128, FileRange(src, 0, 128))])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.bin"]


def test_spec_checks(tmp_path):
    with pytest.raises(ValueError, match="64 bytes or longer"):
        write_gguf(tmp_path / "o.gguf", [], [TensorSpec("x" * 64, (32,), Q.F32, 128, bytes(128))])
    with pytest.raises(ValueError, match="does not match shape"):
        write_gguf(tmp_path / "o.gguf", [], [TensorSpec("a", (32,), Q.F32, 64, bytes(64))])
    with pytest.raises(ValueError, match="block"):
        write_gguf(tmp_path / "o.gguf", [], [TensorSpec("a", (33,), Q.Q8_0, 34, bytes(34))])
    with pytest.raises(ValueError, match="duplicate"):
        write_gguf(tmp_path / "o.gguf", [], [f32_spec("a", 1, 8), f32_spec("a", 1, 8)])


def test_split_by_size_matches_gguf_split_conventions(tmp_path):
    kvs, specs = k3_like_specs()
    paths = write_model(tmp_path / "m.gguf", kvs, specs, max_shard_bytes=20_000, alignment=64)
    n = len(paths)
    assert n > 2
    assert [p.name for p in paths] == [f"m-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    placed = []
    for i, p in enumerate(paths):
        f = GGUFFile.open(p)
        keys = list(f.kv)
        assert keys[-3:] == ["split.no", "split.count", "split.tensors.count"]
        assert [f.kv[k].vtype for k in keys[-3:]] == [V.UINT16, V.UINT16, V.INT32]
        assert (f.kv["split.no"].value, f.kv["split.count"].value) == (i, n)
        assert f.kv["split.tensors.count"].value == len(specs)
        assert f.kv["general.alignment"].value == 64 and f.alignment == 64
        if i == 0:
            assert keys[:-3] == [k.key for k in kvs] + ["general.alignment"]
        else:
            assert keys == ["general.alignment", "split.no", "split.count", "split.tensors.count"]
        data = sum(-(-t.nbytes // 64) * 64 for t in f.tensors)
        assert data <= 20_000 or len(f.tensors) == 1
        placed += [t.name for t in f.tensors]
        r = gguf.GGUFReader(p)  # the peer reads every shard
        assert r.alignment == 64 and [t.name for t in r.tensors] == [t.name for t in f.tensors]
    assert placed == [s.name for s in specs]
    m = Model.open(paths[-1])
    for s in specs:
        assert bytes(m.view(s.name)) == s.source.tobytes()


def test_tensor_larger_than_limit_gets_its_own_shard(tmp_path):
    specs = [f32_spec("a", 1, 32), quant_spec("big", (32, 100), Q.F32), f32_spec("c", 1, 32)]
    paths = write_model(tmp_path / "m.gguf", [], specs, max_shard_bytes=256)
    assert [[t.name for t in GGUFFile.open(p).tensors] for p in paths] == [["a"], ["big"], ["c"]]


def test_one_shard_is_a_plain_file(tmp_path):
    specs = [f32_spec("a", 1, 32)]
    paths = write_model(tmp_path / "m.gguf", [kv("k", V.UINT8, 1)], specs, max_shard_bytes=10**9)
    assert paths == [tmp_path / "m.gguf"]
    assert list(GGUFFile.open(paths[0]).kv) == ["k"]


def test_explicit_layout(tmp_path):
    specs = [f32_spec(n, 1, 32) for n in "abcd"]
    paths = write_model(tmp_path / "m-00001-of-00009.gguf", [], specs, layout=[["b", "a"], ["c"], ["d"]])
    assert [p.name for p in paths] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert [[t.name for t in GGUFFile.open(p).tensors] for p in paths] == [["b", "a"], ["c"], ["d"]]
    with pytest.raises(ValueError, match="exactly once"):
        write_model(tmp_path / "x.gguf", [], specs, layout=[["a", "b"], ["c"]])
    with pytest.raises(ValueError, match="unknown"):
        write_model(tmp_path / "x.gguf", [], specs, layout=[["a", "b", "c", "d", "e"]])


def test_split_keys_in_input_are_replaced(tmp_path):
    kvs = [kv("split.no", V.UINT16, 5), kv("split.count", V.UINT16, 9), kv("a", V.UINT8, 1)]
    p = write_model(tmp_path / "m.gguf", kvs, [f32_spec("a", 1, 32)])[0]
    assert list(GGUFFile.open(p).kv) == ["a"]
