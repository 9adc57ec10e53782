"""Header-only GGUF (v2/v3, little-endian) parsing, with every count and length bounded.

A 1.4 TB model is opened by reading only its headers, and a hostile file must fail with a
one-line FormatError before it can make us allocate anything large: every count is checked
against the bytes that remain in the file before a list, string or array is built. Tensor
data is never read here; `GGUFFile.view` maps it lazily, without prefetching, so the page
cache decides what stays resident.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, SupportsInt, cast

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from k3kit.errors import FormatError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4
ALIGNMENT_KEY = "general.alignment"

# Smallest possible encodings, used to bound counts by the bytes that remain.
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, a one-byte value (key may be empty here)
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset
_INITIAL_READ = 1 << 20
# Real headers are megabytes (K3: a 160k tokenizer, ~100k tensor infos); a count that would
# need more than this is hostile even when the file is big enough to "hold" it.
MAX_HEADER_BYTES = 1 << 30
_U64 = struct.Struct("<Q")

# numpy dtype of each fixed-size value type (little-endian on disk).
SCALAR_DTYPES: dict[GGUFValueType, np.dtype] = {
    GGUFValueType.UINT8: np.dtype("<u1"),
    GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.BOOL: np.dtype("<u1"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}
_STRUCT_CODES = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<B", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_VALUE_TYPES = {int(v): v for v in GGUFValueType}
_GGML_TYPES = {int(t): t for t in GGMLQuantizationType if t in GGML_QUANT_SIZES}


@dataclass(frozen=True)
class KV:
    """One metadata key/value. Arrays keep their element type so they round-trip exactly."""

    key: str
    vtype: GGUFValueType
    value: object  # int/float/bool/str; arrays: list[str] or 1-D numpy array
    item_type: GGUFValueType | None = None


# `KV.value` is `object` because one KV holds any GGUF type. These say, once, what a caller that
# has checked `kv.vtype` knows about the value, instead of a cast at every use. They only narrow
# the static type: each does what its callers did before (`int(kv.value)`, `kv.value`), no new check.


def kv_int(kv: KV) -> int:
    """`int(kv.value)` for a KV holding an integer (vtype checked by the caller, or general.alignment)."""
    return int(cast(SupportsInt, kv.value))


def kv_array(kv: KV) -> list[Any] | np.ndarray:
    """`kv.value` of an ARRAY KV: list[str] for strings, a 1-D numpy array for numbers (a KV built
    by hand may hold a list of either)."""
    return cast("list[Any] | np.ndarray", kv.value)


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes live. `shape` is in ggml order (ne0, the contiguous dim, first)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset of the data in its file
    nbytes: int
    shard: int = 0

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def np_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))


def tensor_nbytes(shape: tuple[int, ...], ggml_type: GGMLQuantizationType) -> int:
    """Bytes of a tensor of `shape` (ggml order); ne0 must be a whole number of blocks."""
    block, size = GGML_QUANT_SIZES[ggml_type]
    n = 1
    for d in shape:
        n *= d
    return n // block * size


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


class _HeaderBuffer:
    """Sequential reads over the start of a file; fetches more bytes only when a read needs them."""

    def __init__(self, f: BinaryIO, path: Path, size: int) -> None:
        self.f = f
        self.path = path
        self.size = size
        self.buf = bytearray(f.read(min(size, _INITIAL_READ)))
        self.pos = 0

    def fail(self, problem: str) -> FormatError:
        return FormatError(f"{self.path}: {problem}")

    def remaining(self) -> int:
        return self.size - self.pos

    def need(self, n: int) -> None:
        end = self.pos + n
        if end > self.size:
            raise self.fail(f"truncated: header needs {end} bytes, file has {self.size}")
        if end > len(self.buf):
            if end > MAX_HEADER_BYTES:
                raise self.fail(f"header would exceed {MAX_HEADER_BYTES} bytes (at byte {self.pos}, "
                                f"{n} more asked for)")
            want = min(self.size, max(end, 2 * len(self.buf))) - len(self.buf)
            more = self.f.read(want)
            if len(more) < end - len(self.buf):
                got = len(self.buf) + len(more)
                raise self.fail(f"truncated: header needs {end} bytes, could read {got}")
            self.buf += more

    def unpack(self, code: str, n: int) -> Any:  # int, float or bool as `code` says
        self.need(n)
        (v,) = struct.unpack_from(code, self.buf, self.pos)
        self.pos += n
        return v

    def u32(self) -> int:
        v: int = self.unpack("<I", 4)
        return v

    def u64(self) -> int:
        v: int = self.unpack("<Q", 8)
        return v

    def raw_string(self, what: str) -> bytes:
        n = self.u64()
        if n > self.remaining():
            raise self.fail(f"{what}: string length {n} runs past the end of the file "
                            f"({self.remaining()} bytes left)")
        self.need(n)
        s = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return s

    def name(self, what: str) -> str:
        raw = self.raw_string(what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what}: not valid UTF-8: {raw[:40]!r}") from None

    def value_string(self, what: str) -> str:
        # surrogateescape keeps invalid UTF-8 (odd tokenizer pieces) byte-exact through a rewrite
        return self.raw_string(what).decode("utf-8", errors="surrogateescape")

    def strings(self, count: int, what: str) -> list[str]:
        """`count` length-prefixed strings; a tight loop because tokenizers hold 160k+ of them."""
        out: list[str] = []  # grows with what is really there, not with what the count claims
        append = out.append
        u64 = _U64.unpack_from
        size = self.size
        buf = self.buf
        limit = len(buf)
        pos = self.pos
        for i in range(count):
            if pos + 8 > limit:
                self.pos = pos
                self.need(8)
                buf, limit = self.buf, len(self.buf)
            n = u64(buf, pos)[0]
            pos += 8
            end = pos + n
            if end > limit:
                if end > size:
                    raise self.fail(f"{what}[{i}]: string length {n} runs past the end of the file "
                                    f"({size - pos} bytes left)")
                self.pos = pos
                self.need(n)
                buf, limit = self.buf, len(self.buf)
            append(buf[pos:end].decode("utf-8", "surrogateescape"))
            pos = end
        self.pos = pos
        return out

    def array(self, dtype: np.dtype, count: int) -> np.ndarray:
        n = count * dtype.itemsize
        self.need(n)
        a = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
        self.pos += n
        return a


def _value_type(r: _HeaderBuffer, code: int, what: str) -> GGUFValueType:
    vt = _VALUE_TYPES.get(code)
    if vt is None:
        raise r.fail(f"{what}: unknown value type {code}")
    return vt


def _read_value(r: _HeaderBuffer, vtype: GGUFValueType, what: str) -> tuple[object, GGUFValueType | None]:
    if vtype == GGUFValueType.STRING:
        return r.value_string(what), None
    if vtype == GGUFValueType.ARRAY:
        item_type = _value_type(r, r.u32(), what)
        count = r.u64()
        if item_type == GGUFValueType.ARRAY:
            raise r.fail(f"{what}: nested arrays are not supported")
        if item_type == GGUFValueType.STRING:
            if count > r.remaining() // 8:
                raise r.fail(f"{what}: array of {count} strings cannot fit in the "
                             f"{r.remaining()} bytes left in the file")
            return r.strings(count, what), item_type
        dtype = SCALAR_DTYPES[item_type]
        if count > r.remaining() // dtype.itemsize:
            raise r.fail(f"{what}: array of {count} {item_type.name} cannot fit in the "
                         f"{r.remaining()} bytes left in the file")
        arr = r.array(dtype, count)
        if item_type == GGUFValueType.BOOL:
            arr = arr != 0
        return arr, item_type
    v = r.unpack(_STRUCT_CODES[vtype], SCALAR_DTYPES[vtype].itemsize)
    if vtype == GGUFValueType.BOOL:
        v = bool(v)
    return v, None


class GGUFFile:
    """One GGUF file's header: KVs and tensor infos, validated; tensor bytes mapped on demand."""

    def __init__(self, path: Path, version: int, alignment: int, data_offset: int, size: int,
                 kv: dict[str, KV], tensors: list[TensorInfo]) -> None:
        self.path = path
        self.version = version
        self.alignment = alignment
        self.data_offset = data_offset
        self.size = size
        self.kv = kv
        self.tensors = tensors
        self._mm: np.memmap | None = None

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> GGUFFile:
        path = Path(path)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            return cls._parse(f, path, size)

    @classmethod
    def _parse(cls, f: BinaryIO, path: Path, size: int) -> GGUFFile:
        r = _HeaderBuffer(f, path, size)
        if size < 4:
            raise r.fail(f"truncated: {size}-byte file is too short to be GGUF")
        r.need(4)
        magic = bytes(r.buf[:4])
        if magic != GGUF_MAGIC:
            raise r.fail(f"bad magic {magic!r} (not a GGUF file)")
        r.pos = 4
        version = r.u32()
        if version not in (2, 3):
            hint = " (big-endian file?)" if version & 0xFFFF == 0 and version else ""
            raise r.fail(f"unsupported GGUF version {version}{hint}; only v2 and v3 are supported")
        n_tensors = r.u64()
        n_kv = r.u64()
        if n_tensors > r.remaining() // _MIN_TENSOR_INFO_BYTES:
            raise r.fail(f"tensor count {n_tensors} is impossible for a {size}-byte file")
        if n_kv > r.remaining() // _MIN_KV_BYTES:
            raise r.fail(f"key/value count {n_kv} is impossible for a {size}-byte file")
        if n_tensors * _MIN_TENSOR_INFO_BYTES + n_kv * _MIN_KV_BYTES > r.remaining():
            raise r.fail(f"{n_tensors} tensors and {n_kv} key/values are impossible "
                         f"for a {size}-byte file")

        kv: dict[str, KV] = {}
        for i in range(n_kv):
            key = r.name(f"key {i}")
            what = f"key '{key}'"
            if key in kv:
                raise r.fail(f"duplicate key '{key}'")
            vtype = _value_type(r, r.u32(), what)
            value, item_type = _read_value(r, vtype, what)
            kv[key] = KV(key, vtype, value, item_type)

        alignment = DEFAULT_ALIGNMENT
        if ALIGNMENT_KEY in kv:
            a = kv[ALIGNMENT_KEY]
            if a.vtype != GGUFValueType.UINT32:
                raise r.fail(f"{ALIGNMENT_KEY} must be UINT32, not {a.vtype.name}")
            alignment = kv_int(a)
            if alignment <= 0 or alignment & (alignment - 1):
                raise r.fail(f"{ALIGNMENT_KEY} {alignment} is not a power of two")

        raw: list[tuple[str, tuple[int, ...], GGMLQuantizationType, int, int]] = []
        names: set[str] = set()
        for i in range(n_tensors):
            name = r.name(f"tensor {i} name")
            what = f"tensor '{name}'"
            if name in names:
                raise r.fail(f"duplicate tensor name '{name}'")
            names.add(name)
            n_dims = r.u32()
            if not 1 <= n_dims <= GGML_MAX_DIMS:
                raise r.fail(f"{what}: {n_dims} dimensions (must be 1..{GGML_MAX_DIMS})")
            shape = tuple(r.u64() for _ in range(n_dims))
            code = r.u32()
            ggml_type = _GGML_TYPES.get(code)
            if ggml_type is None:
                raise r.fail(f"{what}: unknown ggml type {code}")
            if any(d == 0 for d in shape):
                raise r.fail(f"{what}: zero dimension in shape {list(shape)}")
            block, _ = GGML_QUANT_SIZES[ggml_type]
            if shape[0] % block:
                raise r.fail(f"{what}: row of {shape[0]} elements is not a multiple of the "
                             f"{ggml_type.name} block size {block}")
            nbytes = tensor_nbytes(shape, ggml_type)
            if nbytes > size:
                raise r.fail(f"{what}: shape {list(shape)} ({nbytes} bytes of {ggml_type.name}) "
                             f"cannot fit in a {size}-byte file")
            offset = r.u64()
            if offset % alignment:
                raise r.fail(f"{what}: data offset {offset} is not a multiple of the alignment {alignment}")
            raw.append((name, shape, ggml_type, offset, nbytes))

        data_offset = align_up(r.pos, alignment)
        tensors: list[TensorInfo] = []
        for name, shape, ggml_type, offset, nbytes in raw:
            start = data_offset + offset
            if start + nbytes > size:
                raise r.fail(f"tensor '{name}': data [{start}, {start + nbytes}) past end of "
                             f"file ({size} bytes)")
            tensors.append(TensorInfo(name, shape, ggml_type, start, nbytes))
        by_start = sorted(tensors, key=lambda t: t.offset)
        for t, u in zip(by_start, by_start[1:], strict=False):
            if u.offset < t.offset + t.nbytes:
                raise r.fail(f"tensors '{t.name}' and '{u.name}' overlap "
                             f"(at byte {u.offset}, '{t.name}' ends at {t.offset + t.nbytes})")
        return cls(path, version, alignment, data_offset, size, kv, tensors)

    def view(self, t: TensorInfo) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 array; maps the file on first use, no prefetch."""
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
            if self._mm.shape[0] != self.size:
                raise FormatError(f"{self.path}: file changed size since it was opened")
        return self._mm[t.offset:t.offset + t.nbytes]

    def close(self) -> None:
        self._mm = None

    def __repr__(self) -> str:
        return (f"GGUFFile({str(self.path)!r}, v{self.version}, {len(self.kv)} kv, "
                f"{len(self.tensors)} tensors)")
