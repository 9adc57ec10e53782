"""ExpertStore map_misses: experts already in the page cache are multiplied where they lie.

A quantized store in mmap mode serves a miss whose slices are all in the page cache as views
of the mapping (no copy, no read ahead), counts what such a view may keep mapped (its page-table
windows) against the budget, and drops an evicted view's pages from the process at the next
`get`. Slices not in the page cache are read as before.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from smaps import mapped_bytes

from k3kit.gguf.quants import CorruptBlockError
from k3kit.kernels.dequant import nbytes_for
from k3kit.kernels.qmatmul import QuantizedMatrix
from k3kit.runtime.experts import ExpertStore, ExpertTensor
from k3kit.runtime.experts.cache import MIB
from k3kit.runtime.experts.io import PAGE_TABLE_SPAN, MappedFile

SHAPE = (4096, 4096)         # one MXFP4 projection: 8.5 MiB per expert, K3-sized (5.8 MB)
N_EXP = 6


def _file(tmp_path: Path, nan_expert: int | None = None) -> tuple[Path, dict[int, list[ExpertTensor]]]:
    rng = np.random.default_rng(5)
    per = nbytes_for(T.MXFP4, SHAPE[0] * SHAPE[1])
    data = rng.integers(0, 256, per * N_EXP, dtype=np.uint8)
    blocks = data.reshape(-1, 17)
    blocks[:, 0] = rng.integers(118, 130, blocks.shape[0])
    if nan_expert is not None:
        blocks[nan_expert * per // 17 + 3, 0] = 0xFF     # e8m0 0xFF: NaN scale
    path = tmp_path / "experts.bin"
    path.write_bytes(data.tobytes())
    return path, {0: [ExpertTensor(path, 0, T.MXFP4, SHAPE, N_EXP, "gate")]}


def _inside(q: QuantizedMatrix, f: MappedFile) -> bool:
    return f._addr <= q.raw.data_ptr() < f._addr + f.size


def test_a_miss_in_the_page_cache_is_a_view_with_the_same_products(tmp_path):
    path, spec = _file(tmp_path)
    x = torch.randn(3, SHAPE[0])
    with ExpertStore(spec, cache_mib=64, keep="quantized", map_misses=False) as copy, \
            ExpertStore(spec, cache_mib=64, keep="quantized", map_misses=True) as mapped:
        f = mapped._files[path]
        assert f.resident(0, f.size)                      # just written: in the page cache
        mapped.plan(0, [4, 1])
        # the first planned miss is being mapped by the mapping thread, the second waits its turn
        assert set(mapped._pending) == {(0, 4)} and mapped._queue == [(0, 1)]
        assert mapped._map_jobs == {(0, 4), (0, 1)}
        for e in (4, 1):
            want = copy.get(0, [e])[e][0]
            got = mapped.get(0, [e])[e][0]
            assert _inside(got, f) and not _inside(want, f)
            assert bytes(got.raw.numpy()) == bytes(want.raw.numpy())
            assert torch.equal(got.matmul(x), want.matmul(x))
        s, c = mapped.stats(), copy.stats()
        assert (s.misses, s.bytes_read) == (c.misses, c.bytes_read) == (2, 2 * spec[0][0].expert_nbytes)
        assert s.ahead_reads == 2 and s.wasted_bytes == 0
        assert mapped.get(0, [4])[4][0].raw.data_ptr() == mapped._cache.lookup((0, 4))[0].raw.data_ptr()
        assert mapped.stats().hits == 1
        # what the cache holds is counted as the page-table windows a view may keep mapped
        spans = sum(MappedFile.mapped_span(e * spec[0][0].expert_nbytes, spec[0][0].expert_nbytes)
                    for e in (4, 1))
        assert s.resident_bytes == spans > 2 * spec[0][0].expert_nbytes


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_evicted_views_leave_the_process_and_the_budget_bounds_what_stays_mapped(tmp_path):
    path, spec = _file(tmp_path)
    n = spec[0][0].expert_nbytes
    one = max(MappedFile.mapped_span(e * n, n) for e in range(N_EXP))
    room_for_one = (one + PAGE_TABLE_SPAN) / MIB
    with ExpertStore(spec, cache_mib=room_for_one, keep="quantized", map_misses=True) as store:
        for e in range(N_EXP):
            w = store.get(0, [e])[e][0]
            assert _inside(w, store._files[path])
            del w
            store._settle()                                 # evicted views are released in the background
            assert store.stats().resident_experts == 1
            assert mapped_bytes(path) <= 2 * one      # this expert, and the last until the next get
        store.get(0, [N_EXP - 1])                           # a hit: the evicted one's pages go
        store._settle()
        assert store.stats().hits == 1 and mapped_bytes(path) <= one
    # a budget below one expert's windows keeps nothing, and maps nothing past the next get
    with ExpertStore(spec, cache_mib=1, keep="quantized", map_misses=True) as store:
        store.get(0, [2])
        assert store.stats().resident_experts == 0 and store._cache.unmapped == [(0, 2)]
        store.get(0, [3])
        assert store._cache.unmapped == [(0, 3)]
        store._settle()
        assert mapped_bytes(path) <= one


def test_slices_not_in_the_page_cache_are_read_as_before(tmp_path):
    path, spec = _file(tmp_path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    with ExpertStore(spec, cache_mib=64, keep="quantized", map_misses=True) as store:
        f = store._files[path]
        if f.resident(0, spec[0][0].expert_nbytes):
            pytest.skip("this filesystem keeps the file cached after POSIX_FADV_DONTNEED")
        store.plan(0, [0])
        assert (0, 0) in store._pending                 # read ahead into a buffer of the cache
        w = store.get(0, [0])[0][0]
        assert not _inside(w, f)
        assert store.stats().ahead_reads == 1


def test_small_slices_are_copied(tmp_path):
    """Slices whose page-table windows would cost the budget over MAP_SPAN_LIMIT their bytes."""
    path = tmp_path / "small.bin"
    per = nbytes_for(T.MXFP4, 256 * 64)
    data = np.random.default_rng(1).integers(0, 256, per * 4, dtype=np.uint8)
    data.reshape(-1, 17)[:, 0] = 127
    path.write_bytes(data.tobytes())
    spec = {0: [ExpertTensor(path, 0, T.MXFP4, (256, 64), 4, "gate")]}
    with ExpertStore(spec, cache_mib=64, keep="quantized", map_misses=True) as store:
        assert store._files[path].resident(0, per) and not store._maps(0, 1)
        assert not _inside(store.get(0, [1])[1][0], store._files[path])


def test_a_mapped_miss_checks_scales_and_names_file_and_expert(tmp_path):
    path, spec = _file(tmp_path, nan_expert=3)
    with ExpertStore(spec, cache_mib=64, keep="quantized", map_misses=True) as store:
        assert store._maps(0, 3)
        assert _inside(store.get(0, [2])[2][0], store._files[path])
        with pytest.raises(CorruptBlockError, match=re.escape(str(path)) + r".*expert 3 .*non-finite"):
            store.get(0, [3])
