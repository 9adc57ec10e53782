"""The prompt cache's disk tier: entries written to a directory and found again after a restart.

One file per entry, `<model>-<tokens>.k3pc`: the magic `K3KITPC1`, the header's length (u64 LE),
a JSON header (the model's identity, the token count, every tensor's dtype/shape/offset, the
points, the ring rows, the payload's SHA-256) and the payload (the tensors' bytes, back to back).
Files are written whole or not at all (temporary name, fsync, rename: a kill -9 mid-write leaves
a hidden temporary file, removed at the next start, never a short entry). At start-up the
directory is indexed from headers and token ids alone; an entry's payload is read and checked
against its SHA-256 only when a lookup picks it. A file that is foreign (another model or
format), truncated or corrupt (a flipped byte anywhere) is skipped with one warning and never
used; a corrupt one is deleted when found.

The directory holds at most `budget` bytes of entries (0: no limit); the least recently written
go first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from k3kit._io import atomic_write

if TYPE_CHECKING:
    from k3kit.serve.prompt_cache import CacheCounters, Entry

log = logging.getLogger("k3kit.serve")

MAGIC = b"K3KITPC1"
SUFFIX = ".k3pc"
MAX_HEADER = 16 << 20
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "int8": torch.int8, "int64": torch.int64, "float64": torch.float64}
_NAMES = {v: k for k, v in _DTYPES.items()}


class EntryError(ValueError):
    """A cache file that cannot be used (foreign, truncated, corrupt)."""


@dataclass
class Indexed:
    """What the index knows of one file without reading its payload."""

    path: Path
    tokens: np.ndarray
    points: dict[int, bool]           # position -> has logits
    ring: tuple[int, int] | None
    ring_storage: str | None
    nbytes: int
    mtime: float


def _raw(t: Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


class DiskTier:
    def __init__(self, directory: Path, identity: str, budget: int, counters: CacheCounters) -> None:
        self.dir, self.identity, self.budget, self.counters = directory, identity, budget, counters
        self.dir.mkdir(parents=True, exist_ok=True)
        self.prefix = hashlib.sha256(identity.encode()).hexdigest()[:8]
        self.index: dict[str, Indexed] = {}
        self._scan()

    @property
    def bytes(self) -> int:
        return sum(d.nbytes for d in self.index.values())

    def _path(self, key: str) -> Path:
        return self.dir / f"{self.prefix}-{key}{SUFFIX}"

    # -- start-up ----------------------------------------------------------------------------------
    def _scan(self) -> None:
        for stale in self.dir.glob(f".*{SUFFIX}.tmp-*"):     # a write cut short (kill -9): never an entry
            stale.unlink(missing_ok=True)
        for path in sorted(self.dir.glob(f"*{SUFFIX}")):
            try:
                header, start = _read_header(path)
                if header.get("identity") != self.identity:
                    raise EntryError("written for another model file or k3kit state format")
                idx = self._indexed(path, header, start)
            except (OSError, EntryError, ValueError, KeyError, TypeError) as e:
                self.counters.disk_skipped += 1
                log.warning("prompt cache: skipping %s: %s", path.name, e)
                continue
            key = path.name[len(self.prefix) + 1:-len(SUFFIX)]
            if not path.name.startswith(self.prefix + "-") or key != _tokens_key(idx.tokens):
                self.counters.disk_skipped += 1
                log.warning("prompt cache: skipping %s: its name does not match its tokens", path.name)
                continue
            self.index[key] = idx

    def _indexed(self, path: Path, header: dict[str, Any], start: int) -> Indexed:
        blobs = _blobs(header, path.stat().st_size - start)
        n = int(header["n"])
        tok = blobs[int(header["tokens"])]
        if tok["dtype"] != "int64" or tok["shape"] != [n]:
            raise EntryError("bad token blob")
        with open(path, "rb") as f:
            f.seek(start + tok["offset"])
            tokens = np.frombuffer(f.read(tok["nbytes"]), dtype="<i8").astype(np.int64)
        points = {int(p["pos"]): p.get("logits") is not None for p in header["points"]}
        if not points or any(not 0 < q <= n for q in points):
            raise EntryError("bad points")
        ring = header.get("ring")
        span = None
        if ring is not None:
            span = (int(ring["start"]), int(ring["start"]) + blobs[int(ring["data"])]["shape"][0])
        st = path.stat()
        return Indexed(path, tokens, points, span, None if ring is None else str(ring["storage"]), st.st_size,
                       st.st_mtime)

    # -- write, read, remove ---------------------------------------------------------------------
    def write(self, entry: Entry) -> None:
        """Write `entry` (atomically); errors are logged, never raised: the cache is an optimisation."""
        tensors: list[Tensor] = []

        def add(t: Tensor) -> int:
            tensors.append(t)
            return len(tensors) - 1

        header: dict[str, Any] = {"identity": self.identity, "n": len(entry.tokens)}
        header["tokens"] = add(torch.from_numpy(entry.tokens.astype(np.int64)))
        header["positional"] = [add(t) for t in entry.positional]
        header["points"] = [{"pos": q, "recurrent": [add(t) for t in pt.recurrent],
                             "logits": None if pt.logits is None else add(pt.logits)}
                            for q, pt in sorted(entry.points.items())]
        r = entry.ring
        header["ring"] = None if r is None else {
            "start": r.start, "storage": r.storage, "data": add(r.data),
            "scale": None if r.scale is None else add(r.scale)}
        raws = [_raw(t) for t in tensors]
        blobs, off = [], 0
        for t, raw in zip(tensors, raws, strict=True):
            blobs.append({"dtype": _NAMES[t.dtype], "shape": list(t.shape), "offset": off,
                          "nbytes": len(raw)})
            off += len(raw)
        header["blobs"] = blobs
        digest = hashlib.sha256()
        for raw in raws:
            digest.update(raw)
        header["sha256"] = digest.hexdigest()
        head = json.dumps(header, separators=(",", ":")).encode()
        path = self._path(entry.key)

        def put(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                f.write(MAGIC + struct.pack("<Q", len(head)) + head)
                for raw in raws:
                    f.write(raw)

        try:
            atomic_write(path, put)
        except OSError as e:
            log.warning("prompt cache: cannot write %s: %s", path, e)
            return
        entry.disk = path
        self.counters.disk_writes += 1
        st = path.stat()
        points = {q: pt.logits is not None for q, pt in entry.points.items()}
        self.index[entry.key] = Indexed(path, entry.tokens, points, None if r is None else (r.start, r.end),
                                        None if r is None else r.storage, st.st_size, st.st_mtime)
        self._trim(keep=entry.key)

    def _trim(self, keep: str) -> None:
        if self.budget <= 0:
            return
        total = self.bytes
        for key in sorted(self.index, key=lambda k: self.index[k].mtime):
            if total <= self.budget:
                break
            if key != keep:
                total -= self.index[key].nbytes
                self.remove(key)

    def remove(self, key: str) -> None:
        d = self.index.pop(key, None)
        if d is not None:
            d.path.unlink(missing_ok=True)

    def load(self, key: str) -> Entry | None:
        """The whole entry, checked; None (and the file dropped, with a warning) if it fails."""
        from k3kit.serve.prompt_cache import Entry, Point, RingRows
        d = self.index.get(key)
        if d is None:
            return None
        try:
            header, start = _read_header(d.path)
            if header.get("identity") != self.identity:
                raise EntryError("written for another model file")
            blobs = _blobs(header, d.path.stat().st_size - start)
            with open(d.path, "rb") as f:
                f.seek(start)
                payload = f.read()
            if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
                raise EntryError("checksum mismatch")
            ts = [_tensor(payload, b) for b in blobs]
            n = int(header["n"])
            tokens = ts[int(header["tokens"])].numpy().astype(np.int64)
            positional = tuple(ts[int(i)] for i in header["positional"])
            if len(tokens) != n or any(t.dim() != 2 or t.shape[0] != n for t in positional):
                raise EntryError("rows do not match the tokens")
            points = {}
            for p in header["points"]:
                lg = p.get("logits")
                points[int(p["pos"])] = Point(int(p["pos"]), tuple(ts[int(i)] for i in p["recurrent"]),
                                              None if lg is None else ts[int(lg)])
            ring = header.get("ring")
            rr = None
            if ring is not None:
                sc = ring.get("scale")
                rr = RingRows(int(ring["start"]), ts[int(ring["data"])], None if sc is None else ts[int(sc)],
                              str(ring["storage"]))
        except (OSError, EntryError, ValueError, KeyError, TypeError, IndexError, RuntimeError) as e:
            self.counters.disk_skipped += 1
            log.warning("prompt cache: skipping %s: %s", d.path.name, e)
            self.remove(key)
            return None
        return Entry(tokens, positional, points, rr, disk=d.path)


def _tokens_key(tokens: np.ndarray) -> str:
    return hashlib.sha256(tokens.astype("<i8").tobytes()).hexdigest()[:32]


def _read_header(path: Path) -> tuple[dict[str, Any], int]:
    with open(path, "rb") as f:
        lead = f.read(16)
        if len(lead) < 16 or lead[:8] != MAGIC:
            raise EntryError("not a k3kit prompt cache entry")
        (hlen,) = struct.unpack("<Q", lead[8:])
        if hlen > MAX_HEADER:
            raise EntryError(f"header of {hlen} bytes")
        raw = f.read(hlen)
    if len(raw) != hlen:
        raise EntryError("truncated header")
    header = json.loads(raw)
    if not isinstance(header, dict):
        raise EntryError("header is not an object")
    return header, 16 + hlen


def _blobs(header: dict[str, Any], payload: int) -> list[dict[str, Any]]:
    """The header's tensor table, every entry checked against the payload's size."""
    blobs = header["blobs"]
    if not isinstance(blobs, list):
        raise EntryError("bad tensor table")
    end = 0
    for b in blobs:
        if b["dtype"] not in _DTYPES or not all(isinstance(x, int) and x >= 0 for x in b["shape"]):
            raise EntryError("bad tensor")
        want = int(np.prod(b["shape"], dtype=np.int64)) * _DTYPES[b["dtype"]].itemsize
        if b["nbytes"] != want or b["offset"] != end:
            raise EntryError("bad tensor size")
        end += want
    if end != payload:
        raise EntryError(f"truncated: {payload} payload bytes, the header says {end}")
    return blobs


def _tensor(payload: bytes, b: dict[str, Any]) -> Tensor:
    raw = bytearray(payload[b["offset"]:b["offset"] + b["nbytes"]])
    if not raw:
        return torch.empty(b["shape"], dtype=_DTYPES[b["dtype"]])
    return torch.frombuffer(raw, dtype=_DTYPES[b["dtype"]]).reshape(b["shape"])
