"""The expert cache: a bounded LRU of loaded experts and the byte ledger.

The budget is in bytes of what the cache holds (dequantized tensors, or the quantized bytes
of `QuantizedMatrix` weights), pinned experts included; an expert larger than the whole
budget is returned to its caller but never kept. Evicted quantized buffers are kept (up to
MAX_SPARE per size) for the next miss to read into: at steady state every miss evicts an
expert of the same size, so misses stop paying the page faults of a fresh allocation. Until
then, multi-MB buffers come faulted in ahead from a `Grower` (k3kit.runtime.experts.grow).

The ledger (`ExpertStats`) is where "payload per token" comes from: the store records every
hit, miss and byte read here, the cache records its evictions, and `stats()` is a snapshot.
Nothing here touches files (k3kit.runtime.experts.io) or knows what an expert is made of.
"""

from __future__ import annotations

import sys
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from k3kit.kernels.gpu import TritonMatrix
from k3kit.kernels.qmatmul import QuantizedMatrix

from .grow import MIN_BYTES as GROW_MIN_BYTES
from .grow import Grower, spare_core
from .io import DIRECT_ALIGN

MIB = 1 << 20
MAX_SPARE = 4   # evicted quantized buffers kept per size for reuse (one expert's projections)

Weight = torch.Tensor | QuantizedMatrix | TritonMatrix
Key = tuple[int, int]    # (layer, expert)


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
    check_seconds: float = 0.0  # scale finiteness checks of misses (part of neither above)
    wait_seconds: float = 0.0  # caller's time blocked on background reads it needed
    ahead_reads: int = 0  # misses served by a background read (planned or prefetched)
    prefetched: int = 0  # experts read because of a prefetch hint (next layer, predicted)
    prefetch_used: int = 0  # ... of which a later fetch used
    wasted_bytes: int = 0  # read ahead, dropped unused (in io_bytes, not in bytes_read)
    resident_bytes: int = 0  # bytes held by the cache, as held (pinned included)
    resident_experts: int = 0
    pinned_bytes: int = 0
    per_layer: dict[int, LayerStats] = field(default_factory=dict)
    guesses: int = 0  # experts named by prefetch hints whose layer was then planned (read or not)
    guesses_right: int = 0  # ... of which the plan had: the guess precision, free of read timing


@dataclass
class _Entry:
    tensors: tuple[Weight, ...]
    nbytes: int
    pinned: bool = False


