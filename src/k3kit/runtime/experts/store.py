"""The expert store: quantized expert bytes in model files -> weights the MoE multiplies.

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

This module ties the two halves together: how a slice is read (`io.MappedFile`) and what is
kept and counted (`cache.ExpertCache`). It knows nothing about architectures: it is given,
per layer, a tuple of `ExpertTensor` descriptions (e.g. gate, up, down) and returns weights
in that order.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from k3kit.errors import FormatError
from k3kit.gguf.quants import CorruptBlockError, first_nonfinite_block
from k3kit.gguf.quants.scales import CHECKED
from k3kit.kernels.dequant import SUPPORTED, block_size, dequantize, nbytes_for
from k3kit.kernels.qmatmul import NATIVE_TYPES, QuantizedMatrix

from .cache import MIB, ExpertCache, ExpertStats, Key, Weight
from .io import DIRECT_ALIGN, PAGE_TABLE_SPAN, AlignedScratch, MappedFile

if TYPE_CHECKING:
    from k3kit.gguf.shards import Model

ByteBuffer = np.ndarray | bytes | bytearray | memoryview
MAP_SPAN_LIMIT = 1.5    # map_misses: largest (mapped windows / slice bytes) of an expert served as views
# populate (MADV_POPULATE_READ) CPU seconds per MiB above which a slice's page cache is taken to be in
# 4 KiB pages (measured here: 70-90 us per MiB; in 2 MiB folios under 1 us): see huge_pages
SMALL_PAGES_S_PER_MIB = 1e-5
PRECISION_WARMUP = 64   # scored guesses before prefetch_precision may turn prefetch reads off
# Guesses read only while at least this share is right. On the 52 GB random-weight K3 file the
# next-layer guess is right 39% of the time (137 of 348) and prefetch cost 12-23% of decode speed
# whenever the disk was not throttled (3 of 3 pairs); on the trained mini it is right 79%.
PREFETCH_PRECISION = 0.5
CHECK_CHUNK = 1 << 19   # bytes read, then scale-checked while still in cache (whole blocks)


class _Stopped(Exception):
    """A background read dropped before it finished: what it had read by then."""

    def __init__(self, io_bytes: int, payload: int) -> None:
        super().__init__(io_bytes, payload)
        self.io_bytes, self.payload = io_bytes, payload


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
        return self.path is not None

    @cached_property
    def path(self) -> Path | None:
        """The file holding the tensor, or None for an in-memory buffer."""
        return Path(self.source) if isinstance(self.source, str | os.PathLike) else None

    def buffer(self) -> np.ndarray:
        """An in-memory source as an array (a byte buffer as uint8)."""
        src = self.source
        if isinstance(src, str | os.PathLike):
            raise TypeError(f"{src}: a file, not a buffer")
        return src if isinstance(src, np.ndarray) else np.frombuffer(src, np.uint8)


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
            True means "direct": the device writes a quantized miss straight into the buffer
            the cache keeps (laid out around the slice's aligned span, `ExpertCache.buffer`),
            so a read costs no copy and no page-cache work on a CPU the products need.
            Why it is the default: at the disk the two paths are equal (4 readers of random
            5.8 MB slices, no products: 780-980 MB/s each), but "fadvise" costs the kernel
            0.5-0.8 s of CPU per GB read (page-cache pages allocated, copied out, dropped), and on
            a 2-core machine that is the core the products and the readers share. On the 36 GB
            K3 file (1.4x RAM), 1 thread, alternated in one process (`bench_out_of_core.py
            --ab cold,fadvise`, 11 pairs): system CPU 0.2-1.2 s vs 4.8-6.2 s per run, expert
            payload 1.27-1.93x fadvise's in every pair (median 1.51; 933 vs 641 MB/s, 0.81 vs
            0.64 of the disk's limit). `set_cold` switches a live store between the modes.
    madvise_random: MADV_RANDOM on the expert ranges of each mapping, so a fault does not
            read ahead into neighbouring experts nobody asked for.
    slice_readahead: on a miss, MADV_WILLNEED + MADV_POPULATE_READ on exactly the slice
            about to be copied (for a whole batch, WILLNEED goes out first so reading overlaps
            dequant). MADV_RANDOM alone turns a cold multi-MB slice into one 4 KiB read per
            page fault (3-30x slower from disk in benchmarks/expert_store.py); this asks for
            the slice in large requests without reading a byte outside it.
    release_pages: after a miss copied a slice out of a mapping, unmap its pages from this
            process (MADV_DONTNEED; see `release`). Only mmap mode maps anything.
    map_misses: in mmap mode with keep="quantized", a miss whose slices are in the page
            cache already (mincore, sampled) and large (MAP_SPAN_LIMIT) is not copied anywhere:
            its `QuantizedMatrix` weights are views of the mapping and the products read the page
            cache's pages where they lie, as llama.cpp's mmap does. Such experts are not read
            ahead either (there is nothing to read). The budget still bounds what stays mapped
            into this process: a mapped expert counts the page-table windows around its slices
            (what faults may map, see `MappedFile.mapped_span`), and an evicted one's pages are
            dropped from it (MADV_DONTNEED, when release_pages) at the next `get`, once its
            caller is done. Why: with a cache smaller than a token's experts, each miss used to
            copy its slices (~280 MB a token on a K3 slice) out of the page cache into cache
            buffers, on the cores the products need.
    huge_pages: with map_misses, MADV_HUGEPAGE on the expert ranges of K3-sized slices (>= 4
            MiB), and a slice whose first mapping shows it cached in 4 KiB pages (populate CPU
            time above SMALL_PAGES_S_PER_MIB) is read again once into 2 MiB folios
            (`MappedFile.rehome`). Why: mapping and dropping a 17.5 MB K3 expert cost ~1.3 +
            ~0.5 ms of page-table work in 4 KiB pages, i.e. ~20 ms a token through a 128 MiB
            cache on a K3 slice, and ~0.05 ms in 2 MiB ones (benchmarks/bench_mapped_misses.py).
            The price: one read of such a slice from storage per store.
    map_ahead: with read_ahead and map_misses, `plan` hands the planned misses that map to one
            background thread (the mapping thread), one expert ahead of the caller: it checks the
            page cache, maps and scale-checks the slices while the caller multiplies the expert
            before; it also drops evicted views. What is mapped ahead counts against the budget
            like a read in flight: when every cached expert is planned, the one planned last
            gives up its place (`ExpertCache.evict_planned`).
    check_scales: on every miss, check the slice's scale fields (`first_nonfinite_block`: one
            byte column per block, well under a millisecond per K3 projection) and raise
            CorruptBlockError naming file, tensor, expert and block instead of letting a NaN
            or inf scale turn into garbage text.
    prefetch_precision: read prefetch hints only while at least this share of them turned out
            right (0: always; see `prefetch` and PREFETCH_PRECISION).
    read_ahead: with keep="quantized" (any read mode), `plan(layer, ids)` queues the planned
            misses and `prefetch(layer, ids)` the experts a later layer will probably want;
            `read_threads` background threads read them (pread; fadvise or O_DIRECT when cold)
            while the caller computes. Reads in flight count against the cache budget and make
            room like a miss does (LRU; never a planned or pinned expert), at most
            `read_ahead_mib` and half the budget ahead (one expert whatever the budget).
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
        map_misses: bool = True,
        huge_pages: bool = True,
        map_ahead: bool = True,
        read_ahead: bool = True,
        check_scales: bool = True,
        read_ahead_mib: float = 512,
        read_threads: int = 4,
        arith: str = "",
        prefetch_precision: float = PREFETCH_PRECISION,
    ) -> None:
        if cold is True:
            cold = "direct"
        if cold not in (False, "fadvise", "direct"):
            raise ValueError(f"cold must be False, 'fadvise' or 'direct', not {cold!r}")
        if cache_mib < 0:
            raise ValueError("cache_mib must be >= 0")
        if keep not in ("dequantized", "quantized"):
            raise ValueError(f"keep must be 'dequantized' or 'quantized', not {keep!r}")
        if keep == "quantized" and torch.device(device).type != "cpu":
            raise ValueError("keep='quantized' runs on the CPU only")
        self.keep = keep
        self.arith = arith        # arithmetic of the native products of kept-quantized experts
        self.layers: dict[int, tuple[ExpertTensor, ...]] = {int(k): tuple(v) for k, v in layers.items()}
        self._cache = ExpertCache(int(cache_mib * MIB))
        self.dtype, self.device = dtype, torch.device(device)
        self.cold = cold
        self.slice_readahead = slice_readahead
        self.release_pages = release_pages
        self.map_misses = map_misses
        self.huge_pages = huge_pages
        self.map_ahead = map_ahead
        self._rehomed: set[tuple[Key, int]] = set()    # (expert, projection) read again in 2 MiB pages
        self._checked: set[Key] = set()     # mapped experts whose scales were checked (once)
        self._files: dict[Path, MappedFile] = {}
        self._direct = AlignedScratch()
        self._raw: np.ndarray | None = None
        self.read_ahead = read_ahead
        self.check_scales = check_scales
        self.read_ahead_bytes = int(read_ahead_mib * MIB)
        self.read_threads = max(1, int(read_threads))
        self.prefetch_precision = float(prefetch_precision)
        self._guess: dict[int, set[int]] = {}     # the last prefetch hint per layer, until it is planned
        # background reads: wanted (not yet submitted, planned ones first), submitted, and
        # dropped ones still running (their bytes stay reserved until they finish)
        self._queue: list[Key] = []
        self._pending: dict[Key, Future] = {}
        self._orphans: list[tuple[Key, Future, int, bool]] = []   # + bytes reserved, a mapping job
        self._reserved: dict[Key, int] = {}     # bytes a submitted job holds against the budget
        self._map_jobs: set[Key] = set()        # queued or submitted keys mapped, not read
        self._map_ok: dict[Key, bool] = {}      # `_maps` of a planned key, until it is fetched
        self._plan_order: list[Key] = []        # the current plan, in order
        self._plan_rank: dict[Key, int] = {}
        self._releases: list[Future] = []       # background releases of evicted views
        self._stops: dict[Key, threading.Event] = {}   # set: a dropped read stops at its next slice
        self._planned: set[Key] = set()       # the current plan's experts
        self._predicted: set[Key] = set()     # experts queued or read because of prefetch()
        self._executor: ThreadPoolExecutor | None = None
        self._mapper: ThreadPoolExecutor | None = None
        self._scratch_local = threading.local()  # one O_DIRECT buffer per reader thread
        self._scratches: list[AlignedScratch] = []
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
                where = f"{t.path or '<buffer>'}: {t.name or 'expert tensor'} (layer {layer})"
                qtype = GGMLQuantizationType(t.ggml_type)
                if qtype not in SUPPORTED:
                    raise FormatError(f"{where}: ggml type {qtype.name} has no dequant kernel")
                if not t.shape or t.shape[0] % block_size(qtype)[0] or t.n_experts <= 0 or t.offset < 0:
                    raise FormatError(f"{where}: bad geometry shape={t.shape} n_experts={t.n_experts} "
                                      f"offset={t.offset}")
                if t.path is not None:
                    f = self._open(t.path)
                    if t.offset + t.nbytes > f.size:
                        raise FormatError(f"{where}: data past end of file "
                                          f"(needs {t.offset + t.nbytes} bytes, file has {f.size})")
                    if madvise_random:
                        f.advise_random(t.offset, t.nbytes)
                    if (self.huge_pages and self.map_misses and self._kept_quantized(t)
                            and t.expert_nbytes >= 2 * PAGE_TABLE_SPAN):    # slices worth mapping
                        f.advise_huge(t.offset, t.nbytes)
                elif t.offset + t.nbytes > t.buffer().nbytes:
                    raise FormatError(f"{where}: data past end of buffer")

    def _open(self, path: Path) -> MappedFile:
        f = self._files.get(path)
        if f is None:
            f = MappedFile(path, use_mmap=not self.cold, direct=self.cold == "direct")
            f.read_exactly()      # preads (cold misses, background reads) read their slice only
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

    @property
    def cache_bytes(self) -> int:
        """The LRU budget in bytes (settable: a new budget applies from the next miss)."""
        return self._cache.budget

    @cache_bytes.setter
    def cache_bytes(self, n: int) -> None:
        self._cache.budget = int(n)

    def is_cached(self, layer: int, expert: int) -> bool:
        return (layer, int(expert)) in self._cache

    def set_cold(self, cold: bool | str) -> None:
        """Switch the read mode (False, "fadvise", "direct"/True) of a store in use: drops every
        cached expert and read in flight and reopens the files. Lets one process compare the
        modes back to back on the same loaded model (benchmarks/bench_out_of_core.py `ab`); a
        new `read_threads` applies from here too."""
        if cold is True:
            cold = "direct"
        if cold not in (False, "fadvise", "direct"):
            raise ValueError(f"cold must be False, 'fadvise' or 'direct', not {cold!r}")
        self.clear()
        self._shutdown()
        for f in self._files.values():
            f.close()
        self._files.clear()
        self.cold = cold
        self._validate_and_open(madvise_random=True)

    @property
    def direct_io(self) -> bool:
        """True if every file is read with O_DIRECT (cold="direct" and the filesystem allows it)."""
        return bool(self._files) and all(f.direct_fd is not None for f in self._files.values())

    def cached_count(self, layer: int) -> int:
        return self._cache.count(layer)

    def missing_bytes(self, layer: int, expert_ids: Iterable[int]) -> int:
        """Storage bytes a `get(layer, expert_ids)` would read now (unique ids not cached)."""
        ids = {int(e) for e in expert_ids}
        return sum(1 for e in ids if (layer, e) not in self._cache) * self.expert_nbytes(layer)

    def stats(self) -> ExpertStats:
        return self._cache.stats()

    def reset_stats(self) -> None:
        self._cache.reset_stats()

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
        self._unmap_evicted()
        if self.slice_readahead and not self.cold:
            # Ask for every missing slice of the batch now: the kernel reads the later ones
            # while the earlier ones are being dequantized. Nothing outside the batch is touched.
            for e in ids:
                key = (layer, e)
                if key not in self._cache and key not in self._pending and not self._will_map(key):
                    for t in self.layers[layer]:
                        if t.path is not None:
                            self._files[t.path].advise_slice(t.offset + e * t.expert_nbytes, t.expert_nbytes,
                                                             populate=False)
        return {e: self._fetch(layer, e) for e in ids}

    def pin(self, layer: int, experts: Iterable[int]) -> None:
        """Load (if needed) and keep these experts resident regardless of the budget."""
        for e, tensors in self.get(layer, experts).items():
            self._cache.pin((layer, e), tensors)
        self._cache.evict()  # pinned bytes count against the budget: make room among the rest

    def unpin(self, layer: int, experts: Iterable[int] | None = None) -> None:
        """Make pinned experts evictable again (all of `layer`'s if experts is None)."""
        keys = self._cache.keys(layer) if experts is None else [(layer, int(e)) for e in experts]
        self._cache.unpin(keys)
        self._cache.evict()

    def plan(self, layer: int, expert_ids: Sequence[int]) -> None:
        """The experts of `layer` about to be fetched one by one, in this order.

        A hint: their misses are queued for the background readers at once, so a miss's read
        overlaps the use of the experts before it. Anything read ahead for another layer, or
        prefetched for this one and not in the plan, is dropped. Only stores that keep
        quantized bytes of files read ahead (the read is then a plain copy into the buffer
        the cache will hold, and nothing but the copy leaves the caller's thread).
        """
        if not self._reads_ahead(layer):
            return
        keys = [(layer, int(e)) for e in expert_ids]
        guess = self._guess.pop(layer, None)
        if guess is not None:
            self._cache.ledger.guesses += len(guess)
            self._cache.ledger.guesses_right += len(guess & {e for _, e in keys})
        self._planned = set(keys)
        self._plan_order = keys
        self._plan_rank = {k: i for i, k in enumerate(keys)}
        self._cache.protect = set(keys)
        for key in [k for k in self._pending if k not in self._planned]:
            self._drop(key)
        self._predicted &= set(self._pending)     # read as a guess, now planned: still a prefetch hit
        self._map_ok = {}
        self._queue = [k for k in keys if k not in self._pending and k not in self._cache
                       and (self.map_ahead or not self._will_map(k))]
        self._map_jobs = ({k for k in self._queue if self.map_ahead and self._mappable(*k)}
                          | (self._map_jobs & set(self._pending)))
        self._pump()

    def prefetch(self, layer: int, expert_ids: Sequence[int]) -> None:
        """Experts of `layer` that will probably be planned next (a router's early guess):
        queued behind the current plan's misses, so the readers keep the storage busy while
        the caller finishes this layer and computes up to that one. A wrong guess costs the
        read (`wasted_bytes`) and never changes a result: weights are only ever taken from
        `get`, and an expert is admitted to the cache only when fetched.

        Every hint is scored against the plan that follows (`guesses`, `guesses_right`), read or
        not; with `prefetch_precision` > 0, hints are only read while the share of right guesses
        so far (after PRECISION_WARMUP) is at least that: a wrong guess costs storage time, which
        a run already limited by its storage pays for in demand reads (module benchmarks)."""
        if not self._reads_ahead(layer):
            return
        self._guess[layer] = {int(e) for e in expert_ids}
        ledger = self._cache.ledger
        if (self.prefetch_precision > 0 and ledger.guesses >= PRECISION_WARMUP
                and ledger.guesses_right < self.prefetch_precision * ledger.guesses):
            return
        for e in expert_ids:
            key = (layer, int(e))
            if key in self._cache or key in self._pending or key in self._queue or self._will_map(key):
                continue
            self._queue.append(key)
            self._predicted.add(key)
        self._pump()

    def _reads_ahead(self, layer: int) -> bool:
        return self.read_ahead and layer in self.layers and all(
            self._kept_quantized(t) and t.is_file for t in self.layers[layer])

    def _ahead_limit(self) -> int:
        """Bytes the background reads may hold at once (one expert is always allowed)."""
        return min(self.read_ahead_bytes, self._cache.budget // 2)

    def _pump(self) -> None:
        """Submit queued reads while they fit: within the read-ahead limit, and within the cache
        budget once least recently used experts make room. With nothing in flight the next
        read always goes (one expert over a budget too small for it, as a miss would be)."""
        self._reap()
        while self._queue:
            key = self._queue[0]
            if key in self._cache or key in self._pending:
                self._queue.pop(0)
                continue
            maps = key in self._map_jobs
            n = self.expert_nbytes(key[0])
            if maps:            # views (or, out of the page cache, buffers)
                n = max(n, self._mapped_bytes(*key))
            # a mapping job goes one expert ahead: it only has to beat the product before it
            if self._cache.in_flight and (maps or self._cache.in_flight + n > self._ahead_limit()
                                          or not self._cache.evict(extra=n)):
                return
            self._queue.pop(0)
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=self.read_threads,
                                                    thread_name_prefix="k3kit-experts")
            if maps and not self._cache.evict(extra=n):
                # every cached expert is planned: the one used last gives up its place (a hit
                # fewer), so that views in flight stay within the budget too
                for k in self._cache.evict_planned(reversed(self._plan_order), extra=n):
                    if self._mappable(*k):
                        self._map_jobs.add(k)
                    self._queue.append(k)
                self._queue.sort(key=lambda k: self._plan_rank.get(k, len(self._plan_rank)))
            self._cache.in_flight += n
            self._reserved[key] = n
            stop = self._stops[key] = threading.Event()
            if maps:
                self._pending[key] = self._mapping_thread().submit(self._map_expert, key[0], key[1], stop)
            else:
                buffers = [self._buffer(t, key[1]) for t in self.layers[key[0]]]
                self._pending[key] = self._executor.submit(self._read_expert, key[0], key[1], buffers, stop)
            if key in self._predicted:
                self._cache.ledger.prefetched += 1

    def _drop(self, key: Key) -> None:
        """Forget a submitted read nobody will use: cancelled if not started, else left to finish."""
        fut = self._pending.pop(key)
        n = self._reserved.pop(key)
        maps = key in self._map_jobs
        self._map_jobs.discard(key)
        stop = self._stops.pop(key, None)
        if stop is not None:
            stop.set()          # a wrong guess started: it gives the reader back after one slice
        if fut.cancel():
            self._cache.in_flight -= n
            if key in self._predicted:
                self._cache.ledger.prefetched -= 1
        else:
            self._orphans.append((key, fut, n, maps))
        self._predicted.discard(key)

    def _reap(self, wait: bool = False) -> None:
        """Release the bytes of dropped reads that finished (all of them, waiting, if `wait`)."""
        keep = []
        for key, fut, n, maps in self._orphans:
            if not (wait or fut.done()):
                keep.append((key, fut, n, maps))
                continue
            self._cache.in_flight -= n
            if maps:                # views nobody took: their pages go at the next get
                with contextlib.suppress(Exception):
                    fut.result()
                self._cache.unmapped.append(key)
                continue
            n = self.expert_nbytes(key[0])
            try:
                *_, io_bytes = fut.result()
                payload = n
            except _Stopped as stopped:
                io_bytes, payload = stopped.io_bytes, stopped.payload
            except Exception:           # nobody wanted it: its errors neither
                continue
            self._cache.ledger.io_bytes += io_bytes
            self._cache.ledger.wasted_bytes += payload
        self._orphans = keep

    def _read_expert(self, layer: int, e: int, buffers: list[torch.Tensor],
                     stop: threading.Event) -> tuple[tuple[Weight, ...], float, float, int]:
        """Background thread: read one expert's slices into `buffers` and check their scales.
        Touches no shared state (the ledger is updated by whoever collects it, and a changed,
        truncated or corrupt file raises there, on the caller's thread). Returns (weights,
        read seconds, check seconds, bytes asked of the OS). A read dropped while running
        (`stop` set) ends before its next projection: a wrong guess holds a reader (and the
        storage) for one slice, not for a whole expert, once the real plan's misses queue."""
        t0 = time.perf_counter()
        out: list[QuantizedMatrix] = []
        check = 0.0
        io_bytes = 0
        for t, buf in zip(self.layers[layer], buffers, strict=True):
            if stop.is_set():       # dropped (a guess the plan did not confirm): stop reading it
                raise _Stopped(io_bytes, sum(x.raw.nbytes for x in out))
            n, c = self._read_slice(layer, e, t, buf.numpy(), background=True)
            io_bytes += n
            check += c
            out.append(self._quantized(t, buf))
        return tuple(out), time.perf_counter() - t0 - check, check, io_bytes

    def _thread_scratch(self) -> AlignedScratch:
        scratch = getattr(self._scratch_local, "scratch", None)
        if scratch is None:
            scratch = self._scratch_local.scratch = AlignedScratch()
            self._scratches.append(scratch)     # list.append is atomic: closed with the store
        return scratch

    def _collect(self, key: Key, fut: Future) -> tuple[Weight, ...]:
        """Wait for a background read and put it in the ledger as a miss."""
        t0 = time.perf_counter()
        try:
            out, seconds, check, io_bytes = fut.result()
        finally:
            self._cache.in_flight -= self._reserved.pop(key)
        ledger = self._cache.ledger
        ledger.wait_seconds += time.perf_counter() - t0
        ledger.io_bytes += io_bytes
        self._cache.record_read(key[0], self.expert_nbytes(key[0]))
        ledger.read_seconds += seconds
        ledger.check_seconds += check
        ledger.ahead_reads += 1
        if key in self._predicted:
            ledger.prefetch_used += 1
        return out

    def _drain(self) -> None:
        """Drop every queued and submitted read (their bytes were still read) and the plan."""
        for key in list(self._pending):
            self._drop(key)
        self._reap(wait=True)
        self._settle()
        self._queue = []
        self._map_jobs = set()
        self._map_ok = {}
        self._plan_order, self._plan_rank = [], {}
        self._planned = set()
        self._predicted = set()
        self._cache.protect = set()
        self._guess = {}

    def _fetch(self, layer: int, e: int) -> tuple[Weight, ...]:
        key = (layer, e)
        cached = self._cache.lookup(key)
        if cached is not None:
            self._cache.record_hit(layer)
            self._cache.protect.discard(key)
            self._pump()
            return cached
        self._cache.record_miss(layer)
        fut = self._pending.pop(key, None)
        self._stops.pop(key, None)
        mapped = key in self._map_jobs
        self._map_jobs.discard(key)
        if fut is not None:
            out = self._collect(key, fut)
            if mapped and not self._views(layer, out):
                mapped = False          # not in the page cache: the job read it into buffers
        else:
            if key in self._queue:
                self._queue.remove(key)
            mapped = self._will_map(key)
            out = self._map(layer, e) if mapped else self._load(layer, e)
        self._map_ok.pop(key, None)
        self._predicted.discard(key)
        self._cache.protect.discard(key)
        if mapped:
            self._cache.mapped.add(key)
            self._cache.admit(key, out, self._mapped_bytes(layer, e))
            if key not in self._cache:          # larger than the budget: dropped after this batch
                self._cache.mapped.discard(key)
                self._cache.unmapped.append(key)
        else:
            self._cache.admit(key, out)
        self._pump()                        # after eviction: its buffers can take the next read
        return out

    def _maps(self, layer: int, e: int) -> bool:
        """Whether a miss of expert e of `layer` is served as views of the mapping (map_misses):
        mmap mode, every projection kept quantized from a file, every slice in the page cache,
        and slices large enough that the windows a view may keep mapped (what it costs the
        budget) are at most MAP_SPAN_LIMIT times their bytes: a K3 expert's 5.8 MB slices at
        most ~1.4x, a small model's 100 KB slices 20x and more (those are copied)."""
        return self._mappable(layer, e) and self._resident(layer, e)

    def _mappable(self, layer: int, e: int) -> bool:
        """`_maps` but for the page cache's part: whether expert e of `layer` would be mapped
        if its slices were in the page cache."""
        if not self.map_misses or self.cold or layer not in self.layers:
            return False
        if self._mapped_bytes(layer, e) > MAP_SPAN_LIMIT * self.expert_nbytes(layer):
            return False
        for t in self.layers[layer]:
            f = self._files.get(t.path) if t.path is not None else None
            if f is None or f.mm is None or not self._kept_quantized(t):
                return False
        return True

    def _resident(self, layer: int, e: int) -> bool:
        """Whether the slices of expert e of a mappable layer are in the page cache (mincore,
        one page per 2 MiB: page-cache folios are up to that large; `MappedFile.resident`)."""
        return all(self._files[t.path].resident(t.offset + e * t.expert_nbytes, t.expert_nbytes,  # type: ignore[index]
                                                PAGE_TABLE_SPAN) for t in self.layers[layer])

    def _views(self, layer: int, out: Sequence[Weight]) -> bool:
        """Whether weights of `layer` are views of its files' mappings (a mapping job's result
        when the slices were in the page cache, else read into buffers)."""
        for t, w in zip(self.layers[layer], out, strict=True):
            f = self._files.get(t.path) if t.path is not None else None
            if f is None or not isinstance(w, QuantizedMatrix) or not f.holds(w.raw.data_ptr()):
                return False
        return True

    def _will_map(self, key: Key) -> bool:
        """`_maps` of a key, asked of mincore once between its plan (or get) and its fetch
        (~0.15 ms a 5.8 MB slice: twice per miss was ~10 ms a token on a K3 slice)."""
        ok = self._map_ok.get(key)
        if ok is None:
            ok = self._map_ok[key] = self._maps(*key)
        return ok

    def _mapped_bytes(self, layer: int, e: int) -> int:
        """What keeping expert e of `layer` mapped may hold in this process's RSS: the page-table
        windows around its slices, not just their bytes (MappedFile.mapped_span). The budget
        counts this for a mapped expert, so mapped pages stay within it."""
        return sum(MappedFile.mapped_span(t.offset + e * t.expert_nbytes, t.expert_nbytes)
                   for t in self.layers[layer])

    def _map(self, layer: int, e: int) -> tuple[Weight, ...]:
        """Expert e of `layer` as views of the mapping, on this thread (`_map_slice`)."""
        tensors: list[Weight] = []
        ledger = self._cache.ledger
        for t in self.layers[layer]:
            t0 = time.perf_counter()
            q, check = self._map_slice(layer, e, t)
            tensors.append(q)
            ledger.io_bytes += t.expert_nbytes
            ledger.read_seconds += time.perf_counter() - t0 - check
            ledger.check_seconds += check
            self._cache.record_read(layer, t.expert_nbytes)
        self._checked.add((layer, e))
        return tuple(tensors)

    def _map_expert(self, layer: int, e: int,
                    stop: threading.Event) -> tuple[tuple[Weight, ...], float, float, int]:
        """Background thread: `_map` of a planned miss, one expert ahead of the caller, so the
        page-table work (~1.5 ms per 17.5 MB K3 expert, GIL released) and the page-cache check
        (mincore, ~0.45 ms) overlap the products of the expert before it. Slices not in the page
        cache are read instead (`_read_expert`, into fresh buffers: the cache's spare ones are
        the caller's). Returns what `_read_expert` does; the ledger is updated by `_collect`."""
        if not self._resident(layer, e):
            buffers = [torch.from_numpy(np.empty(t.expert_nbytes, np.uint8)) for t in self.layers[layer]]
            return self._read_expert(layer, e, buffers, stop)
        t0 = time.perf_counter()
        out: list[QuantizedMatrix] = []
        check, n = 0.0, 0
        for t in self.layers[layer]:
            if stop.is_set():       # dropped: what it mapped is released by `_reap`
                raise _Stopped(0, 0)
            q, c = self._map_slice(layer, e, t)
            out.append(q)
            check += c
            n += t.expert_nbytes
        self._checked.add((layer, e))
        return tuple(out), time.perf_counter() - t0 - check, check, n

    def _map_slice(self, layer: int, e: int, t: ExpertTensor) -> tuple[QuantizedMatrix, float]:
        """Expert e's slice of t as a view of the mapping: its pages mapped in one call
        (POPULATE_READ; the slice is in the page cache, so no read ahead), scales checked the
        first time, nothing copied. Returns (weight, seconds spent checking)."""
        start, n = t.offset + e * t.expert_nbytes, t.expert_nbytes
        f = self._files[t.path]         # type: ignore[index]  # _maps checked it is a file
        f.check()
        if self.slice_readahead:
            t0 = time.thread_time()         # CPU time: page-table work, not waits for the CPU
            f.populate(start, n)
            slow = time.thread_time() - t0 > SMALL_PAGES_S_PER_MIB * n / MIB
            where = ((layer, e), self.layers[layer].index(t))
            if slow and self.huge_pages and where not in self._rehomed:
                self._rehomed.add(where)    # once: a slice another process maps stays as it is
                f.rehome(start, n)
        view = f.view(start, n)
        check = 0.0
        if self.check_scales and t.ggml_type in CHECKED and (layer, e) not in self._checked:
            check = self._check(layer, e, t, view)
        with warnings.catch_warnings():     # read-only bytes: the products only read them
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(view)
        return self._quantized(t, raw), check

    def _unmap_evicted(self) -> None:
        """Drop from this process the pages of evicted views (see map_misses), unless the
        expert was mapped again since (or is being mapped). With read_ahead a background thread
        does it (~0.5 ms of page-table work per 17.5 MB K3 expert, GIL released), else this one."""
        unmapped, self._cache.unmapped = self._cache.unmapped, []
        keys = [k for k in dict.fromkeys(unmapped) if k not in self._cache and k not in self._pending]
        if not (self.release_pages and keys):
            return
        self._releases = [f for f in self._releases if not f.done()]
        if not self.read_ahead:
            self._release_all(keys)
            return
        self._releases.append(self._mapping_thread().submit(self._release_all, keys))

    def _mapping_thread(self) -> ThreadPoolExecutor:
        """The one background thread that maps planned misses and releases evicted views, in
        order: page-table work, one thread's worth at most beside the caller's."""
        if self._mapper is None:
            self._mapper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="k3kit-mapper")
        return self._mapper

    def _release_all(self, keys: list[Key]) -> None:
        for layer, e in keys:
            self.release(layer, e)

    def _settle(self) -> None:
        """Wait for the background releases of evicted views (tests; before files close)."""
        for f in self._releases:
            f.result()
        self._releases = []

    def _load(self, layer: int, e: int) -> tuple[Weight, ...]:
        """Read (and dequantize, unless kept quantized) one expert on this thread."""
        tensors: list[Weight] = []
        ledger = self._cache.ledger
        for t in self.layers[layer]:
            n = t.expert_nbytes
            t0 = time.perf_counter()
            if self._kept_quantized(t):     # read straight into the buffer the cache will hold
                q = self._quantized(t, self._buffer(t, e))
                io_bytes, check = self._read_slice(layer, e, t, q.raw.numpy())
                t1 = time.perf_counter()
                tensors.append(q)
            else:
                raw = self._scratch(n)
                io_bytes, check = self._read_slice(layer, e, t, raw)
                t1 = time.perf_counter()
                w = dequantize(raw, t.ggml_type, t.shape, self.dtype)
                tensors.append(w if self.device.type == "cpu" else w.to(self.device))
            ledger.io_bytes += io_bytes
            ledger.read_seconds += t1 - t0 - check
            ledger.check_seconds += check
            ledger.dequant_seconds += time.perf_counter() - t1
            self._cache.record_read(layer, n)
        return tuple(tensors)

    def _read_slice(self, layer: int, e: int, t: ExpertTensor, out: np.ndarray,
                    background: bool = False) -> tuple[int, float]:
        """Expert e's bytes of projection t into `out`, scale-checked (check_scales) in pieces
        of about CHECK_CHUNK right after each piece is read, while it is still in the CPU's
        cache (checked after the whole copy, the scan is a second pass over DRAM: measured
        here ~1.5 ms per 5.8 MB slice, a third of copying it from the page cache). Returns
        (bytes asked of the OS, seconds spent checking).

        The background readers never copy out of the mapping (madvise and the page-table work
        of the copy would contend with the caller's thread): they pread."""
        start, n = t.offset + e * t.expert_nbytes, t.expert_nbytes
        f = self._files[t.path] if t.path is not None else None
        if f is not None:
            f.check()
        mapped = f if f is not None and f.mm is not None and not background else None
        if mapped is not None and self.slice_readahead:
            mapped.advise_slice(start, n, populate=True)
        uncached = f if f is not None and self.cold and f.direct_fd is None else None
        if uncached is not None:
            uncached.drop(start, n)     # once around the whole slice
        if f is not None and mapped is None and f.direct_fd is None:
            f.willneed(start, n)        # the pieces below then wait for one large read of the slice
        checks = self.check_scales and t.ggml_type in CHECKED
        block = GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)][1]
        # O_DIRECT reads whole aligned spans: pieces would read their shared edge blocks twice
        pieces = checks and (f is None or f.direct_fd is None)
        step = max(block, CHECK_CHUNK // block * block) if pieces else n
        io_bytes, check = 0, 0.0
        for lo in range(0, n, step):
            part = out[lo : lo + step]
            io_bytes += self._fill(t, f, start + lo, part, background)
            if checks:
                check += self._check(layer, e, t, part, lo // block)
        if mapped is not None and self.release_pages:
            mapped.release(start, n)
        if uncached is not None:
            uncached.drop(start, n)
        return io_bytes, check

    def _fill(self, t: ExpertTensor, f: MappedFile | None, offset: int, out: np.ndarray,
              background: bool) -> int:
        """Copy the bytes at `offset` of t's source into `out`; returns the bytes asked of the OS."""
        if f is None:
            out[:] = t.buffer().reshape(-1)[offset : offset + out.nbytes]
            return out.nbytes
        if f.direct_fd is not None:
            placed = self._cache.direct_span(out)
            if placed is not None and placed[1] == offset % DIRECT_ALIGN:
                span, head = placed
                return f.read_direct_span(span, offset - head, head + out.nbytes)
            return f.read_direct(out, offset, self._thread_scratch() if background else self._direct)
        if f.mm is not None and not background:
            out[:] = f.view(offset, out.nbytes)
        else:
            f.pread_into(out, offset)
        return out.nbytes

    def _buffer(self, t: ExpertTensor, e: int) -> torch.Tensor:
        """A cache buffer for expert e's slice of t; for an O_DIRECT file one laid out so that the
        read lands in it in place (`ExpertCache.buffer`): no scratch buffer, no second copy."""
        f = self._files.get(t.path) if t.path is not None else None
        if f is None or f.direct_fd is None:
            return self._cache.buffer(t.expert_nbytes)
        return self._cache.buffer(t.expert_nbytes, (t.offset + e * t.expert_nbytes) % DIRECT_ALIGN)

    def _check(self, layer: int, e: int, t: ExpertTensor, raw: np.ndarray, first_block: int = 0) -> float:
        """Raise CorruptBlockError if a block of `raw` (expert e's slice of t from block
        `first_block` on) has an inf/NaN scale; returns the seconds the check took. A random-
        weight model with one NaN scale still "runs" and prints plausible garbage: this is
        where that becomes a one-line error."""
        t0 = time.perf_counter()
        qtype = GGMLQuantizationType(t.ggml_type)
        elems, block = GGML_QUANT_SIZES[qtype]
        bad = first_nonfinite_block(raw, qtype, raw.nbytes // block * elems)
        if bad is not None:
            where = t.path or "<buffer>"
            raise CorruptBlockError(f"{where}: tensor {t.name or 'experts'} expert {e} (layer {layer}): "
                                    f"{qtype.name} block {first_block + bad} has a non-finite scale; "
                                    "the file is corrupt", qtype, first_block + bad)
        return time.perf_counter() - t0

    def _kept_quantized(self, t: ExpertTensor) -> bool:
        """Whether the cache holds this projection as its bytes (keep="quantized", native type)."""
        return self.keep == "quantized" and t.ggml_type in NATIVE_TYPES

    def _quantized(self, t: ExpertTensor, buf: torch.Tensor) -> QuantizedMatrix:
        return QuantizedMatrix(buf, GGMLQuantizationType(t.ggml_type), (t.shape[0], t.shape[1]), self.dtype,
                               arith=self.arith)

    def _scratch(self, n: int) -> np.ndarray:
        """A private, writable n-byte buffer, reused by every miss: the raw slice lives only
        until it is dequantized, and a fresh multi-MB array per read would be faulted in page
        by page each time (here ~5 ms per 6 MB slice, a tenth of the slice's dequant)."""
        if self._raw is None or self._raw.size < n:
            self._raw = np.empty(n, dtype=np.uint8)
        return self._raw[:n]

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
            f = self._files.get(t.path) if t.path is not None else None
            if f is not None:
                f.release(t.offset + int(expert) * t.expert_nbytes, t.expert_nbytes)

    # -- lifetime -----------------------------------------------------------------------------

    def clear(self) -> None:
        """Drop every cached expert, pinned ones included."""
        self._drain()
        self._cache.clear()

    def close(self) -> None:
        self.clear()
        self._shutdown()
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._direct.close()
        for scratch in self._scratches:
            scratch.close()
        self._scratches = []
        self._raw = None

    def _shutdown(self) -> None:
        """Stop the background threads (idle after `clear`): before files close, so no thread
        touches a mapping that is gone; the next read or mapping starts them anew."""
        for pool in (self._executor, self._mapper):
            if pool is not None:
                pool.shutdown(wait=True)
        self._executor = self._mapper = None

    def __enter__(self) -> ExpertStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
