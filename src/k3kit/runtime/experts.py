"""The expert store: quantized expert bytes in model files -> dequantized torch tensors.

Routed experts are most of a giant MoE's bytes, so they are never loaded up front. A layer's
experts for one projection are `n_experts` equal matrices stored back to back (a ggml
[n_in, n_out, n_expert] tensor), so expert e is one contiguous byte slice. The store reads
that slice only when a batch routes to e and keeps it in a bounded LRU cache measured in
MiB of what it holds: dequantized tensors, or (keep="quantized") the quantized bytes
themselves as `QuantizedMatrix` objects that multiply without being dequantized whole.

Every byte read goes through a ledger (`stats()`), so "payload per token" is a measurement:
`bytes_read` is the exact sum of the quantized slices fetched on cache misses. Whether a
fetch came from the page cache or the device is the kernel's business in the default mmap
mode; the `cold` modes drop the pages around each read (or bypass the page cache with
O_DIRECT) so the same counters describe storage traffic honestly.

The store knows nothing about architectures: it is given, per layer, a tuple of
`ExpertTensor` descriptions (e.g. gate, up, down) and returns tensors in that order.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from gguf import GGMLQuantizationType

from k3kit.errors import FormatError
from k3kit.runtime.dequant import SUPPORTED, block_size, dequantize, nbytes_for
from k3kit.runtime.qmatmul import NATIVE_TYPES, QuantizedMatrix

if TYPE_CHECKING:
    from k3kit.gguf.shards import Model

MIB = 1 << 20
PAGE = mmap.PAGESIZE
PAGE_TABLE_SPAN = max(PAGE, 1 << 21)  # bytes one x86-64/arm64 (4 KiB page) page table maps
MAX_SPARE = 4   # evicted quantized buffers kept per size for reuse (one expert's projections)
DIRECT_ALIGN = 4096  # O_DIRECT offset/length/buffer alignment that every common block device accepts
# Linux 5.14+: fault a range in with one call instead of one fault per page (not in Python 3.11's mmap).
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if sys.platform == "linux" else None)

ByteBuffer = np.ndarray | bytes | bytearray | memoryview


@dataclass(frozen=True)
class ExpertTensor:
    """One projection of one layer: `n_experts` matrices of ggml `shape`, back to back.

    `source` is a file path (the store maps/reads it itself; `offset` is absolute in the
    file) or an in-memory byte buffer such as `Model.view(name)` (`offset` within it).
    File sources get madvise, cold reads and change detection; buffers get none of that.
    """

    source: str | os.PathLike | ByteBuffer
    offset: int
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # one expert, ggml order, e.g. (n_in, n_out)
    n_experts: int
    name: str = ""  # for messages only

    @cached_property  # read several times per miss; frozen dataclasses allow it (no __setattr__)
    def expert_nbytes(self) -> int:
        return nbytes_for(self.ggml_type, int(np.prod(self.shape, dtype=np.int64)))

    @property
    def nbytes(self) -> int:
        return self.expert_nbytes * self.n_experts

    @property
    def is_file(self) -> bool:
        return isinstance(self.source, str | os.PathLike)


@dataclass
class LayerStats:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0


@dataclass
class ExpertStats:
    """A snapshot of the ledger. Counters reset with `reset_stats()`; resident_* are state."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0  # quantized payload fetched on misses (exact slice sizes)
    io_bytes: int = 0  # bytes asked of the OS; > bytes_read only with O_DIRECT alignment
    evictions: int = 0
    evicted_bytes: int = 0
    read_seconds: float = 0.0
    dequant_seconds: float = 0.0
    resident_bytes: int = 0  # bytes held by the cache, as held (pinned included)
    resident_experts: int = 0
    pinned_bytes: int = 0
    per_layer: dict[int, LayerStats] = field(default_factory=dict)


Weight = torch.Tensor | QuantizedMatrix


@dataclass
class _Entry:
    tensors: tuple[Weight, ...]
    nbytes: int
    pinned: bool = False


