"""Streaming, atomic GGUF writing: one file or llama.cpp-style shards.

Memory stays flat whatever the model size: tensor bytes come from file ranges (copied
in-kernel with copy_file_range), from arrays already in memory, or from callables invoked
just before their bytes are written. Outputs appear only complete: every file is written
under a temporary name, fsynced and renamed, and a failure removes what it wrote.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from k3kit._io import atomic_write, fsync_dir, fsync_file, temp_path
from k3kit.errors import FormatError, K3Error
from k3kit.gguf.reader import (
    ALIGNMENT_KEY,
    DEFAULT_ALIGNMENT,
    GGML_MAX_DIMS,
    GGUF_MAGIC,
    KV,
    SCALAR_DTYPES,
    align_up,
    kv_array,
    kv_int,
    tensor_nbytes,
)
from k3kit.gguf.shards import SHARD_RE, SPLIT_COUNT, SPLIT_KEYS, SPLIT_NO, SPLIT_TENSORS_COUNT, shard_name
from k3kit.progress import ByteProgress

GGUF_VERSION = 3
GGML_MAX_NAME = 64  # llama.cpp refuses tensor names of 64 bytes or more
COPY_CHUNK = 64 << 20
RW_CHUNK = 8 << 20

_INT_RANGES = {
    GGUFValueType.UINT8: (0, 2**8 - 1), GGUFValueType.INT8: (-(2**7), 2**7 - 1),
    GGUFValueType.UINT16: (0, 2**16 - 1), GGUFValueType.INT16: (-(2**15), 2**15 - 1),
    GGUFValueType.UINT32: (0, 2**32 - 1), GGUFValueType.INT32: (-(2**31), 2**31 - 1),
    GGUFValueType.UINT64: (0, 2**64 - 1), GGUFValueType.INT64: (-(2**63), 2**63 - 1),
}
_FLOATS = (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64)


@dataclass(frozen=True)
class FileRange:
    """`nbytes` bytes at `offset` of an existing file: copied without passing through Python."""

    path: Path
    offset: int
    nbytes: int


Chunk = np.ndarray | bytes | bytearray | memoryview
# A callable is called once, just before its bytes are written; it may return the whole tensor or
# an iterable of chunks, so a tensor far larger than memory can be produced piece by piece.
Source = FileRange | np.ndarray | bytes | Callable[[], "Chunk | Iterable[Chunk]"]


@dataclass
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # ggml order
    ggml_type: GGMLQuantizationType
    nbytes: int
    source: Source


# ---------------------------------------------------------------- KVs


def _check_scalar(key: str, vtype: GGUFValueType, value: object) -> object:
    if vtype in _INT_RANGES:
        if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
            raise ValueError(f"{key}: {vtype.name} needs an integer, got {value!r}")
        lo, hi = _INT_RANGES[vtype]
        if not lo <= int(value) <= hi:
            raise ValueError(f"{key}: {value} out of range for {vtype.name}")
        return int(value)
    if vtype in _FLOATS:
        if isinstance(value, bool | np.bool_) or not isinstance(value, int | float | np.number):
            raise ValueError(f"{key}: {vtype.name} needs a number, got {value!r}")
        return float(value)
    if vtype == GGUFValueType.BOOL:
        if not isinstance(value, bool | np.bool_):
            raise ValueError(f"{key}: BOOL needs True/False, got {value!r}")
        return bool(value)
    if vtype == GGUFValueType.STRING:
        if not isinstance(value, str):
            raise ValueError(f"{key}: STRING needs a str, got {value!r}")
        return value
    raise ValueError(f"{key}: {vtype!r} is not a scalar value type")


def kv(key: str, vtype: GGUFValueType, value: object, item_type: GGUFValueType | None = None) -> KV:
    """A checked KV: integers in range, arrays converted to numpy (numbers) or list[str]."""
    vtype = GGUFValueType(vtype)
    if vtype != GGUFValueType.ARRAY:
        if item_type is not None:
            raise ValueError(f"{key}: item_type is only for arrays")
        return KV(key, vtype, _check_scalar(key, vtype, value))
    if item_type is None:
        raise ValueError(f"{key}: an array needs an item_type")
    item_type = GGUFValueType(item_type)
    if item_type == GGUFValueType.ARRAY:
        raise ValueError(f"{key}: nested arrays are not supported")
    if item_type == GGUFValueType.STRING:
        return KV(key, vtype, [_check_scalar(key, item_type, v) for v in _items(value)], item_type)
    if isinstance(value, np.ndarray):
        arr = value.reshape(-1)
        if item_type == GGUFValueType.BOOL:
            arr = arr.astype(bool)
        elif item_type in _INT_RANGES:
            if arr.dtype.kind not in "iub":
                raise ValueError(f"{key}: {item_type.name} array needs integers, got {arr.dtype}")
            lo, hi = _INT_RANGES[item_type]
            if arr.size and (int(arr.min()) < lo or int(arr.max()) > hi):
                raise ValueError(f"{key}: values out of range for {item_type.name}")
            arr = arr.astype(SCALAR_DTYPES[item_type])
        else:
            arr = arr.astype(SCALAR_DTYPES[item_type])
    else:
        vals = [_check_scalar(key, item_type, v) for v in _items(value)]
        dtype = bool if item_type == GGUFValueType.BOOL else SCALAR_DTYPES[item_type]
        arr = np.array(vals, dtype=dtype)
    return KV(key, vtype, arr, item_type)


def _items(value: object) -> Iterable[object]:
    """An array KV's value: any iterable of elements (anything else fails where it is iterated)."""
    return cast("Iterable[object]", value)


