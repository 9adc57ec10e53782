"""Threads for the native kernels, apart from torch's own ops.

A decode or verify pass of a few rows runs hundreds of small torch ops (attention's products,
softmax, views) between the native products. With more than one torch thread, each product big
enough for MKL or OpenMP to split wakes the other threads, which k3kit lets sleep between regions
(OMP_WAIT_POLICY=PASSIVE, see the README); on small rows the wake-up costs more than the split
saves: the mini's decode step took 1.5x longer at 2 threads than at 1 on a 2-vCPU AMD EPYC (Zen
4), most of it in torch's products (68 -> 525 us a step). `serial_torch()` runs a pass's torch ops
on one thread while the native kernels, which size their thread teams to their work, keep the
configured count: they ask `native()`, never torch, for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

# set inside serial_torch(): the count torch had before. One for the process, as torch's own count
# is (a scope on one thread sets it for all): native kernels on any thread keep the configured count.
_native: int | None = None


def native() -> int:
    """Threads a native kernel may use: torch's count, or what it was before serial_torch()."""
    return _native if _native is not None else torch.get_num_threads()


@contextmanager
def serial_torch() -> Iterator[None]:
    """torch's ops on one thread for the block; native kernels keep the count it had."""
    global _native
    n = torch.get_num_threads()
    if n == 1 or _native is not None:
        yield
        return
    _native = n
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
        _native = None