class _File:
    """An open model file: fd, optional whole-file mapping, and what it looked like at open."""

    def __init__(self, path: Path, use_mmap: bool, direct: bool) -> None:
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise FormatError(f"{path}: cannot open: {e.strerror}") from None
        st = os.fstat(self.fd)
        self.size, self.mtime_ns = st.st_size, st.st_mtime_ns
        # Python's mmap never passes MAP_POPULATE: nothing is read until a slice is touched.
        self.mm = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ) if use_mmap and self.size else None
        self.direct_fd: int | None = None
        if direct:
            try:
                self.direct_fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except (OSError, AttributeError):
                self.direct_fd = None  # e.g. tmpfs: the caller falls back to fadvise

    def check(self) -> None:
        """Raise if the file was changed or truncated since open (a mapping would SIGBUS)."""
        st = os.fstat(self.fd)
        if st.st_size != self.size or st.st_mtime_ns != self.mtime_ns:
            raise FormatError(
                f"{self.path}: file changed since it was opened (size {self.size} -> {st.st_size}, "
                f"mtime {self.mtime_ns} -> {st.st_mtime_ns})"
            )

    def close(self) -> None:
        if self.mm is not None:
            self.mm.close()
            self.mm = None
        for fd in (self.fd, self.direct_fd):
            if fd is not None:
                os.close(fd)
        self.direct_fd = None


