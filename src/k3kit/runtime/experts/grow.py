"""Memory for an expert cache that is still filling, faulted in before the misses that need it.

A miss reads an expert into a buffer. Once the cache is full every miss reuses the buffer of
the expert it evicts (ExpertCache.buffer); until then each miss takes fresh memory, and the
kernel zeroes a fresh page at its first write, which the read filling the buffer waits for. On
virtual machines whose host backs guest memory lazily that first touch is slower than the
disk: 0.45-0.6 GB/s on the 2-vCPU Xeon (7 GB/s for pages freed a moment before), so a cache
sized from free RAM (16 GiB) decoded a 36 GB file at 0.91 tok/s while it filled, against 1.51
with a 1 GiB cache that recycled its buffers from the second token on; 61% of the run was
`clear_page_erms` under the O_DIRECT reads' `get_user_pages`.

`Grower` faults the next buffers in on a thread of its own, with calls that release the GIL
(MADV_POPULATE_WRITE, else a memset), so the zeroing runs beside the reads and products instead
of in front of them. It keeps at most `pool_bytes` ready, never more than the cache's budget
has room for, and stops when the cache is full (buffers are then recycled). The cache uses it
for buffers of MIN_BYTES and more, and only while a CPU is left over by torch's threads
(`spare_core`): on a busy core the faulting would take the products' time instead. Nothing here
knows what an expert is; the cache tells it the room it has and asks for buffers by size.

Measured (Xeon, 36 GB file, 1 thread, 96 tokens; `benchmarks/bench_cache_fill.py`): the default
load decoded its first 16 tokens at 1.69 tok/s instead of 0.97, 1.81 instead of 1.40 overall.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import threading
import time
from collections.abc import Callable

import numpy as np

from k3kit.kernels import threads as kthreads

from .io import DIRECT_ALIGN, PAGE, _madvise

MIB = 1 << 20
POOL_BYTES = 256 * MIB      # ready buffers kept at most (about half a K3 token's expert payload)
MADV_POPULATE_WRITE = 23    # Linux 5.14+; EINVAL before
MIN_BYTES = 1 * MIB         # smaller buffers fault in quickly enough on the miss's path (the mini's: 13 KB)
IDLE_S = 5.0                # no buffer asked for this long: drop the ready ones, grow no more until asked


def span(n: int) -> int:
    """Bytes of a buffer that can hold n bytes starting at any offset mod DIRECT_ALIGN inside its
    own aligned span (ExpertCache.buffer's in-place O_DIRECT layout), whatever the allocator's
    alignment of the array itself."""
    return -(-n // DIRECT_ALIGN) * DIRECT_ALIGN + 2 * DIRECT_ALIGN


_populate_write: bool | None = None     # None: not tried yet


def fault_in(a: np.ndarray) -> None:
    """Make every page of `a` resident and writable now, with the GIL released: MADV_POPULATE_WRITE
    over its whole pages (the kernel zeroes them, nothing is written twice), else a memset."""
    global _populate_write
    if a.nbytes == 0:
        return
    ptr = a.ctypes.data
    lo, hi = -(-ptr // PAGE) * PAGE, (ptr + a.nbytes) // PAGE * PAGE
    fn = _madvise() if _populate_write is not False else None
    if fn is not None and hi > lo:
        if fn(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_POPULATE_WRITE) == 0:
            _populate_write = True
            ctypes.memset(ptr, 0, lo - ptr)                     # the partial pages at the edges
            ctypes.memset(hi, 0, ptr + a.nbytes - hi)
            return
        if ctypes.get_errno() == errno.EINVAL:
            _populate_write = False
    ctypes.memset(ptr, 0, a.nbytes)


def spare_core() -> bool:
    """Whether a CPU this process may run on is left over by torch's compute threads: faulting
    ahead only pays on a core of its own (on a busy one it takes the products' time, and the
    cache, growing only as fast as the grower, would fill later than by faulting on the misses)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return kthreads.native() < cpus


def anonymous(n: int) -> np.ndarray:
    """n bytes of their own anonymous mapping (page aligned, in 2 MiB pages where the kernel
    allows), unmapped when the last array over them goes: a buffer the cache drops goes back to
    the system instead of staying in the grower thread's malloc arena, where the main thread's
    allocations would never reuse it."""
    mm = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)   # not shared: no shmem file
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            mm.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(mm, dtype=np.uint8)


