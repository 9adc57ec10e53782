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

The store is assembled from parts, one concern each: a file and the ways to read it
(`io.MappedFile`), what is kept and counted (`cache.ExpertCache`), how a miss's bytes reach a
buffer (`reads.SliceReads`), misses served as views of the mapping (`mapped.MappedMisses`) and
background reads of planned and guessed experts (`ahead.ReadAhead`). This module holds the
constructor, the queries and `get`, where they meet. It knows nothing about architectures: it
is given, per layer, a tuple of `ExpertTensor` descriptions (e.g. gate, up, down) and returns
weights in that order.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from gguf import GGMLQuantizationType

from k3kit.errors import FormatError
from k3kit.kernels import gpu
from k3kit.kernels.dequant import SUPPORTED, block_size

from .ahead import PRECISION_WARMUP, PREFETCH_PRECISION, ReadAhead
from .cache import MIB, ExpertCache, ExpertStats, Key, Weight
from .io import PAGE_TABLE_SPAN, AlignedScratch, MappedFile
from .mapped import MAP_SPAN_LIMIT, SMALL_PAGES_S_PER_MIB
from .reads import CHECK_CHUNK, _Stopped
from .tensor import ByteBuffer, ExpertTensor

if TYPE_CHECKING:
    from k3kit.gguf.shards import Model

# the names the store's parts define, importable from here as before the split
__all__ = ["CHECK_CHUNK", "MAP_SPAN_LIMIT", "PRECISION_WARMUP", "PREFETCH_PRECISION", "SMALL_PAGES_S_PER_MIB",
           "ByteBuffer", "ExpertStats", "ExpertStore", "ExpertTensor", "_Stopped"]


class ExpertStore(ReadAhead):
    """Lazy, cached, ledgered access to routed expert weights.

    layers: {layer index: (ExpertTensor, ...)} in the order `get` returns tensors
            (e.g. gate, up, down); all projections of a layer share n_experts.
    cache_mib: LRU budget in MiB of what the cache holds; 0 keeps nothing beyond the
            batch being returned. Pinned experts are never evicted (and still count).
    keep: "dequantized" (torch tensors in `dtype`) or "quantized": projections of a type
            with a native kernel (MXFP4) stay as their bytes, copied out of the file into a
            `QuantizedMatrix` (CPU only); other types are still dequantized. "triton": the
            bytes of a type the GPU kernels decode, copied to `device` as a
            `kernels.gpu.TritonMatrix` (VRAM holds the file's bytes, not a 16-bit copy; the
            MoE runs a layer's routed rows through one grouped kernel per projection).
    cpu_layers, cpu_keep: with `device` a GPU, the layers whose experts stay on the CPU and how
            they are cached there (llama.cpp's --cpu-moe and --n-cpu-moe: the trunk in VRAM,
            those experts in RAM multiplied by the native kernels); `device_of(layer)` says
            where a layer's experts are. A loader names them only when `device` is not the CPU
            (on the CPU every layer's experts are there already and `keep` holds for all).
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
        cpu_layers: Collection[int] = (),
        cpu_keep: str = "quantized",
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
        for name, mode in (("keep", keep), ("cpu_keep", cpu_keep)):
            if mode not in ("dequantized", "quantized", "triton"):
                raise ValueError(f"{name} must be 'dequantized', 'quantized' or 'triton', not {mode!r}")
        if keep == "quantized" and torch.device(device).type != "cpu":
            raise ValueError("keep='quantized' runs on the CPU only")
        if keep == "triton" and not gpu.available(device):
            raise ValueError(f"keep='triton' needs the Triton kernels on {device} (CUDA, or the CPU under "
                             "TRITON_INTERPRET=1)")
        if cpu_keep == "triton":
            raise ValueError("cpu_keep='triton': the CPU layers' experts are 'quantized' or 'dequantized'")
        self.keep = keep
        self.cpu_layers = frozenset(int(x) for x in cpu_layers)     # on the CPU as `cpu_keep` says
        self.cpu_keep = cpu_keep
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
                    if (self.huge_pages and self.map_misses and self._kept_quantized(t, layer)
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

    def cached_expert_nbytes(self, layer: int) -> int:
        """Bytes one expert of `layer` occupies in the cache (what `cache_mib` budgets): its
        quantized bytes for projections kept quantized, dequantized tensors for the rest."""
        item = torch.empty(0, dtype=self.dtype).element_size()
        return sum(t.expert_nbytes if self._kept_quantized(t, layer) or self._kept_triton(t, layer)
                   else int(np.prod(t.shape)) * item for t in self.layers[layer])

    @property
    def cache_bytes(self) -> int:
        """The LRU budget in bytes (settable: a new budget applies from the next miss)."""
        return self._cache.budget

    @cache_bytes.setter
    def cache_bytes(self, n: int) -> None:
        grows = int(n) > self._cache.budget
        self._cache.budget = int(n)
        if grows and self._cache.grower is not None:
            self._cache.grower.reset()      # room again: it fills

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

    def get_resident(self, layer: int, expert_ids: Sequence[int]) -> list[tuple[Weight, ...]] | None:
        """`plan(layer, expert_ids)` then `get(layer, expert_ids)` in one step, for a decode step
        whose experts are all cached: the weights in the order of `expert_ids` (distinct,
        ascending, as `get` returns them), with the same bookkeeping (the hits counted, the
        cache's recency, the plan's state). None, and nothing done, unless every one is cached
        and nothing is read, queued, guessed for this layer, orphaned or waiting to be unmapped:
        there the plan and the fetches have work of their own."""
        if self._pending or self._queue or self._orphans or layer in self._guess or self._cache.unmapped:
            return None
        cache = self._cache
        keys = [(layer, int(e)) for e in expert_ids]
        for key in keys:
            if key not in cache:
                return None
        if self._reads_ahead(layer):       # what plan leaves when every key is cached
            self._planned = set(keys)
            self._plan_order = keys
            self._plan_rank = {k: i for i, k in enumerate(keys)}
            cache.protect = set()           # planned keys are protected until fetched: all are
            self._predicted.clear()
            self._map_ok = {}
            self._map_jobs = set()
        else:
            cache.protect.difference_update(keys)
        out = []
        for key in keys:
            weights = cache.lookup(key)
            assert weights is not None
            out.append(weights)
        cache.ledger.hits += len(keys)
        cache.layer(layer).hits += len(keys)
        return out

    def load_all_if_fits(self) -> bool:
        """Read every expert into the cache when all of them fit its budget (a model smaller than
        its cache: the mini, a small slice), so the first request pays no misses and takes the
        resident paths; a larger model is left to fill as it runs. -> whether they were read."""
        total = sum(self.n_experts(layer) * self.cached_expert_nbytes(layer) for layer in self.layers)
        if total > self.cache_bytes:
            return False
        for layer in self.layers:
            self.get(layer, range(self.n_experts(layer)))
        return True

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

    # -- lifetime -----------------------------------------------------------------------------

    def clear(self) -> None:
        """Drop every cached expert, pinned ones included."""
        self._drain()
        self._cache.clear()

    def close(self) -> None:
        self.clear()
        self._shutdown()
        if self._cache.grower is not None:
            self._cache.grower.close()
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