def _drop_mapped(mm: mmap.mmap, start: int, n: int) -> None:
    """MADV_DONTNEED on bytes [start, start + n) of a read-only file mapping, widened to the
    enclosing PAGE_TABLE_SPAN windows: unmapped from this process, still in the page cache.

    Faulting a page of a file mapping also maps cached neighbours (the kernel's fault-around,
    and whole large folios), so pages outside the slice get mapped too: measured here, a
    136 KiB slice left 192 KiB mapped after dropping exactly its 64 KiB-aligned windows.
    Neither reaches past the 2 MiB one page table spans. Dropping a neighbour's mapping is
    harmless: the next touch maps it again from the page cache. Advice only: errors ignored.
    """
    lo = start // PAGE_TABLE_SPAN * PAGE_TABLE_SPAN
    hi = min(len(mm), -(-(start + n) // PAGE_TABLE_SPAN) * PAGE_TABLE_SPAN)
    with contextlib.suppress(OSError, ValueError):     # best effort: the kernel may refuse
        mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def _pread_into(fd: int, out: np.ndarray, offset: int, path: Path) -> None:
    """Fill `out` with the bytes at `offset`: the kernel copies straight from the page cache,
    with the GIL released for each call, and nothing gets mapped into this process."""
    view = memoryview(out).cast("B")
    got, n = 0, view.nbytes
    try:
        while got < n:
            k = os.preadv(fd, [view[got:]], offset + got)
            if k <= 0:
                raise FormatError(f"{path}: unexpected end of file at byte {offset + got}")
            got += k
    finally:
        view.release()


class ExpertStore:
    """Lazy, cached, ledgered access to routed expert weights.

    layers: {layer index: (ExpertTensor, ...)} in the order `get` returns tensors
            (e.g. gate, up, down); all projections of a layer share n_experts.
    cache_mib: LRU budget in MiB of what the cache holds; 0 keeps nothing beyond the
            batch being returned. Pinned experts are never evicted (and still count).
    keep: "dequantized" (torch tensors in `dtype`) or "quantized": projections of a type
            with a native kernel (MXFP4) stay as their bytes, copied out of the file into a
            `QuantizedMatrix` (CPU only); other types are still dequantized.
    cold: False (mmap, page cache does what it does), "fadvise" (pread, then
            POSIX_FADV_DONTNEED before and after each read), or "direct" (O_DIRECT
            with aligned buffers; falls back to "fadvise" where the filesystem refuses).
    madvise_random: MADV_RANDOM on the expert ranges of each mapping, so a fault does not
            read ahead into neighbouring experts nobody asked for.
    slice_readahead: on a miss, MADV_WILLNEED + MADV_POPULATE_READ on exactly the slice
            about to be copied (for a whole batch, WILLNEED goes out first so reading overlaps
            dequant). MADV_RANDOM alone turns a cold multi-MB slice into one 4 KiB read per
            page fault (3-30x slower from disk in benchmarks/expert_store.py); this asks for
            the slice in large requests without reading a byte outside it.
    release_pages: after a miss copied a slice out of a mapping, unmap its pages from this
            process (MADV_DONTNEED; see `release`). Only mmap mode maps anything.
    read_ahead: with keep="quantized" in mmap mode, after `plan(layer, ids)` each fetch starts
            reading (pread) the next planned miss in a background thread, so the read overlaps
            the caller's use of the current expert. One expert in flight at a time.
    """

    def __init__(
        self,
        layers: Mapping[int, Sequence[ExpertTensor]],
        *,
        cache_mib: float = 0,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        cold: bool | str = False,
        keep: str = "dequantized",
        madvise_random: bool = True,
        slice_readahead: bool = True,
        release_pages: bool = True,
        read_ahead: bool = True,
    ) -> None:
        if cold is True:
            cold = "fadvise"
        if cold not in (False, "fadvise", "direct"):
            raise ValueError(f"cold must be False, 'fadvise' or 'direct', not {cold!r}")
        if cache_mib < 0:
            raise ValueError("cache_mib must be >= 0")
        if keep not in ("dequantized", "quantized"):
            raise ValueError(f"keep must be 'dequantized' or 'quantized', not {keep!r}")
        if keep == "quantized" and torch.device(device).type != "cpu":
            raise ValueError("keep='quantized' runs on the CPU only")
        self.keep = keep
        self.layers: dict[int, tuple[ExpertTensor, ...]] = {int(k): tuple(v) for k, v in layers.items()}
        self.cache_bytes = int(cache_mib * MIB)
        self.dtype, self.device = dtype, torch.device(device)
        self.cold = cold
        self.slice_readahead = slice_readahead
        self.release_pages = release_pages
        self._files: dict[Path, _File] = {}
        self._cache: OrderedDict[tuple[int, int], _Entry] = OrderedDict()
        self._resident = 0
        self._pinned = 0
        self._direct_buf: mmap.mmap | None = None
        self._raw: np.ndarray | None = None
        self._spare: dict[int, list[torch.Tensor]] = {}   # byte buffers of evicted quantized experts
        self.read_ahead = read_ahead
        self._plan: tuple[int, list[int]] | None = None    # (layer, experts in the order of fetching)
        self._pending: dict[tuple[int, int], Future] = {}  # at most one background read
        self._executor: ThreadPoolExecutor | None = None
        self._stats = ExpertStats()
        try:
            self._validate_and_open(madvise_random)
        except BaseException:
            self.close()
            raise

    # -- construction -------------------------------------------------------------------

    def _validate_and_open(self, madvise_random: bool) -> None:
        for layer, tensors in self.layers.items():
            if not tensors:
                raise ValueError(f"layer {layer}: no expert tensors")
            if len({t.n_experts for t in tensors}) != 1:
                raise ValueError(f"layer {layer}: projections disagree on n_experts")
            for t in tensors:
                src = t.source if t.is_file else "<buffer>"
                where = f"{src}: {t.name or 'expert tensor'} (layer {layer})"
                qtype = GGMLQuantizationType(t.ggml_type)
                if qtype not in SUPPORTED:
                    raise FormatError(f"{where}: ggml type {qtype.name} has no dequant kernel")
                if not t.shape or t.shape[0] % block_size(qtype)[0] or t.n_experts <= 0 or t.offset < 0:
                    raise FormatError(f"{where}: bad geometry shape={t.shape} n_experts={t.n_experts} "
                                      f"offset={t.offset}")
                if t.is_file:
                    f = self._open(Path(t.source))
                    if t.offset + t.nbytes > f.size:
                        raise FormatError(f"{where}: data past end of file "
                                          f"(needs {t.offset + t.nbytes} bytes, file has {f.size})")
                    if f.mm is not None and madvise_random and hasattr(mmap, "MADV_RANDOM"):
                        start = t.offset // PAGE * PAGE
                        f.mm.madvise(mmap.MADV_RANDOM, start, t.offset + t.nbytes - start)
                elif t.offset + t.nbytes > len(memoryview(t.source).cast("B")):
                    raise FormatError(f"{where}: data past end of buffer")

    def _open(self, path: Path) -> _File:
        f = self._files.get(path)
        if f is None:
            f = _File(path, use_mmap=not self.cold, direct=self.cold == "direct")
            self._files[path] = f
        return f

    @classmethod
    def from_gguf(cls, model: Model, layers: Mapping[int, Sequence[str]], **kwargs) -> ExpertStore:
        """Build from an open `k3kit.gguf.shards.Model` and, per layer, the names of its 3-D
        expert tensors ([n_in, n_out, n_expert] in ggml order) in the order to return them."""
        spec: dict[int, list[ExpertTensor]] = {}
        for layer, names in layers.items():
            spec[layer] = []
            for name in names:
                info = model.tensors.get(name)
                if info is None:
                    raise FormatError(f"{model.paths[0]}: no tensor {name!r}")
                path = model.files[info.shard].path
                if len(info.shape) != 3:
                    raise FormatError(f"{path}: tensor {name!r} has shape {info.shape}, expected 3-D experts")
                t = ExpertTensor(path, info.offset, GGMLQuantizationType(info.ggml_type),
                                 tuple(info.shape[:2]), int(info.shape[2]), name)
                if GGMLQuantizationType(info.ggml_type) in SUPPORTED and t.nbytes != info.nbytes:
                    raise FormatError(f"{path}: tensor {name!r} is {info.nbytes} bytes, expected {t.nbytes}")
                spec[layer].append(t)
        return cls(spec, **kwargs)

    # -- queries ----------------------------------------------------------------------------

    def n_experts(self, layer: int) -> int:
        return self.layers[layer][0].n_experts

    def expert_nbytes(self, layer: int) -> int:
        """Quantized storage bytes of one expert of `layer`, all projections."""
        return sum(t.expert_nbytes for t in self.layers[layer])

    def cached_expert_nbytes(self, layer: int) -> int:
        """Bytes one expert of `layer` occupies in the cache (what `cache_mib` budgets): its
        quantized bytes for projections kept quantized, dequantized tensors for the rest."""
        item = torch.empty(0, dtype=self.dtype).element_size()
        return sum(t.expert_nbytes if self._kept_quantized(t)
                   else int(np.prod(t.shape)) * item for t in self.layers[layer])

    def is_cached(self, layer: int, expert: int) -> bool:
        return (layer, int(expert)) in self._cache

    @property
    def direct_io(self) -> bool:
        """True if every file is read with O_DIRECT (cold="direct" and the filesystem allows it)."""
        return bool(self._files) and all(f.direct_fd is not None for f in self._files.values())

    def cached_count(self, layer: int) -> int:
        return sum(1 for k in self._cache if k[0] == layer)

    def missing_bytes(self, layer: int, expert_ids: Iterable[int]) -> int:
        """Storage bytes a `get(layer, expert_ids)` would read now (unique ids not cached)."""
        ids = {int(e) for e in expert_ids}
        return sum(1 for e in ids if (layer, e) not in self._cache) * self.expert_nbytes(layer)

    def stats(self) -> ExpertStats:
        s = self._stats
        return ExpertStats(
            s.hits, s.misses, s.bytes_read, s.io_bytes, s.evictions, s.evicted_bytes, s.read_seconds,
            s.dequant_seconds, self._resident, len(self._cache), self._pinned,
            {k: LayerStats(v.hits, v.misses, v.bytes_read) for k, v in s.per_layer.items()},
        )

    def reset_stats(self) -> None:
        self._stats = ExpertStats()

    # -- loading ----------------------------------------------------------------------------

    def get(self, layer: int, expert_ids: Iterable[int]) -> dict[int, tuple[Weight, ...]]:
        """Weights of each unique expert in `expert_ids`, in ascending id order.

        Each projection comes back in row-major order: a ggml [n_in, n_out] matrix as an
        [n_out, n_in] tensor (the weight of `x @ w.T`), or as a `QuantizedMatrix` of the same
        meaning when the store keeps quantized bytes. The whole batch is returned even if
        it is larger than the cache; the budget bounds only what is kept afterwards.
        """
        ids = sorted({int(e) for e in expert_ids})
        n = self.n_experts(layer)
        if ids and (ids[0] < 0 or ids[-1] >= n):
            raise ValueError(f"layer {layer}: expert ids must be in [0, {n}), got {ids[0]}..{ids[-1]}")
        if self.slice_readahead and not self.cold:
            # Ask for every missing slice of the batch now: the kernel reads the later ones
            # while the earlier ones are being dequantized. Nothing outside the batch is touched.
            for e in ids:
                if (layer, e) not in self._cache:
                    for t in self.layers[layer]:
                        self._advise_slice(t, t.offset + e * t.expert_nbytes, t.expert_nbytes, populate=False)
        return {e: self._fetch(layer, e) for e in ids}

    def pin(self, layer: int, experts: Iterable[int]) -> None:
        """Load (if needed) and keep these experts resident regardless of the budget."""
        for e, tensors in self.get(layer, experts).items():
            entry = self._cache.get((layer, e))
            if entry is None:  # not admitted (cache_mib 0 or larger than the budget)
                entry = _Entry(tensors, sum(t.nbytes for t in tensors))
                self._cache[(layer, e)] = entry
                self._resident += entry.nbytes
            if not entry.pinned:
                entry.pinned = True
                self._pinned += entry.nbytes
        self._evict()  # pinned bytes count against the budget: make room among the rest

    def unpin(self, layer: int, experts: Iterable[int] | None = None) -> None:
        """Make pinned experts evictable again (all of `layer`'s if experts is None)."""
        if experts is None:
            keys = [k for k in self._cache if k[0] == layer]
        else:
            keys = [(layer, int(e)) for e in experts]
        for k in keys:
            entry = self._cache.get(k)
            if entry is not None and entry.pinned:
                entry.pinned = False
                self._pinned -= entry.nbytes
        self._evict()

    def plan(self, layer: int, expert_ids: Sequence[int]) -> None:
        """The experts of `layer` about to be fetched one by one, in this order.

        A hint: each fetch then starts reading the next planned miss in the background (one
        expert ahead), so a miss's copy overlaps the use of the expert before it. Only stores
        that keep quantized bytes of a mapped file read ahead: the read is then a plain copy,
        and nothing but the copy leaves the caller's thread. Costs one expert of memory.
        """
        if not (self.read_ahead and not self.cold
                and all(self._kept_quantized(t) and t.is_file for t in self.layers[layer])):
            return
        self._plan = (layer, [int(e) for e in expert_ids])
        self._start_read_ahead(layer, None)

    def _start_read_ahead(self, layer: int, after: int | None) -> None:
        """Submit the first planned expert after `after` that is neither cached nor being read."""
        if self._plan is None or self._plan[0] != layer or self._pending:
            return
        ids = self._plan[1]
        start = 0 if after is None or after not in ids else ids.index(after) + 1
        for e in ids[start:]:
            if (layer, e) in self._cache:
                continue
            buffers = [self._buffer(t.expert_nbytes) for t in self.layers[layer]]
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="k3kit-experts")
            self._pending[(layer, e)] = self._executor.submit(self._read_expert, layer, e, buffers)
            return
        self._plan = None

    def _read_expert(self, layer: int, e: int,
                     buffers: list[torch.Tensor]) -> tuple[tuple[Weight, ...], float]:
        """Background thread: read one expert's slices into `buffers` through the file
        descriptors. Touches no shared state (the ledger is updated by whoever collects it)."""
        t0 = time.perf_counter()
        out = []
        for t, buf in zip(self.layers[layer], buffers, strict=True):
            start = t.offset + e * t.expert_nbytes
            f = self._files[Path(t.source)]
            f.check()
            # pread, not a copy out of the mapping: nothing is mapped that would have to be
            # dropped again (madvise holds the GIL, which the caller's thread is waiting for)
            _pread_into(f.fd, buf.numpy(), start, f.path)
            out.append(self._quantized(t, buf))
        return tuple(out), time.perf_counter() - t0

    def _collect(self, layer: int, fut: Future) -> tuple[Weight, ...]:
        """Wait for a background read and put it in the ledger as a miss."""
        out, seconds = fut.result()     # a changed or truncated file raises here, on the caller's thread
        n = self.expert_nbytes(layer)
        self._stats.io_bytes += n
        self._stats.bytes_read += n
        self._stats.per_layer.setdefault(layer, LayerStats()).bytes_read += n
        self._stats.read_seconds += seconds
        return out

    def _drain(self) -> None:
        """Finish and drop background reads nobody collected (their bytes were still read)."""
        for (layer, _), fut in self._pending.items():
            with contextlib.suppress(Exception):
                self._collect(layer, fut)
        self._pending.clear()
        self._plan = None

    def _fetch(self, layer: int, e: int) -> tuple[Weight, ...]:
        ls = self._stats.per_layer.setdefault(layer, LayerStats())
        entry = self._cache.get((layer, e))
        if entry is not None:
            self._cache.move_to_end((layer, e))
            self._stats.hits += 1
            ls.hits += 1
            self._start_read_ahead(layer, e)
            return entry.tensors
        self._stats.misses += 1
        ls.misses += 1
        fut = self._pending.pop((layer, e), None)
        out = self._collect(layer, fut) if fut is not None else self._load(layer, e, ls)
        nbytes = sum(w.nbytes for w in out)
        if 0 < nbytes <= self.cache_bytes:
            self._cache[(layer, e)] = _Entry(out, nbytes)
            self._resident += nbytes
            self._evict()
        self._start_read_ahead(layer, e)     # after eviction: its buffers can take the next read
        return out

    def _load(self, layer: int, e: int, ls: LayerStats) -> tuple[Weight, ...]:
        """Read (and dequantize, unless kept quantized) one expert on this thread."""
        tensors = []
        for t in self.layers[layer]:
            start, n = t.offset + e * t.expert_nbytes, t.expert_nbytes
            t0 = time.perf_counter()
            if self._kept_quantized(t):     # read straight into the buffer the cache will hold
                w = self._quantized(t, self._buffer(n))
                self._read(t, start, n, w.raw.numpy())
                t1 = time.perf_counter()
            else:
                raw = self._read(t, start, n)
                t1 = time.perf_counter()
                w = dequantize(raw, t.ggml_type, t.shape, self.dtype)
                w = w if self.device.type == "cpu" else w.to(self.device)
            tensors.append(w)
            self._stats.read_seconds += t1 - t0
            self._stats.dequant_seconds += time.perf_counter() - t1
            self._stats.bytes_read += n
            ls.bytes_read += n
        return tuple(tensors)

    def _kept_quantized(self, t: ExpertTensor) -> bool:
        """Whether the cache holds this projection as its bytes (keep="quantized", native type)."""
        return self.keep == "quantized" and t.ggml_type in NATIVE_TYPES

    def _quantized(self, t: ExpertTensor, buf: torch.Tensor) -> QuantizedMatrix:
        return QuantizedMatrix(buf, GGMLQuantizationType(t.ggml_type), (t.shape[0], t.shape[1]), self.dtype)

    def _evict(self) -> None:
        if self._resident <= self.cache_bytes:
            return
        for key in list(self._cache):
            if self._resident <= self.cache_bytes:
                break
            entry = self._cache[key]
            if entry.pinned:
                continue
            del self._cache[key]
            for w in entry.tensors:
                if isinstance(w, QuantizedMatrix):
                    spare = self._spare.setdefault(w.nbytes, [])
                    if len(spare) < MAX_SPARE:
                        spare.append(w.raw)
            self._resident -= entry.nbytes
            self._stats.evictions += 1
            self._stats.evicted_bytes += entry.nbytes

    def _buffer(self, n: int) -> torch.Tensor:
        """An n-byte tensor for a quantized miss: the bytes of an evicted expert nobody holds any
        more, else a fresh one. At steady state every miss evicts an expert of the same size, so
        misses stop paying the page faults of a fresh multi-MB allocation (measured here: the
        fault-in of a fresh 5.8 MB buffer cost more than copying the slice into it)."""
        spare = self._spare.get(n)
        while spare:
            buf = spare.pop()
            if sys.getrefcount(buf) <= 2:   # this name and the call's argument: no one else holds it
                return buf
        return torch.from_numpy(np.empty(n, dtype=np.uint8))   # faults in faster than torch.empty here

    def _scratch(self, n: int) -> np.ndarray:
        """A private, writable n-byte buffer, reused by every miss: the raw slice lives only
        until it is dequantized, and a fresh multi-MB array per read would be faulted in page
        by page each time (here ~5 ms per 6 MB slice, a tenth of the slice's dequant)."""
        if self._raw is None or self._raw.size < n:
            self._raw = np.empty(n, dtype=np.uint8)
        return self._raw[:n]

    def _read(self, t: ExpertTensor, start: int, n: int, out: np.ndarray | None = None) -> np.ndarray:
        """The n bytes at `start` of t's source, in `out` or else the store's scratch buffer
        (valid until the next read)."""
        out = self._scratch(n) if out is None else out
        if not t.is_file:
            buf = t.source if isinstance(t.source, np.ndarray) else np.frombuffer(t.source, np.uint8)
            self._stats.io_bytes += n
            out[:] = buf.reshape(-1)[start : start + n]
            return out
        f = self._files[Path(t.source)]
        f.check()
        if f.mm is not None:
            if self.slice_readahead:
                self._advise_slice(t, start, n, populate=True)
            self._stats.io_bytes += n
            out[:] = np.frombuffer(f.mm, np.uint8, n, start)
            if self.release_pages:
                _drop_mapped(f.mm, start, n)
            return out
        if f.direct_fd is not None:
            return self._read_direct(f, start, n, out)
        os.posix_fadvise(f.fd, start, n, os.POSIX_FADV_DONTNEED)  # make sure the read goes to storage
        _pread_into(f.fd, out, start, f.path)
        os.posix_fadvise(f.fd, start, n, os.POSIX_FADV_DONTNEED)  # and leave nothing behind
        self._stats.io_bytes += n
        return out

    def release(self, layer: int, expert: int) -> None:
        """Unmap one expert's file pages from this process (all projections of `layer`).

        A miss copies the slice out of the mapping, and the pages it touched stay in this
        process's resident set (shared, clean, reclaimable, yet counted in RSS) until the
        kernel needs the memory. The page cache is the quantized expert cache we want; our
        RSS should hold only the dequantized LRU. MADV_DONTNEED drops the mappings here while
        the page cache keeps the data. Misses do this themselves unless release_pages=False;
        no-op for buffer sources and the pread/O_DIRECT modes, which map nothing.
        """
        for t in self.layers[layer]:
            f = self._files.get(Path(t.source)) if t.is_file else None
            if f is not None and f.mm is not None:
                _drop_mapped(f.mm, t.offset + int(expert) * t.expert_nbytes, t.expert_nbytes)

    def _advise_slice(self, t: ExpertTensor, start: int, n: int, populate: bool) -> None:
        """WILLNEED (asynchronous read of the slice), then optionally POPULATE_READ (wait for it
        and map it in one call). No-op for buffer sources."""
        global MADV_POPULATE_READ
        mm = self._files[Path(t.source)].mm if t.is_file else None
        if mm is None:
            return
        lo = start // PAGE * PAGE
        try:
            mm.madvise(mmap.MADV_WILLNEED, lo, start + n - lo)
        except OSError:  # advice only; a changed file is reported by the read that follows
            return
        if populate and MADV_POPULATE_READ is not None:
            try:
                mm.madvise(MADV_POPULATE_READ, lo, start + n - lo)
            except OSError:  # kernel older than 5.14: the copy below faults the pages in
                MADV_POPULATE_READ = None

    def _read_direct(self, f: _File, start: int, n: int, out: np.ndarray) -> np.ndarray:
        lo = start // DIRECT_ALIGN * DIRECT_ALIGN
        hi = -(-(start + n) // DIRECT_ALIGN) * DIRECT_ALIGN
        if self._direct_buf is None or len(self._direct_buf) < hi - lo:
            if self._direct_buf is not None:
                self._direct_buf.close()
            self._direct_buf = mmap.mmap(-1, hi - lo)  # anonymous maps are page aligned
        view = memoryview(self._direct_buf)[: hi - lo]
        got = 0
        try:
            while got < start + n - lo:
                k = os.preadv(f.direct_fd, [view[got:]], lo + got)
                if k <= 0:
                    raise FormatError(f"{f.path}: unexpected end of file at byte {lo + got}")
                got += k
                if got % DIRECT_ALIGN:  # a short read not on a block boundary can only be EOF
                    break
            if got < start + n - lo:
                raise FormatError(f"{f.path}: unexpected end of file at byte {lo + got}")
            self._stats.io_bytes += got
            out[:] = np.frombuffer(view, np.uint8, n, start - lo)
            return out
        finally:
            view.release()

    # -- lifetime -----------------------------------------------------------------------------

    def clear(self) -> None:
        """Drop every cached expert, pinned ones included."""
        self._drain()
        self._cache.clear()
        self._spare.clear()
        self._resident = self._pinned = 0

    def close(self) -> None:
        self.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        for f in self._files.values():
            f.close()
        self._files.clear()
        if self._direct_buf is not None:
            self._direct_buf.close()
            self._direct_buf = None
        self._raw = None

    def __enter__(self) -> ExpertStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
