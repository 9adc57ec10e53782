"""The file side of reading model weights: one open file, its mapping and the ways to read it.

Both readers of a model file use this: the loader's `GGUFSource` (trunk tensors, read once
through the mapping) and the `ExpertStore` (expert slices, read on every cache miss). What
they share is here, once:

* a `MappedFile` remembers size and mtime at open, so a file changed or truncated under a
  mapping is a FormatError naming it instead of a SIGBUS or garbage;
* the mapping is plain mmap (Python never passes MAP_POPULATE): nothing is read until a
  slice is touched. `advise_random`, `advise_slice` (WILLNEED + POPULATE_READ on exactly a
  slice), `populate` (POPULATE_READ with the GIL released), `advise_huge` / `rehome` (the page
  cache of a range in 2 MiB folios) and `release` (MADV_DONTNEED: unmapped from this process,
  kept in the page cache) steer what the kernel reads and what stays in our resident set;
* `pread_into` copies a slice with the GIL released and maps nothing; `read_uncached` and
  `read_direct` read around the page cache (POSIX_FADV_DONTNEED, O_DIRECT) so that bytes
  counted as read are bytes that came from storage; `read_direct_span` is O_DIRECT into a
  caller's aligned buffer (the device writes the bytes where they will be used: no copy).

Nothing here counts bytes: the caller's ledger does (k3kit.runtime.experts.cache).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import mmap
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from k3kit.errors import FormatError

PAGE = mmap.PAGESIZE
PAGE_TABLE_SPAN = max(PAGE, 1 << 21)  # bytes one x86-64/arm64 (4 KiB page) page table maps
DIRECT_ALIGN = 4096  # O_DIRECT offset/length/buffer alignment that every common block device accepts
# Linux 5.14+: fault a range in with one call instead of one fault per page (not in Python 3.11's mmap).
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if sys.platform == "linux" else None)


class MappedFile:
    """An open model file: fd, optional whole-file mapping and O_DIRECT fd, what it looked like at open."""

    def __init__(self, path: str | os.PathLike, use_mmap: bool = True, direct: bool = False) -> None:
        self.path = Path(path)
        try:
            self.fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise FormatError(f"{self.path}: cannot open: {e.strerror}") from None
        st = os.fstat(self.fd)
        self.size, self.mtime_ns = st.st_size, st.st_mtime_ns
        # Python's mmap never passes MAP_POPULATE: nothing is read until a slice is touched.
        self.mm = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ) if use_mmap and self.size else None
        self._addr = 0          # the mapping's address, for mincore (`resident`)
        if self.mm is not None:
            first = np.frombuffer(self.mm, np.uint8, 1)
            self._addr = first.ctypes.data
            del first           # an exported buffer would keep mm.close() from closing
        self._vec: np.ndarray | None = None
        self.direct_fd: int | None = None
        if direct:
            try:
                self.direct_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
            except (OSError, AttributeError):
                self.direct_fd = None  # e.g. tmpfs: the caller falls back to fadvise

    def check(self, by_path: bool = False) -> None:
        """Raise if the file was changed or truncated since open (a mapping would SIGBUS).

        The open file (fstat) is what a read touches; by_path also catches a file replaced at
        its path while we hold the old one (what a model loaded from `path` now is).
        """
        st = os.stat(self.path) if by_path else os.fstat(self.fd)
        if st.st_size == self.size and st.st_mtime_ns == self.mtime_ns:
            return
        if by_path:
            raise FormatError(f"{self.path}: file changed while the model was loaded "
                              f"(size {self.size} -> {st.st_size})")
        raise FormatError(
            f"{self.path}: file changed since it was opened (size {self.size} -> {st.st_size}, "
            f"mtime {self.mtime_ns} -> {st.st_mtime_ns})"
        )

    # -- the mapping --------------------------------------------------------------------------

    def view(self, start: int, n: int) -> np.ndarray:
        """The n mapped bytes at `start`, zero-copy (pages fault in as they are touched)."""
        assert self.mm is not None, "file opened without a mapping"
        return np.frombuffer(self.mm, np.uint8, n, start)

    def holds(self, ptr: int) -> bool:
        """Whether address `ptr` lies in this file's mapping (a view of it, not a copy)."""
        return self.mm is not None and self._addr <= ptr < self._addr + self.size

    def resident(self, start: int, n: int, sample: int = 0) -> bool:
        """Whether every page of bytes [start, start + n) is in the page cache (mincore(2) on
        the mapping: it reports the file's cached pages, mapped into this process or not).
        False without a mapping or where mincore is unavailable.

        sample > 0: only one page every `sample` bytes and the last one (mincore asks the page
        cache page by page, ~0.13 ms for a 5.8 MB slice; a few single pages cost ~10 us). A
        slice cached in part then passes: touching it reads the rest."""
        fn = _mincore()
        if self.mm is None or fn is None or n <= 0:
            return False
        if sample > 0:
            one = np.empty(1, np.uint8)
            ptr = one.ctypes.data_as(ctypes.c_void_p)
            for at in [*range(start, start + n, sample), start + n - 1]:
                page = ctypes.c_void_p(self._addr + at // PAGE * PAGE)
                if fn(page, ctypes.c_size_t(PAGE), ptr) or not one[0] & 1:
                    return False
            return True
        lo = start // PAGE * PAGE
        pages = -(-(start + n - lo) // PAGE)
        if self._vec is None or self._vec.size < pages:
            self._vec = np.empty(pages, np.uint8)
        vec = self._vec[:pages]
        if fn(ctypes.c_void_p(self._addr + lo), ctypes.c_size_t(pages * PAGE),
              vec.ctypes.data_as(ctypes.c_void_p)):
            return False
        return bool(np.bitwise_and(vec, 1).all())

    def advise_random(self, start: int, n: int) -> None:
        """MADV_RANDOM on a range: a fault there does not read ahead into its neighbours."""
        if self.mm is not None and hasattr(mmap, "MADV_RANDOM"):
            lo = start // PAGE * PAGE
            self.mm.madvise(mmap.MADV_RANDOM, lo, start + n - lo)

    def advise_slice(self, start: int, n: int, populate: bool) -> None:
        """WILLNEED (asynchronous read of the slice), then optionally POPULATE_READ (wait for it
        and map it in one call). MADV_RANDOM alone turns a cold multi-MB slice into one 4 KiB
        read per page fault; this asks for the slice in large requests without reading a byte
        outside it. No-op without a mapping."""
        global MADV_POPULATE_READ
        if self.mm is None:
            return
        lo = start // PAGE * PAGE
        try:
            self.mm.madvise(mmap.MADV_WILLNEED, lo, start + n - lo)
        except OSError:  # advice only; a changed file is reported by the read that follows
            return
        if populate and MADV_POPULATE_READ is not None:
            try:
                self.mm.madvise(MADV_POPULATE_READ, lo, start + n - lo)
            except OSError:  # kernel older than 5.14: the copy faults the pages in
                MADV_POPULATE_READ = None

    def populate(self, start: int, n: int) -> bool:
        """Map bytes [start, start + n) into this process in one call (MADV_POPULATE_READ),
        with the GIL released, so a background thread can do it while the caller computes.

        Why not touch them: measured on a 17.5 MB K3 expert in the page cache, faulting its
        pages in costs ~1.2 ms (one fault-around trap per 64 KiB), populating ~1.1-1.5 ms: the
        same work, but on whichever thread asks, so it can leave the caller's. Returns False
        where it is unavailable (no mapping, kernel older than 5.14): touching maps the pages."""
        global MADV_POPULATE_READ
        fn = _madvise()
        if self.mm is None or fn is None or MADV_POPULATE_READ is None or n <= 0:
            return False
        lo = start // PAGE * PAGE
        if fn(ctypes.c_void_p(self._addr + lo), ctypes.c_size_t(start + n - lo), MADV_POPULATE_READ):
            if ctypes.get_errno() == errno.EINVAL:      # kernel older than 5.14: never again
                MADV_POPULATE_READ = None
            return False
        return True

    def advise_huge(self, start: int, n: int) -> None:
        """MADV_HUGEPAGE on a range of the mapping: what a fault there reads into the page cache
        comes in 2 MiB folios (file THP readahead; ext4 on Linux 6.16+ keeps them), which later
        populate and release as one page-table entry per 2 MiB instead of 512. No-op where THP
        is off or the kernel refuses."""
        if self.mm is not None and hasattr(mmap, "MADV_HUGEPAGE") and _thp_allowed():
            lo = start // PAGE * PAGE
            with contextlib.suppress(OSError, ValueError):
                self.mm.madvise(mmap.MADV_HUGEPAGE, lo, start + n - lo)

    def rehome(self, start: int, n: int) -> bool:
        """Read bytes [start, start + n) into the page cache again, in 2 MiB folios: drop this
        process's mapping of their PAGE_TABLE_SPAN windows (`release`), drop the windows' pages
        from the page cache (POSIX_FADV_DONTNEED: clean pages nobody maps; data is never lost,
        another process's mapped pages stay as they are), then populate, which with
        `advise_huge` on the range reads them back as 2 MiB folios mapped by one entry each.

        Why: a slice first read by pread or 4 KiB faults stays in 4 KiB pages for as long as
        it is cached, and mapping a 17.5 MB K3 expert then costs ~1.3 ms of page-table work and
        ~0.5 ms to drop, on every miss; from 2 MiB folios both are ~0.02 ms (measured here, ext4,
        Linux 6.18). The price is one read of the slice from storage. Returns populate's."""
        if self.mm is None:
            return False
        self.release(start, n)
        lo = start // PAGE_TABLE_SPAN * PAGE_TABLE_SPAN
        hi = min(self.size, -(-(start + n) // PAGE_TABLE_SPAN) * PAGE_TABLE_SPAN)
        with contextlib.suppress(OSError):
            os.posix_fadvise(self.fd, lo, hi - lo, os.POSIX_FADV_DONTNEED)
        return self.populate(start, n)

    def release(self, start: int, n: int) -> None:
        """MADV_DONTNEED on bytes [start, start + n) of the mapping, widened to the enclosing
        PAGE_TABLE_SPAN windows: unmapped from this process, still in the page cache.

        Faulting a page of a file mapping also maps cached neighbours (the kernel's fault-around,
        and whole large folios), so pages outside the slice get mapped too: measured here, a
        136 KiB slice left 192 KiB mapped after dropping exactly its 64 KiB-aligned windows.
        Neither reaches past the 2 MiB one page table spans. Dropping a neighbour's mapping is
        harmless: the next touch maps it again from the page cache. Advice only: errors ignored.
        """
        mm = self.mm
        if mm is None:
            return
        lo = start // PAGE_TABLE_SPAN * PAGE_TABLE_SPAN
        hi = min(len(mm), -(-(start + n) // PAGE_TABLE_SPAN) * PAGE_TABLE_SPAN)
        fn = _madvise()
        if fn is not None:      # the GIL released: a background thread may do it
            fn(ctypes.c_void_p(self._addr + lo), ctypes.c_size_t(hi - lo), mmap.MADV_DONTNEED)
            return
        with contextlib.suppress(OSError, ValueError):     # best effort: the kernel may refuse
            mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    @staticmethod
    def mapped_span(start: int, n: int) -> int:
        """Bytes that touching [start, start + n) of a mapping may map into this process: its
        PAGE_TABLE_SPAN windows (a fault maps fault-around neighbours and whole large folios,
        never past the window one page table spans; `release` drops whole windows too)."""
        lo = start // PAGE_TABLE_SPAN * PAGE_TABLE_SPAN
        return -(-(start + n) // PAGE_TABLE_SPAN) * PAGE_TABLE_SPAN - lo

    # -- reads that map nothing ---------------------------------------------------------------

    def pread_into(self, out: np.ndarray, offset: int) -> None:
        """Fill `out` with the bytes at `offset`: the kernel copies straight from the page cache,
        with the GIL released for each call, and nothing gets mapped into this process."""
        view = out.data.cast("B")
        got, n = 0, view.nbytes
        try:
            while got < n:
                k = os.preadv(self.fd, [view[got:]], offset + got)
                if k <= 0:
                    raise FormatError(f"{self.path}: unexpected end of file at byte {offset + got}")
                got += k
        finally:
            view.release()

    def read_exactly(self) -> None:
        """POSIX_FADV_RANDOM on the descriptor: a pread reads what it asks for and no readahead
        window beyond it (measured: with an 8 MiB window, cold 5.8 MB slices cost the disk twice
        their bytes). `willneed` then asks for exactly a slice, in large requests."""
        with contextlib.suppress(OSError):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)

    def willneed(self, offset: int, n: int) -> None:
        """POSIX_FADV_WILLNEED on a range: start reading exactly it into the page cache."""
        with contextlib.suppress(OSError):
            os.posix_fadvise(self.fd, offset, n, os.POSIX_FADV_WILLNEED)

    def drop(self, offset: int, n: int) -> None:
        """POSIX_FADV_DONTNEED on a range: its clean pages leave the page cache."""
        os.posix_fadvise(self.fd, offset, n, os.POSIX_FADV_DONTNEED)

    def read_uncached(self, out: np.ndarray, offset: int) -> None:
        """pread with the range dropped from the page cache before (so the read goes to storage)
        and after (so it leaves nothing behind)."""
        n = out.nbytes
        os.posix_fadvise(self.fd, offset, n, os.POSIX_FADV_DONTNEED)
        self.pread_into(out, offset)
        os.posix_fadvise(self.fd, offset, n, os.POSIX_FADV_DONTNEED)

    def read_direct(self, out: np.ndarray, offset: int, scratch: AlignedScratch) -> int:
        """Fill `out` through the O_DIRECT fd: aligned reads into `scratch`, then a copy.
        Returns the bytes asked of the OS (the aligned span, >= out.nbytes)."""
        n = out.nbytes
        lo = offset // DIRECT_ALIGN * DIRECT_ALIGN
        hi = -(-(offset + n) // DIRECT_ALIGN) * DIRECT_ALIGN
        view = scratch.view(hi - lo)
        try:
            got = self.read_direct_span(view, lo, offset + n - lo)
            out[:] = np.frombuffer(view, np.uint8, n, offset - lo)
            return got
        finally:
            view.release()

    def read_direct_span(self, span: memoryview, lo: int, need: int) -> int:
        """Read the file from `lo` (aligned) into `span` (an aligned buffer of aligned length)
        through the O_DIRECT fd: the device writes straight into it, no copy. At least `need`
        bytes must exist (the span may run past the end of the file). Returns the bytes read."""
        assert self.direct_fd is not None, "file opened without O_DIRECT"
        got = 0
        while got < need:
            k = os.preadv(self.direct_fd, [span[got:]], lo + got)
            if k <= 0:
                break
            got += k
            if got % DIRECT_ALIGN:  # a short read not on a block boundary can only be EOF
                break
        if got < need:
            raise FormatError(f"{self.path}: unexpected end of file at byte {lo + got}")
        return got

    def close(self) -> None:
        if self.mm is not None:
            with contextlib.suppress(BufferError):   # views still held (experts multiplied where they
                self.mm.close()                      # lie): the mapping goes when the last one does
            self.mm = None
        for fd in (self.fd, self.direct_fd):
            if fd is not None:
                os.close(fd)
        self.direct_fd = None


@functools.cache
def _mincore() -> Callable[..., int] | None:
    """libc's mincore, or None off Linux-like systems."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p), ctypes.c_int
    return fn


@functools.cache
def _thp_allowed() -> bool:
    """Whether transparent huge pages are on at all (sysfs `enabled` is not [never])."""
    try:
        return "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


@functools.cache
def _madvise() -> Callable[..., int] | None:
    """libc's madvise (ctypes calls release the GIL, mmap.madvise does not), or None."""
    if sys.platform != "linux":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return fn


class AlignedScratch:
    """A page-aligned buffer for O_DIRECT reads, grown on demand and reused (anonymous maps
    are page aligned)."""

    def __init__(self) -> None:
        self._buf: mmap.mmap | None = None

    def view(self, n: int) -> memoryview:
        if self._buf is None or len(self._buf) < n:
            if self._buf is not None:
                self._buf.close()
            self._buf = mmap.mmap(-1, n)
        return memoryview(self._buf)[:n]

    def close(self) -> None:
        if self._buf is not None:
            self._buf.close()
            self._buf = None
