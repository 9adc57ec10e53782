"""Misses served as views of the file mapping, and the page-table work around them.

In mmap mode with keep="quantized", an expert whose slices are already in the page cache is not
copied anywhere: its `QuantizedMatrix` weights are views of the mapping (`_map`, or one expert
ahead on the mapping thread: `_map_expert`), the budget counts the page-table windows a view may
keep mapped (`_mapped_bytes`), and evicted views are dropped from this process
(`_unmap_evicted`, `release`). See `ExpertStore`'s map_misses, huge_pages and map_ahead. A mixin
of `ExpertStore` over `SliceReads` (a slice not in the page cache is read instead).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from k3kit.gguf.quants.scales import CHECKED
from k3kit.kernels.qmatmul import QuantizedMatrix

from .cache import MIB, Key, Weight
from .io import PAGE_TABLE_SPAN, MappedFile
from .reads import SliceReads, _Stopped
from .tensor import ExpertTensor

MAP_SPAN_LIMIT = 1.5    # map_misses: largest (mapped windows / slice bytes) of an expert served as views
# populate (MADV_POPULATE_READ) CPU seconds per MiB above which a slice's page cache is taken to be in
# 4 KiB pages (measured here: 70-90 us per MiB; in 2 MiB folios under 1 us): see huge_pages
SMALL_PAGES_S_PER_MIB = 1e-5


class MappedMisses(SliceReads):
    """Experts as views of the mapping (mixin of `ExpertStore`, which sets these up)."""

    map_misses: bool
    huge_pages: bool
    map_ahead: bool
    read_ahead: bool
    _rehomed: set[tuple[Key, int]]
    _checked: set[Key]
    _map_ok: dict[Key, bool]
    _pending: dict[Key, Future]
    _releases: list[Future]
    _mapper: ThreadPoolExecutor | None

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
            if f is None or f.mm is None or not self._kept_quantized(t, layer):
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
