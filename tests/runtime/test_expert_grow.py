"""A filling expert cache takes multi-MB buffers faulted in ahead (k3kit.runtime.experts.grow),
within its budget, and returns the same bytes as a store without it."""

from __future__ import annotations

import ctypes
import mmap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from k3kit.kernels.dequant import nbytes_for
from k3kit.runtime.experts import ExpertStore, ExpertTensor, grow
from k3kit.runtime.experts import cache as cache_module
from k3kit.runtime.experts.cache import ExpertCache
from k3kit.runtime.experts.grow import MIB, Grower, span

N = 3 * MIB // 2     # a buffer size the grower serves (>= grow.MIN_BYTES)


@pytest.fixture
def spare(monkeypatch):
    """A core left over by torch's threads, whatever this machine has (the grower's condition)."""
    monkeypatch.setattr(cache_module, "spare_core", lambda: True)


def _resident_pages(a: np.ndarray) -> tuple[int, int]:
    """(resident, total) whole pages of `a`, by mincore."""
    page = mmap.PAGESIZE
    lo = -(-a.ctypes.data // page) * page
    hi = (a.ctypes.data + a.nbytes) // page * page
    n = (hi - lo) // page
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), vec) == 0
    return sum(v & 1 for v in vec), n


def _wait(cond, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_a_fresh_mapping_is_not_resident_until_faulted_in():
    a = grow.anonymous(span(N))
    assert _resident_pages(a)[0] == 0          # what the check below would miss otherwise
    grow.fault_in(a)
    resident, total = _resident_pages(a)
    assert resident == total > 0 and a.flags.writeable


def test_grower_faults_in_the_sizes_asked_for_within_room_and_pool():
    room = [3 * span(N) + 100]
    g = Grower(lambda: room[0], pool_bytes=8 * span(N))
    try:
        assert g.take(N) is None                                  # asking starts it
        assert _wait(lambda: g.ready_bytes == 3 * span(N))        # the room bounds it, not the pool
        time.sleep(0.1)
        assert g.ready_bytes == 3 * span(N) and g.faulted_bytes == 3 * span(N)
        room[0] = span(N)                # the cache took memory by other means: the excess goes
        buf = g.take(N)
        assert buf is not None and buf.nbytes == span(N)
        resident, total = _resident_pages(buf)
        assert resident == total and g.taken == 1
        g.wake()
        assert _wait(lambda: g.ready_bytes <= span(N))
    finally:
        g.close()
    assert g._thread is None and g.ready_bytes == 0


def test_grower_stops_when_full_and_resumes_after_reset():
    g = Grower(lambda: 1 << 40, pool_bytes=2 * span(N))
    try:
        g.take(N)
        assert _wait(lambda: g.ready_bytes == 2 * span(N))        # the pool bounds it
        g.full()
        assert g.ready_bytes == 0 and g.take(N) is None
        faulted = g.faulted_bytes
        time.sleep(0.2)
        assert g.faulted_bytes <= faulted + span(N) and g.ready_bytes == 0   # at most the one in hand
        g.reset()
        assert _wait(lambda: g.ready_bytes == 2 * span(N))
    finally:
        g.close()


def test_an_idle_grower_lets_its_buffers_go(monkeypatch):
    monkeypatch.setattr(grow, "IDLE_S", 0.2)
    g = Grower(lambda: 1 << 40, pool_bytes=2 * span(N))
    try:
        g.take(N)
        assert _wait(lambda: g.ready_bytes > 0)
        assert _wait(lambda: g.ready_bytes == 0, timeout=5)       # nobody asked since
    finally:
        g.close()


def test_small_buffers_never_involve_the_grower(spare):
    cache = ExpertCache(1 << 30)
    cache.buffer(64 * 1024)
    cache.buffer(64 * 1024, 100)
    assert cache.grower is not None and cache.grower._sizes == [] and cache.grower._thread is None


def _big_file(tmp_path: Path, n_experts: int = 8) -> tuple[Path, dict[int, list[ExpertTensor]], bytes]:
    """Two MXFP4 projections of 1.06 MiB per expert at odd offsets (O_DIRECT reads around them)."""
    rng = np.random.default_rng(7)
    shape = (2048, 1024)
    datas = []
    for _ in range(2):
        raw = rng.integers(0, 256, nbytes_for(T.MXFP4, shape[0] * shape[1] * n_experts), dtype=np.uint8)
        raw.reshape(-1, 17)[:, 0] = rng.integers(120, 130, raw.size // 17)
        datas.append(raw)
    junk = rng.integers(0, 256, 1000, dtype=np.uint8)
    blob = np.concatenate([junk[:333], datas[0], junk[333:], datas[1], junk[:77]])
    path = tmp_path / "big.bin"
    path.write_bytes(blob.tobytes())
    spec = {0: [ExpertTensor(path, 333, T.MXFP4, shape, n_experts, "gate"),
                ExpertTensor(path, 333 + datas[0].size + 667, T.MXFP4, shape, n_experts, "up")]}
    return path, spec, blob.tobytes()


@pytest.mark.parametrize("cold", [True, False])
def test_a_filling_cache_reads_into_grown_buffers_with_the_same_bytes(tmp_path, cold, spare):
    path, spec, blob = _big_file(tmp_path)
    n = spec[0][0].expert_nbytes
    assert n >= grow.MIN_BYTES
    with ExpertStore(spec, cache_mib=64, keep="quantized", map_misses=False, cold=cold,
                     read_ahead=False) as store:
        g = store._cache.grower
        assert g is not None
        store.get(0, [0])                                      # asks for the size
        assert _wait(lambda: g.ready_bytes >= 4 * span(n))
        got = store.get(0, [1, 2, 3])
        assert g.taken >= 2
        for e in (1, 2, 3):
            for t, w in zip(spec[0], got[e], strict=True):
                start = t.offset + e * n
                assert bytes(w.raw.numpy()) == blob[start:start + n]
                if cold and store.direct_io:
                    assert w.raw.data_ptr() % 4096 == start % 4096
        assert store.stats().evictions == 0                    # the budget had room: nothing recycled
        x = torch.randn(2, spec[0][0].shape[0])
        with ExpertStore(spec, cache_mib=64, keep="quantized", map_misses=False, read_ahead=False) as plain:
            ref = plain.get(0, [1])[1]
            assert all(torch.equal(a.matmul(x), b.matmul(x)) for a, b in zip(got[1], ref, strict=True))
    assert g._thread is None                                   # closed with the store


def test_with_nothing_grown_a_filling_cache_recycles_its_least_recent_expert(tmp_path, spare):
    path, spec, blob = _big_file(tmp_path)
    n = spec[0][0].expert_nbytes
    with ExpertStore(spec, cache_mib=64, keep="quantized", map_misses=False, read_ahead=False) as store:
        g = store._cache.grower
        assert g is not None
        g.pool_bytes = 0                                       # the thread never gets ahead
        store.get(0, [0])                                      # an empty cache: fresh memory
        store.get(0, [1])                                      # evicts 0 to reuse its buffers
        s = store.stats()
        assert s.evictions == 1 and not store.is_cached(0, 0) and store.is_cached(0, 1)
        assert s.resident_bytes == 2 * n and g.taken == 0
        w = store.get(0, [1])[1]
        assert store.stats().hits == 1
        assert bytes(w[0].raw.numpy()) == blob[spec[0][0].offset + n:spec[0][0].offset + 2 * n]
        g.full()                                               # once full, plain LRU: nothing recycled early
        store.get(0, [2])
        assert store.is_cached(0, 1) and store.is_cached(0, 2)


def test_without_a_spare_core_misses_take_fresh_memory(tmp_path, monkeypatch):
    """Every core computing: faulting ahead would take the products' time, so the cache fills
    as before (fresh buffers on the misses, nothing evicted below the budget)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1 << 16)
    assert not grow.spare_core()
    path, spec, _ = _big_file(tmp_path)
    with ExpertStore(spec, cache_mib=64, keep="quantized", map_misses=False, read_ahead=False) as store:
        for e in range(4):
            store.get(0, [e])
        g = store._cache.grower
        assert g is not None and g._thread is None and g.taken == 0
        assert store.stats().evictions == 0 and all(store.is_cached(0, e) for e in range(4))


def test_spare_core_counts_torch_threads(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(grow.os, "sched_getaffinity", lambda _: {0, 1})
    assert grow.spare_core()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert not grow.spare_core()
