"""What the disk and the kernel say, for bench_out_of_core.py: /proc readings and disk limits.

Peak RSS and other /proc/self/status fields, this process's CPU times, the bytes the file's block
device delivered (/proc/diskstats), dropping a file from the page cache, and the disk's sequential
limit measured on the file's own expert region (O_DIRECT, one or several streams): the yardstick
every run is compared with. A module beside the benchmark, imported by it (benchmarks/ is not a
package).
"""

from __future__ import annotations

import mmap
import os
import resource
import threading
import time
from pathlib import Path
from typing import Any

MIB, GIB = 1 << 20, 1 << 30
CHUNK = 16 * MIB


def mem_total() -> int:
    """The RAM this process may use: MemTotal, or its control group's limit where that is less (a
    container, or a memory cgroup set up to run a file of some multiple of RAM)."""
    from k3kit.plan.hardware import ram_total
    ram, _ = ram_total()
    if ram is None:
        raise RuntimeError("no MemTotal in /proc/meminfo")
    return ram


def status(field: str, pid: str = "self") -> int:
    """A kB field of /proc/PID/status in bytes (0 if absent)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_times() -> tuple[float, float]:
    """(user, system) CPU seconds of this process so far, all threads: what a read path costs
    the cores the products need (O_DIRECT: the device writes the buffer; buffered: the kernel
    allocates page-cache pages, copies them out, and drops them)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def disk_read_bytes(path: Path) -> int:
    """Bytes read so far by the block device holding `path` (/proc/diskstats, sectors of 512).
    For a partition the whole disk's line is used if the partition's is missing."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    with open("/proc/diskstats", encoding="ascii") as f:
        for line in f:
            p = line.split()
            if int(p[0]) == major and int(p[1]) == minor:
                return int(p[5]) * 512
    raise RuntimeError(f"{path}: device {major}:{minor} not in /proc/diskstats")


def drop_cache(path: Path) -> None:
    """Evict the file's clean pages from the page cache (what a cold start sees)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def expert_region(path: Path) -> tuple[int, int]:
    """(first byte, bytes) of the file's routed-expert tensors."""
    from k3kit.gguf.reader import GGUFFile
    ts = [t for t in GGUFFile.open(path).tensors if "_exps." in t.name]
    lo = min(t.offset for t in ts)
    return lo, max(t.offset + t.nbytes for t in ts) - lo


def step_seq(path: Path, gib: float) -> dict[str, Any]:
    lo, n = expert_region(path)
    want = min(int(gib * GIB), n // 3) // CHUNK * CHUNK
    out = {}
    buf = mmap.mmap(-1, CHUNK)
    for name, flags, start in (("direct", os.O_DIRECT, lo), ("buffered", 0, lo + want)):
        start = start // 4096 * 4096
        fd = os.open(path, os.O_RDONLY | flags)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            for off in range(start, start + want, CHUNK):
                os.preadv(fd, [buf], off)
            dt = time.perf_counter() - t0
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        out[name] = want / dt
    # four sequential streams at once (O_DIRECT): a virtual disk may give more to several requests
    out["direct_x4"] = parallel_direct(path, (lo + 2 * want) // 4096 * 4096, want, 4)
    return {"bytes": want, "direct_Bps": out["direct"], "buffered_Bps": out["buffered"],
            "direct_x4_Bps": out["direct_x4"], "seq_Bps": max(out.values())}


def quick_seq(path: Path, k: int, n: int = 512 * MIB) -> float:
    """O_DIRECT sequential bytes/s over `n` bytes of the expert region (the k-th such piece from
    its end): the limit right before a run. This disk is a virtual one whose bandwidth changes
    over minutes (bursts of ~700 MB/s, ~100 MB/s when throttled), so each run gets its own."""
    lo, size = expert_region(path)
    n = min(n, size // 16) // CHUNK * CHUNK or CHUNK
    start = max(lo, lo + size - (k + 1) * n - CHUNK) // 4096 * 4096
    buf = mmap.mmap(-1, CHUNK)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        t0 = time.perf_counter()
        for off in range(start, start + n, CHUNK):
            os.preadv(fd, [buf], off)
        return n / (time.perf_counter() - t0)
    finally:
        os.close(fd)


def quick_limit(path: Path, k: int, n: int = 256 * MIB, streams: int = 4) -> tuple[float, float]:
    """(one stream, `streams` streams) O_DIRECT sequential bytes/s, each over `n` bytes of the
    expert region not read before in this process (pieces k and 200 + k from its end: a virtual
    disk may cache what it served recently). The background readers keep several reads in
    flight, and on this disk several streams get more than one, so the larger is the limit."""
    one = quick_seq(path, 2 * k, n)
    lo, size = expert_region(path)
    start = max(lo, lo + size - (200 + k + 1) * n - CHUNK) // 4096 * 4096
    return one, parallel_direct(path, start, n, streams)


def parallel_direct(path: Path, start: int, n: int, streams: int) -> float:
    """O_DIRECT bytes/s of `streams` threads each reading its own sequential part of the `n`
    bytes from `start` (4096-aligned) at once."""
    part = n // streams // CHUNK * CHUNK or CHUNK
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)

    def stream(i: int) -> None:
        b = mmap.mmap(-1, CHUNK)
        for off in range(start + i * part, start + (i + 1) * part, CHUNK):
            os.preadv(fd, [b], off)

    try:
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return streams * part / (time.perf_counter() - t0)
    finally:
        os.close(fd)


def valid_run(run: dict[str, Any], spread: float = 1.5) -> bool:
    """The rule for keeping a run of `ab`: the disk's limit measured right before and right after
    it agree within `spread` (the disk did not switch between burst and throttle across the run),
    and the run's own decode-phase disk rate is not above the larger of the two by more than
    10% (else neither measurement described the run)."""
    lo, hi = sorted((run["seq_before"], run["seq_after"]))
    return hi <= spread * lo and run["decode_disk_Bps"] <= 1.1 * hi


def proc_read_bytes() -> int:
    """Bytes this process caused to be read from storage so far (/proc/self/io `read_bytes`: all its
    threads, O_DIRECT and page-cache misses alike, never page-cache hits); 0 where there is none."""
    try:
        with open("/proc/self/io", encoding="ascii") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0
