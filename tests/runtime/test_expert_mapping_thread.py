"""ExpertStore's mapping thread: planned misses in the page cache are mapped one expert ahead.

With a plan, a miss whose slices can be served as views of the mapping (map_misses) is handed to
one background thread that checks the page cache (mincore), maps the slices (MADV_POPULATE_READ)
and checks their scales while the caller multiplies the expert before it; evicted views are
released (MADV_DONTNEED) on that thread too. What must hold: the products are those of the copied
path, what the process keeps mapped stays within the budget once evicted views are released, and
a mapping job dropped by a new plan leaves nothing mapped behind.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from smaps import mapped_bytes

from k3kit.kernels.dequant import nbytes_for
from k3kit.runtime.experts import ExpertStore, ExpertTensor
from k3kit.runtime.experts.cache import MIB
from k3kit.runtime.experts.io import MappedFile

SHAPE = (4096, 4096)         # one MXFP4 projection: 8.9 MB per expert, K3-sized slices
N_EXP = 6

pytestmark = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")


def _file(tmp_path: Path) -> tuple[Path, dict[int, list[ExpertTensor]]]:
    rng = np.random.default_rng(7)
    per = nbytes_for(T.MXFP4, SHAPE[0] * SHAPE[1])
    data = rng.integers(0, 256, per * N_EXP, dtype=np.uint8)
    data.reshape(-1, 17)[:, 0] = rng.integers(118, 130, per * N_EXP // 17)
    path = tmp_path / "experts.bin"
    path.write_bytes(data.tobytes())
    return path, {0: [ExpertTensor(path, 0, T.MXFP4, SHAPE, N_EXP, "gate")]}


def test_planned_misses_are_mapped_ahead_with_the_copied_products_within_the_budget(tmp_path):
    path, spec = _file(tmp_path)
    n = spec[0][0].expert_nbytes
    one = max(MappedFile.mapped_span(e * n, n) for e in range(N_EXP))
    budget = 3 * one                     # half the experts: every round misses and evicts
    x = torch.randn(2, SHAPE[0])
    with ExpertStore(spec, cache_mib=budget / MIB, keep="quantized", map_misses=False) as copy, \
            ExpertStore(spec, cache_mib=budget / MIB, keep="quantized", map_misses=True) as store:
        f = store._files[path]
        assert f.resident(0, f.size)
        for _ in range(4):              # a token: every expert, in the plan's order
            store.plan(0, list(range(N_EXP)))
            for e in range(N_EXP):
                got = store.get(0, [e])[e][0]
                want = copy.get(0, [e])[e][0]
                assert f.holds(got.raw.data_ptr()) and not f.holds(want.raw.data_ptr())
                assert torch.equal(got.matmul(x), want.matmul(x))
                del got
                store._settle()
                # cached views and the job in flight are in the budget; what the last fetch
                # evicted is released at the next get
                assert store.stats().resident_bytes + store._cache.in_flight <= budget
                assert mapped_bytes(path) <= budget + 2 * one
        s = store.stats()
        assert s.misses == s.ahead_reads > 0 and s.hits > 0        # every miss mapped by the thread
        assert not store._pending and store._cache.in_flight == 0
        store.get(0, [N_EXP - 1])       # a hit: what the last misses evicted is released
        store._settle()
        assert mapped_bytes(path) <= budget


def test_a_dropped_mapping_job_leaves_nothing_mapped(tmp_path):
    path, spec = _file(tmp_path)
    n = spec[0][0].expert_nbytes
    with ExpertStore(spec, cache_mib=64, keep="quantized", map_misses=True) as store:
        store.plan(0, [0, 1])
        store._pending[(0, 0)].result()             # expert 0 is mapped, nobody took it
        assert mapped_bytes(path) >= n
        store.plan(0, [4])                          # a new plan drops it
        w = store.get(0, [4])[4][0]                 # its pages are released at this get
        store.get(0, [4])
        store._settle()
        assert (0, 0) not in store._cache and store._cache.in_flight == 0
        assert store.stats().wasted_bytes == 0      # mapping read nothing
        assert mapped_bytes(path) <= MappedFile.mapped_span(4 * n, n)
        assert store._files[path].holds(w.raw.data_ptr())


def test_without_read_ahead_misses_are_mapped_on_the_caller_thread(tmp_path):
    path, spec = _file(tmp_path)
    with ExpertStore(spec, cache_mib=64, keep="quantized", map_misses=True, read_ahead=False) as store:
        store.plan(0, [1, 2])
        assert not store._pending and store._mapper is None
        w = store.get(0, [1])[1][0]
        assert store._files[path].holds(w.raw.data_ptr()) and store.stats().ahead_reads == 0


def test_a_slice_cached_in_small_pages_is_read_again_into_huge_ones_once(tmp_path, monkeypatch):
    path, spec = _file(tmp_path)
    n = spec[0][0].expert_nbytes
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        os.pread(fd, N_EXP * n, 0)                  # cached again, in 4 KiB pages (no readahead)
    finally:
        os.close(fd)
    rehomed: list[int] = []
    rehome = MappedFile.rehome
    def counted(f: MappedFile, start: int, k: int) -> bool:
        rehomed.append(start)
        return rehome(f, start, k)

    monkeypatch.setattr(MappedFile, "rehome", counted)
    x = torch.randn(2, SHAPE[0])
    with ExpertStore(spec, cache_mib=64, keep="quantized", map_misses=False) as copy, \
            ExpertStore(spec, cache_mib=64, keep="quantized", map_misses=True) as store:
        f = store._files[path]
        if not f.resident(0, f.size):
            pytest.skip("this filesystem did not keep the file cached")
        w = store.get(0, [2])[2][0]
        assert f.holds(w.raw.data_ptr())
        assert torch.equal(w.matmul(x), copy.get(0, [2])[2][0].matmul(x))
        if not rehomed:
            pytest.skip("mapping 4 KiB pages measured under SMALL_PAGES_S_PER_MIB here")
        assert rehomed == [2 * n] and f.resident(2 * n, n)
        if mapped_bytes(path, "FilePmdMapped") == 0:
            pytest.skip("this kernel or filesystem keeps no 2 MiB page-cache folios")
        assert mapped_bytes(path) <= MappedFile.mapped_span(2 * n, n)    # whole windows at most
        del w
        store.clear()
        w = store.get(0, [2])[2][0]                 # mapped again: never read again by this store
        assert rehomed == [2 * n]
        assert torch.equal(w.matmul(x), copy.get(0, [2])[2][0].matmul(x))
