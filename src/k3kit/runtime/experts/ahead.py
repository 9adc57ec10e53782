"""Reading ahead: planned misses and prefetch guesses read by background threads.

`plan(layer, ids)` queues the misses a layer is about to fetch, `prefetch(layer, ids)` the
experts a later layer will probably want; `read_threads` readers (or the mapping thread, for
experts served as views) work through the queue while the caller computes, within the read-ahead
limit and the cache budget. A guess the plan does not confirm is dropped (and stops after its
current slice); each guess is scored, and guesses are read only while enough are right
(`prefetch_precision`). What a background read delivers enters the ledger when it is collected
(`_collect`) or, unused, as wasted bytes (`_reap`). A mixin of `ExpertStore`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from .cache import Key, Weight
from .mapped import MappedMisses
from .reads import _Stopped

PRECISION_WARMUP = 64   # scored guesses before prefetch_precision may turn prefetch reads off
# Guesses read only while at least this share is right. On the 52 GB random-weight K3 file the
# next-layer guess is right 39% of the time (137 of 348) and prefetch cost 12-23% of decode speed
# whenever the disk was not throttled (3 of 3 pairs); on the trained mini it is right 79%.
PREFETCH_PRECISION = 0.5


class ReadAhead(MappedMisses):
    """Background reads of planned and guessed experts (mixin of `ExpertStore`, which sets these up)."""

    read_ahead_bytes: int
    read_threads: int
    prefetch_precision: float
    _guess: dict[int, set[int]]
    _queue: list[Key]
    _orphans: list[tuple[Key, Future, int, bool]]
    _reserved: dict[Key, int]
    _map_jobs: set[Key]
    _plan_order: list[Key]
    _plan_rank: dict[Key, int]
    _stops: dict[Key, threading.Event]
    _planned: set[Key]
    _predicted: set[Key]
    _executor: ThreadPoolExecutor | None

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
            self._kept_quantized(t, layer) and t.is_file for t in self.layers[layer])

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
