"""Reading a Hugging Face checkpoint without torch: bounded JSON and safetensors by hand.

The `safetensors` library's numpy backend cannot return BF16 (numpy has no bfloat16), and it
does not expose where a tensor's bytes are. The format is simple enough to read directly: an
8-byte little-endian header length, a JSON header `{name: {dtype, shape, data_offsets}}`, then
the data. Every number in the header is checked against the file before anything is read, so
a hostile file fails with a one-line ConvertError instead of a huge allocation.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from k3kit import _io
from k3kit.errors import ConvertError

MAX_JSON_BYTES = 64 << 20          # config.json, tokenizer_config.json, the shard index
MAX_HEADER_BYTES = 100 << 20       # what the safetensors library itself accepts
MAX_TENSORS = 1 << 22              # per file; K3 has ~2.5M expert tensors over ~60 files
MAX_DIMS = 8
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

# safetensors dtype -> bytes per element
DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
}
FLOAT_DTYPES = ("F32", "F16", "BF16")


def read_json(path: Path, what: str = "JSON") -> Any:
    """k3kit._io's bounded JSON read, failing with a ConvertError like everything a conversion reads."""
    return _io.read_json(path, what, max_bytes=MAX_JSON_BYTES, error=ConvertError)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: where its bytes are and what they hold."""

    name: str
    path: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int          # absolute byte offset in the file
    nbytes: int

    @property
    def where(self) -> str:
        return f"{self.path}: tensor {self.name!r}"


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file, every offset checked against the file size."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise ConvertError(f"{path}: {size} bytes is too short for a safetensors file")
            n = int.from_bytes(f.read(8), "little")
            if n > MAX_HEADER_BYTES or n > size - 8:
                raise ConvertError(f"{path}: safetensors header length {n} is out of range "
                                   f"(file has {size} bytes)")
            raw = f.read(n)
    except FileNotFoundError:
        raise ConvertError(f"{path}: no such file") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        msg = str(e).splitlines()[0]
        raise ConvertError(f"{path}: safetensors header is not valid JSON ({msg})") from None
    if not isinstance(header, dict):
        raise ConvertError(f"{path}: safetensors header is not a JSON object")
    if len(header) > MAX_TENSORS + 1:
        raise ConvertError(f"{path}: {len(header)} header entries is too many")
    data_start = 8 + n
    out: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict):
            raise ConvertError(f"{where}: header entry is not an object")
        dtype, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in DTYPE_SIZES:
            raise ConvertError(f"{where}: unknown dtype {dtype!r}")
        if (not isinstance(shape, list) or len(shape) > MAX_DIMS
                or not all(type(d) is int and 0 <= d < 1 << 40 for d in shape)):
            raise ConvertError(f"{where}: bad shape {shape!r}")
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)):
            raise ConvertError(f"{where}: bad data_offsets {offs!r}")
        begin, end = offs
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        if not 0 <= begin <= end or end - begin != nbytes:
            raise ConvertError(f"{where}: data_offsets {offs} do not hold {shape} of {dtype}")
        if data_start + end > size:
            raise ConvertError(f"{where}: data past end of file ({data_start + end} > {size} bytes)")
        out[name] = TensorEntry(name, path, dtype, tuple(shape), data_start + begin, nbytes)
    return out


class Checkpoint:
    """All tensors of a checkpoint directory: `model.safetensors` or the shards of an index.

    Only headers are read here; tensor bytes are read one tensor at a time by `raw`/`floats`.
    """

    def __init__(self, model_dir: Path):
        self.dir = model_dir
        self.tensors: dict[str, TensorEntry] = {}
        index = model_dir / INDEX_NAME
        if index.is_file():
            files = self._index_files(index)
            self.source = index                 # what error messages about absent tensors name
        elif (model_dir / WEIGHTS_NAME).is_file():
            files = [model_dir / WEIGHTS_NAME]
            self.source = files[0]
        else:
            raise ConvertError(f"{model_dir}: no {WEIGHTS_NAME} or {INDEX_NAME}")
        for f in files:
            for name, entry in read_safetensors_header(f).items():
                if name in self.tensors:
                    raise ConvertError(f"{f}: tensor {name!r} is also in {self.tensors[name].path}")
                self.tensors[name] = entry
        if index.is_file():
            for name, fname in self._weight_map.items():
                held = self.tensors.get(name)
                if held is None or held.path.name != fname:
                    raise ConvertError(f"{index}: lists {name!r} in {fname!r}, which does not hold it")

    def _index_files(self, index: Path) -> list[Path]:
        raw = read_json(index, "safetensors index")
        wm = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(wm, dict) or not wm:
            raise ConvertError(f"{index}: no weight_map object")
        if len(wm) > MAX_TENSORS * 16:
            raise ConvertError(f"{index}: weight_map has {len(wm)} entries, too many")
        self._weight_map: dict[str, str] = {}
        files: set[str] = set()
        for name, fname in wm.items():
            # shards must be plain file names inside the checkpoint directory
            if not isinstance(fname, str) or fname in ("", ".", "..") or "/" in fname or "\\" in fname:
                raise ConvertError(f"{index}: weight_map entry {name!r} -> {fname!r} is not a file name "
                                   f"in {self.dir}")
            self._weight_map[name] = fname
            files.add(fname)
        return [self.dir / f for f in sorted(files)]

    def raw(self, e: TensorEntry) -> np.ndarray:
        """The tensor's bytes as a uint8 array (read now, one tensor only)."""
        try:
            with open(e.path, "rb") as f:
                data = os.pread(f.fileno(), e.nbytes, e.offset)
        except OSError as err:
            raise ConvertError(f"{e.where}: cannot read ({err.strerror or err})") from None
        if len(data) != e.nbytes:
            raise ConvertError(f"{e.where}: file shrank while reading ({len(data)} of {e.nbytes} bytes)")
        return np.frombuffer(data, dtype=np.uint8)

    def floats(self, e: TensorEntry) -> np.ndarray:
        """The tensor as float32 in its numpy shape. F16 and BF16 widen exactly."""
        raw = self.raw(e)
        if e.dtype == "F32":
            out = raw.view("<f4")
        elif e.dtype == "F16":
            out = raw.view("<f2").astype(np.float32)
        elif e.dtype == "BF16":
            out = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            raise ConvertError(f"{e.where}: dtype {e.dtype} is not a float type ({'/'.join(FLOAT_DTYPES)})")
        return out.astype(np.float32, copy=False).reshape(e.shape)