def _string(s: str | bytes) -> bytes:
    raw = s if isinstance(s, bytes) else s.encode("utf-8", errors="surrogateescape")
    return len(raw).to_bytes(8, "little") + raw


def _scalar_bytes(vtype: GGUFValueType, value: object) -> bytes:
    if vtype == GGUFValueType.STRING:
        return _string(cast("str | bytes", value))  # a STRING KV holds a str
    if vtype == GGUFValueType.BOOL:
        return b"\x01" if value else b"\x00"
    return np.array(value, dtype=SCALAR_DTYPES[vtype]).tobytes()


def encode_kv(item: KV) -> bytes:
    """The on-disk bytes of one KV (key, type, value)."""
    out = [_string(item.key), int(item.vtype).to_bytes(4, "little")]
    if item.vtype != GGUFValueType.ARRAY:
        out.append(_scalar_bytes(item.vtype, item.value))
        return b"".join(out)
    it = item.item_type
    if it is None:
        raise ValueError(f"{item.key}: array without item_type")
    values = kv_array(item)
    out += [int(it).to_bytes(4, "little"), len(values).to_bytes(8, "little")]
    if it == GGUFValueType.STRING:
        out += [_string(s) for s in values]
    elif it == GGUFValueType.BOOL:
        out.append(np.asarray(item.value, dtype=bool).astype(np.uint8).tobytes())
    else:
        out.append(np.asarray(item.value).astype(SCALAR_DTYPES[it], copy=False).tobytes())
    return b"".join(out)


# ---------------------------------------------------------------- one file


def _check_specs(tensors: Sequence[TensorSpec]) -> None:
    seen: set[str] = set()
    for t in tensors:
        if t.name in seen:
            raise ValueError(f"duplicate tensor name '{t.name}'")
        seen.add(t.name)
        if len(t.name.encode("utf-8")) >= GGML_MAX_NAME:
            raise ValueError(f"tensor name '{t.name}' is {GGML_MAX_NAME} bytes or longer (llama.cpp limit)")
        if not 1 <= len(t.shape) <= GGML_MAX_DIMS or any(int(d) <= 0 for d in t.shape):
            raise ValueError(f"tensor '{t.name}': bad shape {t.shape}")
        block, _ = GGML_QUANT_SIZES[t.ggml_type]
        if t.shape[0] % block:
            raise ValueError(f"tensor '{t.name}': ne0 {t.shape[0]} not a multiple of block {block}")
        if tensor_nbytes(tuple(t.shape), t.ggml_type) != t.nbytes:
            raise ValueError(f"tensor '{t.name}': nbytes {t.nbytes} does not match shape {t.shape} "
                             f"of {t.ggml_type.name}")


