"""keep_freed_heap: per-token transients come back from the heap instead of fresh pages."""

import subprocess
import sys

import pytest

from k3kit.kernels import qmatmul

# Run in a fresh interpreter: glibc's counters are process-wide, and threads other tests leave
# behind (servers, expert readers) allocate and free mappings of their own at any moment.
CHECK = r'''
import ctypes
from k3kit.kernels import qmatmul

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
        "keepcost")]

c = ctypes.CDLL(None)
if not hasattr(c, "mallinfo2"):
    raise SystemExit(77)
c.mallinfo2.restype = MallInfo2
c.malloc.argtypes, c.malloc.restype = (ctypes.c_size_t,), ctypes.c_void_p
c.free.argtypes, c.free.restype = (ctypes.c_void_p,), None
assert qmatmul.keep_freed_heap() is True
assert qmatmul.keep_freed_heap() is True          # once per process, then a no-op
block, n = 4 << 20, 8                              # a K3 KDA state's size, 32 MiB in all
mapped = c.mallinfo2().hblkhd
ptrs = [c.malloc(block) for _ in range(n)]
assert all(ptrs)
for p in ptrs:
    ctypes.memset(p, 1, block)                     # fault the pages in, as a tensor's first write does
# below the mmap threshold: from the heap, not a mapping of their own
assert c.mallinfo2().hblkhd == mapped, (c.mallinfo2().hblkhd, mapped)
for p in reversed(ptrs):
    c.free(p)
# ... and kept there once freed (glibc's default trims a free heap top past ~128 KiB-64 MiB)
assert c.mallinfo2().fordblks >= n * block
again = c.malloc(block)
assert again and c.mallinfo2().hblkhd == mapped
c.free(again)
'''


def test_freed_blocks_stay_in_the_heap():
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc only")
    r = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    if r.returncode == 77:
        pytest.skip("no glibc mallinfo2")
    assert r.returncode == 0, r.stderr[-2000:]


def test_thresholds_cover_decode_transients():
    # a K3 KDA state (64 heads x 128 x 128 float32) must fall under the heap's threshold
    assert 64 * 128 * 128 * 4 < qmatmul.HEAP_MMAP_THRESHOLD <= qmatmul.HEAP_TRIM_THRESHOLD
