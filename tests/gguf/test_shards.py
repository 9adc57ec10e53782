"""Shard sets: discovery from any shard, and every way a set can be broken."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from gguf import GGUFValueType as V
from gguf_factories import f32_spec

from k3kit.cli import main
from k3kit.errors import ShardError
from k3kit.gguf.reader import GGUFFile
from k3kit.gguf.shards import Model, shard_paths
from k3kit.gguf.writer import FileRange, TensorSpec, kv, write_gguf


def test_open_from_any_shard(k3_sharded):
    models = [Model.open(p) for p in k3_sharded]
    assert all(m.paths == k3_sharded for m in models)
    m = models[0]
    assert m.arch == "kimi-k3"
    assert not any(k.startswith("split.") for k in m.kv)
    assert m.kv["general.name"].value == "tiny-k3"
    for i, f in enumerate(m.files):
        for t in f.tensors:
            assert m.tensors[t.name].shard == i and m.tensors[t.name].offset == t.offset
    assert len(m.tensors) == m.files[0].kv["split.tensors.count"].value


def test_shard_paths_for_plain_names(tmp_path):
    assert shard_paths(tmp_path / "x.gguf") == [tmp_path / "x.gguf"]
    assert shard_paths(tmp_path / "x-00002-of-00003.gguf")[0] == tmp_path / "x-00001-of-00003.gguf"
    with pytest.raises(ShardError, match="not a valid shard name"):
        shard_paths(tmp_path / "x-00004-of-00003.gguf")


def _rewrite_shard(path: Path, **changes) -> None:
    """Rewrite one shard's split KVs (tensors copied) to build broken sets."""
    f = GGUFFile.open(path)
    kvs = []
    for k in f.kv.values():
        if k.key in changes:
            value = changes.pop(k.key)
            if value is None:
                continue
            k = kv(k.key, k.vtype, value)
        kvs.append(k)
    specs = [TensorSpec(t.name, t.shape, t.ggml_type, t.nbytes, FileRange(path, t.offset, t.nbytes))
             for t in f.tensors]
    tmp = path.with_name("rewritten.tmp.gguf")
    write_gguf(tmp, kvs, specs)
    tmp.replace(path)


def _expect(path: Path, pattern: str, capsys) -> None:
    with pytest.raises(ShardError, match=pattern):
        Model.open(path)
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3kit: error: ") and err.count("\n") == 1


def test_missing_shard(k3_sharded, capsys):
    k3_sharded[1].unlink()
    _expect(k3_sharded[0], f"{k3_sharded[1]}: missing shard .*: 00002", capsys)


def test_duplicate_shard(k3_sharded, capsys):
    shutil.copy(k3_sharded[0], k3_sharded[1])
    _expect(k3_sharded[0], "duplicate split.no 0", capsys)


def test_shard_number_disagrees_with_name(k3_sharded, capsys):
    _rewrite_shard(k3_sharded[1], **{"split.no": 2})
    _expect(k3_sharded[0], "split.no is 2 but the file name says shard 1", capsys)


def test_split_count_mismatch(k3_sharded, capsys):
    _rewrite_shard(k3_sharded[2], **{"split.count": 7})
    _expect(k3_sharded[0], f"split.count is 7 but the set has {len(k3_sharded)} shards", capsys)


def test_split_tensors_count_disagreement(k3_sharded, capsys):
    _rewrite_shard(k3_sharded[1], **{"split.tensors.count": 3})
    _expect(k3_sharded[0], "shards disagree on split.tensors.count", capsys)


def test_split_tensors_count_wrong_total(k3_sharded, capsys):
    for p in k3_sharded:
        _rewrite_shard(p, **{"split.tensors.count": 1000})
    _expect(k3_sharded[0], "split.tensors.count is 1000 but the shards hold", capsys)


def test_shard_without_split_keys(k3_sharded, capsys):
    _rewrite_shard(k3_sharded[1], **{"split.no": None, "split.count": None})
    _expect(k3_sharded[0], "has no split.no/split.count keys", capsys)


def test_duplicate_tensor_across_shards(tmp_path, capsys):
    for i in range(2):
        write_gguf(tmp_path / f"d-0000{i + 1}-of-00002.gguf",
                   [kv("split.no", V.UINT16, i), kv("split.count", V.UINT16, 2)], [f32_spec("same", 1, 32)])
    _expect(tmp_path / "d-00001-of-00002.gguf", "tensor 'same' is also in", capsys)


def test_plain_name_claiming_to_be_a_shard(tmp_path, capsys):
    p = write_gguf(tmp_path / "lonely.gguf", [kv("split.no", V.UINT16, 0), kv("split.count", V.UINT16, 3)],
                   [f32_spec("a", 1, 32)])
    _expect(p, "shard 1 of 3 but its name is not", capsys)


def test_single_shard_names_and_plain_files_open(tmp_path):
    p = write_gguf(tmp_path / "one-00001-of-00001.gguf", [kv("a", V.UINT8, 1)], [f32_spec("a", 1, 32)])
    assert list(Model.open(p).tensors) == ["a"]
    p = write_gguf(tmp_path / "plain.gguf", [kv("split.count", V.UINT16, 1), kv("split.no", V.UINT16, 0)],
                   [f32_spec("a", 1, 32)])
    m = Model.open(p)
    assert list(m.kv) == [] and list(m.tensors) == ["a"]