def _resolve_alignment(kvs: list[KV], alignment: int) -> tuple[list[KV], int]:
    """general.alignment in the KVs wins over the default; it is written whenever it is not 32."""
    given = next((k for k in kvs if k.key == ALIGNMENT_KEY), None)
    if given is not None:
        value = kv_int(given)
        if alignment != DEFAULT_ALIGNMENT and alignment != value:
            raise ValueError(f"{ALIGNMENT_KEY} KV is {value} but alignment={alignment} was asked for")
        alignment = value
        kvs = [k if k.key != ALIGNMENT_KEY else KV(ALIGNMENT_KEY, GGUFValueType.UINT32, value) for k in kvs]
    elif alignment != DEFAULT_ALIGNMENT:
        kvs = [*kvs, KV(ALIGNMENT_KEY, GGUFValueType.UINT32, alignment)]
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment {alignment} is not a power of two")
    return kvs, alignment


def header_bytes(kvs: Sequence[KV], tensors: Sequence[TensorSpec], alignment: int) -> bytes:
    """Everything a GGUF file holds before its data section (padded to `alignment`)."""
    parts = [GGUF_MAGIC, GGUF_VERSION.to_bytes(4, "little"),
             len(tensors).to_bytes(8, "little"), len(kvs).to_bytes(8, "little")]
    parts += [encode_kv(k) for k in kvs]
    offset = 0
    for t in tensors:
        parts += [_string(t.name), len(t.shape).to_bytes(4, "little")]
        parts += [int(d).to_bytes(8, "little") for d in t.shape]
        parts += [int(t.ggml_type).to_bytes(4, "little"), offset.to_bytes(8, "little")]
        offset += align_up(t.nbytes, alignment)
    head = b"".join(parts)
    return head + bytes(align_up(len(head), alignment) - len(head))


def _write_all(fd: int, data: Chunk) -> None:
    # numpy declares ndarray's buffer protocol to type checkers only for Python >= 3.12
    view = memoryview(data).cast("B")  # type: ignore[arg-type]
    while view:
        n = os.write(fd, view[:RW_CHUNK])
        view = view[n:]


def _copy_range(src: FileRange, out_fd: int, progress: ByteProgress | None) -> None:
    with open(src.path, "rb") as f:
        in_fd = f.fileno()
        if os.fstat(in_fd).st_size < src.offset + src.nbytes:
            raise FormatError(f"{src.path}: tensor data [{src.offset}, {src.offset + src.nbytes}) "
                              f"past end of file")
        pos, end = src.offset, src.offset + src.nbytes
        method = "copy_file_range"
        while pos < end:
            n = min(COPY_CHUNK, end - pos)
            if method == "copy_file_range":
                try:
                    done = os.copy_file_range(in_fd, out_fd, n, pos)
                except OSError as e:
                    if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP,
                                       errno.EPERM, errno.EBADF):
                        raise
                    method = "sendfile"
                    continue
            elif method == "sendfile":
                try:
                    done = os.sendfile(out_fd, in_fd, pos, n)
                except OSError as e:
                    if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                        raise
                    method = "copy"
                    continue
            else:
                buf = os.pread(in_fd, min(n, RW_CHUNK), pos)
                _write_all(out_fd, buf)
                done = len(buf)
            if done == 0:
                raise FormatError(f"{src.path}: file shrank while copying (at byte {pos})")
            pos += done
            if progress is not None:
                progress.advance(done)


def _chunk_bytes(chunk: Chunk) -> Chunk:
    if isinstance(chunk, np.ndarray):
        return np.ascontiguousarray(chunk).reshape(-1).view(np.uint8)
    return chunk


