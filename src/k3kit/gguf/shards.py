"""A model is all of its shards: find the siblings of any one shard and check they agree.

Big GGUFs ship as `NAME-0000K-of-0000N.gguf`. Whatever shard the user names, we open the
whole set, and refuse sets that llama.cpp would load wrongly or not at all (a missing or
duplicated shard, a split count that disagrees, a tensor defined twice).
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
from gguf import GGUFValueType

from k3kit.errors import ShardError
from k3kit.gguf.reader import KV, GGUFFile, TensorInfo, kv_int

SHARD_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
SPLIT_NO = "split.no"
SPLIT_COUNT = "split.count"
SPLIT_TENSORS_COUNT = "split.tensors.count"
SPLIT_KEYS = (SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS_COUNT)


def shard_name(prefix: str, no: int, count: int) -> str:
    """File name of shard `no` (0-based) of `count`, as llama.cpp's llama_split_path writes it."""
    return f"{prefix}-{no + 1:05d}-of-{count:05d}.gguf"


def shard_paths(path: str | os.PathLike[str]) -> list[Path]:
    """All shard paths of the set `path` belongs to (just `path` if it is not a shard name)."""
    path = Path(path)
    m = SHARD_RE.match(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    if count == 0 or not 1 <= int(m["no"]) <= count:
        raise ShardError(f"{path}: shard number {int(m['no'])} of {count} is not a valid shard name")
    return [path.with_name(shard_name(m["prefix"], i, count)) for i in range(count)]


def _int_kv(f: GGUFFile, key: str) -> int | None:
    kv = f.kv.get(key)
    if kv is None:
        return None
    if kv.vtype == GGUFValueType.ARRAY or kv.vtype in (GGUFValueType.STRING, GGUFValueType.FLOAT32,
                                                       GGUFValueType.FLOAT64, GGUFValueType.BOOL):
        raise ShardError(f"{f.path}: {key} has type {kv.vtype.name}, expected an integer")
    return kv_int(kv)


class Model:
    """All shards of one model, opened header-only. Tensor views map lazily per shard."""

    def __init__(self, paths: list[Path], files: list[GGUFFile]) -> None:
        self.paths = paths
        self.files = files
        self.kv: dict[str, KV] = {k: v for k, v in files[0].kv.items() if k not in SPLIT_KEYS}
        self.tensors: dict[str, TensorInfo] = {}
        for i, f in enumerate(files):
            for t in f.tensors:
                if t.name in self.tensors:
                    other = self.paths[self.tensors[t.name].shard]
                    raise ShardError(f"{f.path}: tensor '{t.name}' is also in {other}")
                self.tensors[t.name] = replace(t, shard=i) if i else t

    @property
    def arch(self) -> str:
        kv = self.kv.get("general.architecture")
        return str(kv.value) if kv is not None and kv.vtype == GGUFValueType.STRING else ""

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Model:
        path = Path(path)
        paths = shard_paths(path)
        if len(paths) == 1 and not SHARD_RE.match(path.name):
            f = GGUFFile.open(path)
            count = _int_kv(f, SPLIT_COUNT)
            if count is not None and count > 1:
                raise ShardError(f"{path}: file says it is shard {(_int_kv(f, SPLIT_NO) or 0) + 1} of "
                                 f"{count} but its name is not NAME-0000K-of-0000N.gguf")
            model = cls([path], [f])
            _check_tensor_total(model, f, _int_kv(f, SPLIT_TENSORS_COUNT))
            return model

        missing = [p for p in paths if not p.exists()]
        if missing:
            # every name came from shard_name(), so each matches SHARD_RE
            which = ", ".join(str(m["no"]) for p in missing if (m := SHARD_RE.match(p.name)))
            raise ShardError(f"{missing[0]}: missing shard ({len(missing)} of {len(paths)} absent: {which})")
        files = [GGUFFile.open(p) for p in paths]
        seen: dict[int, Path] = {}
        totals: set[int] = set()
        for i, f in enumerate(files):
            no = _int_kv(f, SPLIT_NO)
            count = _int_kv(f, SPLIT_COUNT)
            if no is None or count is None:
                if len(files) == 1:
                    continue  # NAME-00001-of-00001.gguf without split keys: a plain file
                raise ShardError(f"{f.path}: shard of {len(files)} has no {SPLIT_NO}/{SPLIT_COUNT} keys")
            if count != len(files):
                raise ShardError(f"{f.path}: {SPLIT_COUNT} is {count} but the set has {len(files)} shards")
            if no in seen:
                raise ShardError(f"{f.path}: duplicate {SPLIT_NO} {no}, also in {seen[no]}")
            seen[no] = f.path
            if no != i:
                raise ShardError(f"{f.path}: {SPLIT_NO} is {no} but the file name says shard {i}")
            total = _int_kv(f, SPLIT_TENSORS_COUNT)
            if total is not None:
                totals.add(total)
        if len(totals) > 1:
            raise ShardError(f"{paths[0]}: shards disagree on {SPLIT_TENSORS_COUNT}: {sorted(totals)}")
        model = cls(paths, files)
        _check_tensor_total(model, files[0], totals.pop() if totals else None)
        return model

    def view(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        return self.files[t.shard].view(t)

    def close(self) -> None:
        for f in self.files:
            f.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_tensor_total(model: Model, f: GGUFFile, total: int | None) -> None:
    if total is None or SPLIT_TENSORS_COUNT not in f.kv:
        return
    if total != len(model.tensors):
        raise ShardError(f"{model.paths[0]}: {SPLIT_TENSORS_COUNT} is {total} but the shards hold "
                         f"{len(model.tensors)} tensors")