class ExpertCache:
    """LRU of experts by (layer, expert), bounded by `budget` bytes, with the ledger."""

    def __init__(self, budget: int, grow: bool = True) -> None:
        self.budget = budget
        self.ledger = ExpertStats()     # counters only; resident_* are filled in by stats()
        self._entries: OrderedDict[Key, _Entry] = OrderedDict()
        self._resident = 0
        self._pinned = 0
        self.in_flight = 0     # bytes of background reads the store holds: they count against the budget
        self.protect: set[Key] = set()   # planned experts not fetched yet: not evicted to make room
        # experts held as views of a file mapping (nothing to reuse); evicted ones wait in
        # `unmapped` for the store to drop their pages from this process
        self.mapped: set[Key] = set()
        self.unmapped: list[Key] = []
        self._spare: dict[int, list[torch.Tensor]] = {}   # byte buffers of evicted quantized experts
        # allocations of the buffers made for in-place O_DIRECT reads, by the buffer's address
        # (weak: an entry lives as long as the buffer, which holds its allocation)
        self._direct: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()
        # fresh buffers faulted in ahead while the cache fills (k3kit.runtime.experts.grow)
        self.grower: Grower | None = Grower(self.room) if grow else None

    def room(self) -> int:
        """Bytes the cache may still take: the budget minus what it holds and has in flight."""
        return self.budget - self._resident - self.in_flight

    # -- the ledger -------------------------------------------------------------------------

    def layer(self, layer: int) -> LayerStats:
        return self.ledger.per_layer.setdefault(layer, LayerStats())

    def record_hit(self, layer: int) -> None:
        self.ledger.hits += 1
        self.layer(layer).hits += 1

    def record_miss(self, layer: int) -> None:
        self.ledger.misses += 1
        self.layer(layer).misses += 1

    def record_read(self, layer: int, nbytes: int) -> None:
        """Payload bytes of a miss (the exact quantized slice), per layer and in total."""
        self.ledger.bytes_read += nbytes
        self.layer(layer).bytes_read += nbytes

    def stats(self) -> ExpertStats:
        s = self.ledger
        return ExpertStats(
            s.hits, s.misses, s.bytes_read, s.io_bytes, s.evictions, s.evicted_bytes, s.read_seconds,
            s.dequant_seconds, s.check_seconds, s.wait_seconds, s.ahead_reads, s.prefetched,
            s.prefetch_used, s.wasted_bytes, self._resident, len(self._entries), self._pinned,
            {k: LayerStats(v.hits, v.misses, v.bytes_read) for k, v in s.per_layer.items()},
            s.guesses, s.guesses_right,
        )

    def reset_stats(self) -> None:
        self.ledger = ExpertStats()

    # -- contents -----------------------------------------------------------------------------

    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    def count(self, layer: int) -> int:
        return sum(1 for k in self._entries if k[0] == layer)

    def lookup(self, key: Key) -> tuple[Weight, ...] | None:
        """The cached weights (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry.tensors

    def admit(self, key: Key, tensors: tuple[Weight, ...], nbytes: int | None = None) -> None:
        """Keep a freshly loaded expert if it fits the budget at all, evicting the least recent.
        `nbytes`: what holding it costs, if not its tensors' bytes (a view of a mapping: the
        pages a fault may map around it)."""
        nbytes = sum(w.nbytes for w in tensors) if nbytes is None else nbytes
        if 0 < nbytes <= self.budget:
            self._entries[key] = _Entry(tensors, nbytes)
            self._resident += nbytes
            self.evict()

    def pin(self, key: Key, tensors: tuple[Weight, ...]) -> None:
        """Keep this expert regardless of the budget (it still counts against it)."""
        entry = self._entries.get(key)
        if entry is None:  # not admitted (budget 0 or smaller than the expert)
            entry = _Entry(tensors, sum(t.nbytes for t in tensors))
            self._entries[key] = entry
            self._resident += entry.nbytes
        if not entry.pinned:
            entry.pinned = True
            self._pinned += entry.nbytes

    def keys(self, layer: int) -> list[Key]:
        return [k for k in self._entries if k[0] == layer]

    def unpin(self, keys: Iterable[Key]) -> None:
        """Make pinned experts evictable again (they stay cached until evicted)."""
        for k in keys:
            entry = self._entries.get(k)
            if entry is not None and entry.pinned:
                entry.pinned = False
                self._pinned -= entry.nbytes

    def evict(self, extra: int = 0) -> bool:
        """Drop least recently used experts (never pinned or protected ones) until what is held,
        background reads in flight included, plus `extra` bytes fits the budget. Returns
        whether it does."""
        if self._resident + self.in_flight + extra <= self.budget:
            return True
        if self.grower is not None:
            self.grower.full()
        for key in list(self._entries):
            if self._resident + self.in_flight + extra <= self.budget:
                break
            entry = self._entries[key]
            if entry.pinned or key in self.protect:
                continue
            self._drop(key)
        return self._resident + self.in_flight + extra <= self.budget

    def evict_planned(self, keys: Iterable[Key], extra: int = 0) -> list[Key]:
        """Make room for `extra` bytes among protected experts too, in the order of `keys` (the
        plan's, latest use first): when every cached expert is planned, the job mapping the next
        miss has to take one's place. Returns the keys dropped (misses again)."""
        dropped = []
        for key in keys:
            if self._resident + self.in_flight + extra <= self.budget:
                break
            entry = self._entries.get(key)
            if entry is not None and not entry.pinned:
                self._drop(key)
                dropped.append(key)
        return dropped

    def _drop(self, key: Key) -> None:
        entry = self._entries.pop(key)
        if key in self.mapped:
            self.mapped.discard(key)
            self.unmapped.append(key)
            entry = _Entry((), entry.nbytes)   # no buffers of ours to reuse
        for w in entry.tensors:
            if isinstance(w, QuantizedMatrix):
                spare = self._spare.setdefault(w.nbytes, [])
                if len(spare) < MAX_SPARE:
                    spare.append(w.raw)
        self._resident -= entry.nbytes
        self.ledger.evictions += 1
        self.ledger.evicted_bytes += entry.nbytes

    def buffer(self, n: int, misalign: int | None = None) -> torch.Tensor:
        """An n-byte tensor for a quantized miss: the bytes of an evicted expert nobody holds any
        more, else a fresh one. At steady state every miss evicts an expert of the same size, so
        misses stop paying the page faults of a fresh multi-MB allocation (measured here: the
        fault-in of a fresh 5.8 MB buffer cost more than copying the slice into it). While the
        cache fills, a multi-MB miss takes a buffer the grower faulted in ahead, else the least
        recently used expert's (`_recycle_one`): the cache grows at the pace the grower's thread
        faults memory in, and no miss waits for fresh pages.

        `misalign` (an O_DIRECT read of a slice at file offset o: o % DIRECT_ALIGN): the buffer
        then starts that many bytes into a page of its own allocation, which also holds the
        rest of the aligned span around it, so the read lands in place (`direct_span`) instead
        of in a scratch buffer copied from."""
        buf = self._spare_buffer(n, misalign)
        if buf is not None:
            return buf
        grower = self.grower if self.grower is not None and n >= GROW_MIN_BYTES and spare_core() else None
        ready = grower.take(n) if grower is not None else None
        if ready is None and grower is not None and not grower.filled and self._recycle_one(n):
            buf = self._spare_buffer(n, misalign)
            if buf is not None:
                return buf
        if misalign is None:
            if ready is not None:
                return torch.from_numpy(ready[:n])
            return torch.from_numpy(np.empty(n, dtype=np.uint8))   # faults in faster than torch.empty here
        span = -(-(misalign + n) // DIRECT_ALIGN) * DIRECT_ALIGN
        base = ready if ready is not None else np.empty(span + DIRECT_ALIGN, dtype=np.uint8)
        start = -base.ctypes.data % DIRECT_ALIGN + misalign
        view = base[start:start + n]
        self._direct[view.ctypes.data] = base
        return torch.from_numpy(view)

    def _spare_buffer(self, n: int, misalign: int | None) -> torch.Tensor | None:
        spare = self._spare.get(n, [])
        for i in range(len(spare) - 1, -1, -1):
            buf = spare[i]
            if misalign is not None and (buf.data_ptr() % DIRECT_ALIGN != misalign
                                         or buf.data_ptr() not in self._direct):
                continue
            del spare[i]
            if sys.getrefcount(buf) <= 2:   # this name and the call's argument: no one else holds it
                return buf
        return None

    def _recycle_one(self, n: int) -> bool:
        """While the cache fills and nothing faulted in ahead is ready: evict the least recently
        used expert that holds an n-byte buffer, for the miss to reuse, instead of taking fresh
        memory on the miss's path (the grower's buffers make the cache grow meanwhile). The
        trade: an expert that might have been hit again, against a first touch that costs more
        than the read on lazily backed VMs (k3kit.runtime.experts.grow). Whether one was evicted."""
        for key, entry in self._entries.items():
            if entry.pinned or key in self.protect or key in self.mapped:
                continue
            if any(isinstance(w, QuantizedMatrix) and w.nbytes == n for w in entry.tensors):
                self._drop(key)
                return True
        return False

    def direct_span(self, out: np.ndarray) -> tuple[memoryview, int] | None:
        """(the aligned span around `out`, `out`'s offset in it) if `out` is (the start of) a
        buffer made by `buffer(n, misalign)`, else None. Writing the span outside `out` is safe:
        that memory belongs to `out`'s allocation and to nothing else."""
        ptr = out.ctypes.data
        base = self._direct.get(ptr)
        if base is None:
            return None
        head = ptr % DIRECT_ALIGN
        lo = ptr - head - base.ctypes.data
        span = -(-(head + out.nbytes) // DIRECT_ALIGN) * DIRECT_ALIGN
        if lo < 0 or lo + span > base.nbytes:
            return None
        return base.data[lo:lo + span], head

    def clear(self) -> None:
        """Drop every cached expert, pinned ones included (the ledger's counters stay)."""
        self._entries.clear()
        self._spare.clear()
        if self.grower is not None:
            self.grower.reset()
        self.unmapped.extend(self.mapped)
        self.mapped.clear()
        self._resident = self._pinned = 0