def source_bytes(spec: TensorSpec) -> np.ndarray:
    """All bytes of a spec's source in memory (for small tensors and tests; the writer streams)."""
    src = spec.source
    if isinstance(src, FileRange):
        with open(src.path, "rb") as f:
            return np.frombuffer(os.pread(f.fileno(), src.nbytes, src.offset), np.uint8)
    produced = src() if callable(src) else src
    chunks = [produced] if isinstance(produced, np.ndarray | bytes | bytearray | memoryview) else produced
    return np.concatenate([np.frombuffer(_chunk_bytes(c), np.uint8) for c in chunks])


def _write_data(fd: int, t: TensorSpec, progress: ByteProgress | None) -> None:
    src = t.source
    if isinstance(src, FileRange):
        if src.nbytes != t.nbytes:
            raise ValueError(f"tensor '{t.name}': source has {src.nbytes} bytes, expected {t.nbytes}")
        _copy_range(src, fd, progress)
        return
    produced = src() if callable(src) else src
    chunks = [produced] if isinstance(produced, np.ndarray | bytes | bytearray | memoryview) else produced
    n = 0
    for chunk in chunks:
        data = _chunk_bytes(chunk)
        size = data.nbytes if isinstance(data, np.ndarray | memoryview) else len(data)
        if n + size > t.nbytes:
            raise ValueError(f"tensor '{t.name}': source has more than the expected {t.nbytes} bytes")
        _write_all(fd, data)
        n += size
        if progress is not None:
            progress.advance(size)
    if n != t.nbytes:
        raise ValueError(f"tensor '{t.name}': source has {n} bytes, expected {t.nbytes}")


def _check_out_dir(path: Path) -> None:
    if not path.parent.is_dir():
        raise K3Error(f"{path.parent}: output directory does not exist")


def _write_file(tmp: Path, kvs: list[KV], tensors: Sequence[TensorSpec], alignment: int,
                progress: ByteProgress | None) -> None:
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, header_bytes(kvs, tensors, alignment))
        for t in tensors:
            _write_data(fd, t, progress)
            pad = align_up(t.nbytes, alignment) - t.nbytes
            if pad:
                _write_all(fd, bytes(pad))
    finally:
        os.close(fd)


def _commit(pairs: list[tuple[Path, Path]]) -> None:
    """fsync every temp, then rename them all. Syncing after all shards are written (not one
    by one) lets the kernel write back earlier shards while later ones are still copied."""
    for tmp, _ in pairs:
        fsync_file(tmp)
    for tmp, final in pairs:
        os.replace(tmp, final)
    for d in {final.parent for _, final in pairs}:
        fsync_dir(d)


def _remove_quietly(paths: Iterable[Path]) -> None:
    for p in paths:
        try:
            p.unlink()
        except FileNotFoundError:
            pass


def write_gguf(path: str | os.PathLike[str], kv: Iterable[KV], tensors: Sequence[TensorSpec], *,
               alignment: int = DEFAULT_ALIGNMENT, progress: ByteProgress | None = None) -> Path:
    """Write one GGUF v3 file atomically (temp in the same dir, fsync, rename, fsync dir)."""
    path = Path(path)
    kvs, alignment = _resolve_alignment(list(kv), alignment)
    _check_specs(tensors)
    _check_out_dir(path)
    return atomic_write(path, lambda tmp: _write_file(tmp, kvs, tensors, alignment, progress))


# ---------------------------------------------------------------- shards


def shard_prefix(out: str | os.PathLike[str]) -> Path:
    """`x.gguf` and `x-00001-of-00004.gguf` both give the shard prefix `x`."""
    out = Path(out)
    m = SHARD_RE.match(out.name)
    if m:
        return out.with_name(m["prefix"])
    return out.with_name(out.name[:-5]) if out.name.endswith(".gguf") else out