class Grower:
    """Buffers of the sizes a cache asked for, faulted in ahead on a daemon thread.

    `room()`: bytes the cache may still take (its budget minus what it holds and has in
    flight); read without a lock, so it may be a moment stale: the pool is bounded by
    `pool_bytes` besides, and emptied when no buffer was asked for in IDLE_S seconds (every
    expert loaded, or the model idle). `take(n)` returns a ready uint8 array of `span(n)` bytes, or None
    (the caller allocates as before); asking for a size makes the thread grow that size from then
    on, round robin with the others asked for."""

    def __init__(self, room: Callable[[], int], pool_bytes: int = POOL_BYTES) -> None:
        self._room = room
        self.pool_bytes = pool_bytes
        self._ready: dict[int, list[np.ndarray]] = {}
        self._sizes: list[int] = []
        self._next = 0
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        self.filled = False       # the cache has been full since the last reset
        self.ready_bytes = 0
        self._asked = time.monotonic()    # the last take()
        self.taken = 0            # buffers handed out
        self.taken_bytes = 0
        self.faulted_bytes = 0    # bytes the thread faulted in (taken, ready or dropped)

    def take(self, n: int) -> np.ndarray | None:
        with self._cv:
            self._asked = time.monotonic()
            if n not in self._sizes:
                self._sizes.append(n)
            ready = self._ready.get(n)
            buf = ready.pop() if ready else None
            if buf is not None:
                self.ready_bytes -= buf.nbytes
                self.taken += 1
                self.taken_bytes += buf.nbytes
            if not self.filled:
                self._start()
                self._cv.notify()
        return buf

    def wake(self) -> None:
        """The cache's room changed (it shrank: ready buffers beyond it are dropped; it grew): look
        again now rather than at the next poll."""
        with self._cv:
            self._cv.notify()

    def full(self) -> None:
        """The cache reached its budget (it evicted to make room): misses recycle evicted buffers
        from now on, so stop growing and drop what is ready. `reset` starts over."""
        with self._cv:
            self.filled = True
            self._ready.clear()
            self.ready_bytes = 0

    def reset(self) -> None:
        """The cache emptied or its budget grew: it is filling again."""
        with self._cv:
            self.filled = False
            self._cv.notify()

    def close(self) -> None:
        """Stop the thread and drop the ready buffers; a later `take` starts it again."""
        with self._cv:
            self._stop = True
            self._cv.notify()
            thread = self._thread
        if thread is not None:
            thread.join()
        with self._cv:
            self._thread = None
            self._stop = False
            self._ready.clear()
            self.ready_bytes = 0

    def _start(self) -> None:
        if self._thread is None and not self._stop:
            self._thread = threading.Thread(target=self._run, name="k3kit-expert-grow", daemon=True)
            self._thread.start()

    def _wanted(self) -> int:
        """The next size to fault in, or 0 when the pool is full or the cache has no room for it.
        Ready buffers the cache no longer has room for are dropped (the budget shrank, or the
        cache filled by other means)."""
        if self.filled or time.monotonic() - self._asked > IDLE_S:
            self._ready.clear()       # a full cache recycles; an idle one (everything loaded) needs none
            self.ready_bytes = 0
            return 0
        room = self._room() - self.ready_bytes
        while room < 0 and self.ready_bytes:
            for ready in self._ready.values():
                if ready:
                    room += ready[-1].nbytes
                    self.ready_bytes -= ready.pop().nbytes
                    break
        if not self._sizes or self.ready_bytes >= self.pool_bytes:
            return 0
        n = span(self._sizes[self._next % len(self._sizes)])
        return n if n <= room else 0

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not (n := self._wanted()):
                    self._cv.wait(timeout=1.0)
                if self._stop:
                    return
                size = self._sizes[self._next % len(self._sizes)]
                self._next += 1
            buf = anonymous(n)
            fault_in(buf)
            with self._cv:
                self.faulted_bytes += n
                if self._stop:
                    return
                if self.filled:
                    continue
                self._ready.setdefault(size, []).append(buf)
                self.ready_bytes += n