def plan_shards(tensors: Sequence[TensorSpec], max_shard_bytes: int,
                alignment: int) -> list[list[TensorSpec]]:
    """Greedy split like llama.cpp's gguf-split: a new shard when the next tensor would pass the limit.

    Only padded tensor bytes count (not headers); a tensor larger than the limit gets a shard
    of its own, since a tensor never spans shards.
    """
    groups: list[list[TensorSpec]] = [[]]
    size = 0
    for t in tensors:
        n = align_up(t.nbytes, alignment)
        if groups[-1] and size + n > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += n
    return groups


def output_paths(out: str | os.PathLike[str], n_shards: int) -> list[Path]:
    """Where write_model puts `n_shards` files for `out`."""
    out = Path(out)
    prefix = shard_prefix(out)
    if n_shards == 1:
        # a lone file named "-00001-of-00005" would read as a broken set
        m = SHARD_RE.match(out.name)
        return [out if m is None or int(m["count"]) == 1 else prefix.with_name(prefix.name + ".gguf")]
    return [prefix.with_name(shard_name(prefix.name, i, n_shards)) for i in range(n_shards)]


def write_model(out: str | os.PathLike[str], kv: Iterable[KV], tensors: Sequence[TensorSpec], *,
                max_shard_bytes: int | None = None, layout: Sequence[Sequence[str]] | None = None,
                alignment: int = DEFAULT_ALIGNMENT, progress: ByteProgress | None = None) -> list[Path]:
    """Write a model as one file, or as shards by size or by an explicit layout.

    Shards follow llama.cpp's gguf-split: split.no (u16), split.count (u16) and
    split.tensors.count (i32) in every shard, the other KVs only in the first. Unlike gguf-py,
    general.alignment goes into every shard that needs it, since each shard is parsed alone.
    All shards are written under temporary names and renamed only once every one is complete.
    """
    kvs = [k for k in kv if k.key not in SPLIT_KEYS]
    kvs, alignment = _resolve_alignment(kvs, alignment)
    tensors = list(tensors)
    _check_specs(tensors)
    if layout is not None:
        by_name = {t.name: t for t in tensors}
        groups = []
        placed: set[str] = set()
        for names in layout:
            missing = [n for n in names if n not in by_name]
            if missing:
                raise ValueError(f"layout names unknown tensors: {missing[:3]}")
            placed.update(names)
            groups.append([by_name[n] for n in names])
        if len(placed) != len(tensors) or sum(len(g) for g in groups) != len(tensors):
            raise ValueError("layout must place every tensor exactly once")
        groups = [g for g in groups if g] or [[]]
    elif max_shard_bytes is not None:
        if max_shard_bytes <= 0:
            raise ValueError("max_shard_bytes must be positive")
        groups = plan_shards(tensors, max_shard_bytes, alignment)
    else:
        groups = [tensors]

    paths = output_paths(out, len(groups))
    _check_out_dir(paths[0])
    if len(groups) == 1:
        jobs = [(paths[0], kvs, groups[0])]
    else:
        extra = [k for k in kvs if k.key == ALIGNMENT_KEY]
        jobs = []
        for i, (p, g) in enumerate(zip(paths, groups, strict=True)):
            split = [KV(SPLIT_NO, GGUFValueType.UINT16, i),
                     KV(SPLIT_COUNT, GGUFValueType.UINT16, len(groups)),
                     KV(SPLIT_TENSORS_COUNT, GGUFValueType.INT32, len(tensors))]
            if len(groups) > 0xFFFF:
                raise ValueError(f"{len(groups)} shards do not fit in split.count (u16)")
            jobs.append((p, (kvs if i == 0 else extra) + split, g))

    temps = [temp_path(p) for p in paths]
    try:
        for tmp, (_, shard_kvs, group) in zip(temps, jobs, strict=True):
            _write_file(tmp, shard_kvs, group, alignment, progress)
        _commit(list(zip(temps, paths, strict=True)))
    except BaseException:
        _remove_quietly(temps)
        raise
    return paths
