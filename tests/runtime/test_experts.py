"""ExpertStore: exact slices, LRU by MiB, the byte ledger, cold reads, file changes."""

from __future__ import annotations

import os
import re
import threading
from concurrent.futures import wait
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

import k3kit.runtime.experts.cache as cache_mod
from k3kit.errors import FormatError
from k3kit.kernels.dequant import nbytes_for
from k3kit.runtime.experts import ExpertStore, ExpertTensor
from k3kit.runtime.experts.cache import MIB, LayerStats

N_IN, N_OUT, N_EXP = 64, 32, 8
PROJ = [("gate", T.MXFP4, (N_IN, N_OUT)), ("up", T.MXFP4, (N_IN, N_OUT)), ("down", T.Q8_0, (N_OUT, N_IN))]
ENTRY_BYTES = 3 * N_IN * N_OUT * 4  # one expert, three float32 matrices


def _random_quant(qtype: T, n_elements: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks with finite scales (MXFP4 exponents near 127, Q8_0 f16 d in [-1, 1])."""
    raw = rng.integers(0, 256, nbytes_for(qtype, n_elements), dtype=np.uint8)
    if qtype == T.MXFP4:
        blocks = raw.reshape(-1, 17)
        blocks[:, 0] = rng.integers(120, 130, blocks.shape[0])
    elif qtype == T.Q8_0:
        blocks = raw.reshape(-1, 34)
        blocks[:, :2] = rng.uniform(-1, 1, blocks.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw


def _layer_bytes(rng: np.random.Generator) -> list[np.ndarray]:
    return [_random_quant(q, N_IN * N_OUT * N_EXP, rng) for _, q, _ in PROJ]


@pytest.fixture
def model_file(tmp_path: Path):
    """A file with junk, then two layers of expert tensors at unaligned offsets."""
    rng = np.random.default_rng(0)
    path = tmp_path / "experts.bin"
    chunks, spec, pos = [rng.integers(0, 256, 100, dtype=np.uint8)], {}, 100
    datas = {}
    for layer in (3, 7):
        datas[layer] = _layer_bytes(rng)
        spec[layer] = []
        for (name, qtype, shape), data in zip(PROJ, datas[layer], strict=True):
            spec[layer].append(ExpertTensor(path, pos, qtype, shape, N_EXP, f"blk.{layer}.{name}"))
            chunks += [data, rng.integers(0, 256, 7, dtype=np.uint8)]
            pos += data.size + 7
    path.write_bytes(np.concatenate(chunks).tobytes())
    return path, spec, datas


def _expected(datas, layer: int, e: int) -> tuple[torch.Tensor, ...]:
    """Independent of the store's slicing: gguf-py dequantizes the whole 3-D tensor."""
    out = []
    for (_, qtype, shape), data in zip(PROJ, datas[layer], strict=True):
        full = gguf_dequantize(data.reshape(N_EXP * shape[1], -1), qtype).reshape(N_EXP, shape[1], shape[0])
        out.append(torch.from_numpy(np.ascontiguousarray(full[e])))
    return tuple(out)


def test_get_returns_the_experts_matrices(model_file):
    path, spec, datas = model_file
    with ExpertStore(spec) as store:
        got = store.get(7, [5, 0, 5])
        assert list(got) == [0, 5]
        for e in (0, 5):
            for w, want in zip(got[e], _expected(datas, 7, e), strict=True):
                assert w.dtype == torch.float32 and torch.equal(w, want)
        assert got[0][0].shape == (N_OUT, N_IN) and got[0][2].shape == (N_IN, N_OUT)
        with pytest.raises(ValueError, match="expert ids"):
            store.get(7, [N_EXP])


def test_ledger_counts_exact_payload_bytes(model_file):
    _, spec, _ = model_file
    expert_bytes = sum(t.expert_nbytes for t in spec[3])
    assert expert_bytes == 2 * 1088 + 2176
    with ExpertStore(spec, cache_mib=1) as store:
        assert store.expert_nbytes(3) == expert_bytes
        store.get(3, [1, 4, 4, 6])
        s = store.stats()
        assert (s.misses, s.hits, s.bytes_read, s.io_bytes) == (3, 0, 3 * expert_bytes, 3 * expert_bytes)
        store.get(3, [4, 6])  # hits read nothing
        store.get(7, [4])
        s = store.stats()
        assert (s.misses, s.hits, s.bytes_read) == (4, 2, 4 * expert_bytes)
        assert s.per_layer == {3: LayerStats(2, 3, 3 * expert_bytes), 7: LayerStats(0, 1, expert_bytes)}
        assert s.resident_bytes == 4 * ENTRY_BYTES and s.resident_experts == 4
        store.reset_stats()
        s = store.stats()
        assert (s.misses, s.hits, s.bytes_read, s.per_layer) == (0, 0, 0, {})
        assert s.resident_bytes == 4 * ENTRY_BYTES  # state, not a counter


def test_lru_evicts_by_mib_budget_in_lru_order(model_file):
    _, spec, _ = model_file
    with ExpertStore(spec, cache_mib=3.5 * ENTRY_BYTES / MIB) as store:  # room for 3 experts
        store.get(3, [0, 1, 2])
        store.get(3, [0])  # 0 becomes most recent; 1 is now least recent
        store.get(3, [5])
        assert [e for e in range(N_EXP) if store.is_cached(3, e)] == [0, 2, 5]
        s = store.stats()
        assert (s.evictions, s.evicted_bytes, s.resident_bytes) == (1, ENTRY_BYTES, 3 * ENTRY_BYTES)
        store.get(7, [1, 2])  # other layers share the budget: evicts 2 then 0
        keys = [(3, 0), (3, 2), (3, 5), (7, 1), (7, 2)]
        assert [k for k in keys if store.is_cached(*k)] == [(3, 5), (7, 1), (7, 2)]
        assert store.stats().evictions == 3
        store.get(3, [1])
        assert store.stats().misses == 7  # 1 was evicted: read again


def test_zero_budget_keeps_nothing_beyond_the_batch(model_file):
    _, spec, _ = model_file
    with ExpertStore(spec, cache_mib=0) as store:
        a = store.get(3, [2, 3])
        b = store.get(3, [2, 3])
        s = store.stats()
        assert (s.misses, s.hits, s.resident_bytes, s.evictions) == (4, 0, 0, 0)
        assert all(torch.equal(x, y) for e in (2, 3) for x, y in zip(a[e], b[e], strict=True))


def test_batch_larger_than_budget_is_returned_whole(model_file):
    _, spec, datas = model_file
    with ExpertStore(spec, cache_mib=2 * ENTRY_BYTES / MIB) as store:
        got = store.get(3, range(N_EXP))
        assert len(got) == N_EXP and torch.equal(got[0][1], _expected(datas, 3, 0)[1])
        s = store.stats()
        assert s.resident_bytes == 2 * ENTRY_BYTES and s.evictions == N_EXP - 2
        assert store.is_cached(3, 6) and store.is_cached(3, 7) and not store.is_cached(3, 5)


def test_pin_keeps_experts_resident(model_file):
    _, spec, _ = model_file
    with ExpertStore(spec, cache_mib=0) as store:
        store.pin(3, [4])
        assert store.stats().pinned_bytes == ENTRY_BYTES
        store.get(3, [4, 5])
        s = store.stats()
        assert (s.hits, s.misses) == (1, 2)  # pin's read of 4, then 5; 4 was a hit
        assert store.is_cached(3, 4) and not store.is_cached(3, 5)
        store.unpin(3, [4])
        assert not store.is_cached(3, 4) and store.stats().resident_bytes == 0
    with ExpertStore(spec, cache_mib=2 * ENTRY_BYTES / MIB) as store:
        store.pin(7, [0])
        store.get(7, [1, 2, 3, 4])
        assert store.is_cached(7, 0) and store.is_cached(7, 4) and not store.is_cached(7, 3)
        assert store.stats().resident_bytes == 2 * ENTRY_BYTES


def test_missing_bytes_is_what_get_reads(model_file):
    _, spec, _ = model_file
    with ExpertStore(spec, cache_mib=1) as store:
        store.get(3, [1, 2])
        want = store.missing_bytes(3, [1, 2, 3, 3, 4])
        before = store.stats().bytes_read
        store.get(3, [1, 2, 3, 3, 4])
        assert want == 2 * store.expert_nbytes(3) == store.stats().bytes_read - before
        assert store.missing_bytes(3, [1, 2, 3, 4]) == 0 and store.cached_count(3) == 4


@pytest.mark.parametrize("cold", ["fadvise", "direct"])
def test_cold_modes_read_the_same_bytes(model_file, cold):
    _, spec, _ = model_file
    with ExpertStore(spec) as warm, ExpertStore(spec, cold=cold) as store:
        for layer in (3, 7):
            a, b = warm.get(layer, [0, 3, 7]), store.get(layer, [0, 3, 7])
            assert all(torch.equal(x, y) for e in a for x, y in zip(a[e], b[e], strict=True))
        s, w = store.stats(), warm.stats()
        assert s.bytes_read == w.bytes_read == 6 * store.expert_nbytes(3)
        if cold == "direct" and store.direct_io:
            # whole 4 KiB blocks around each unaligned slice (18 reads; the file's tail is short)
            assert s.bytes_read < s.io_bytes <= s.bytes_read + 18 * 2 * 4096
        else:
            assert s.io_bytes == s.bytes_read


def test_set_cold_switches_the_read_mode_of_a_live_store(model_file):
    """The benchmark's A/B: one store, modes switched between runs; each mode then reads the same
    bytes with its own I/O (O_DIRECT: whole 4 KiB blocks; page cache and fadvise: the slices)."""
    _, spec, datas = model_file
    with ExpertStore(spec, cache_mib=1) as store:
        for cold in ("direct", "fadvise", False, True):
            store.set_cold(cold)
            assert store.cold == ("direct" if cold is True else cold)
            assert store.stats().resident_experts == 0          # switching empties the cache
            store.reset_stats()
            got = store.get(7, [1, 6])
            for e in (1, 6):
                assert all(torch.equal(x, y) for x, y in zip(got[e], _expected(datas, 7, e), strict=True))
            s = store.stats()
            assert s.bytes_read == 2 * store.expert_nbytes(7)
            if store.direct_io:
                assert cold in ("direct", True) and s.io_bytes > s.bytes_read
            else:
                assert s.io_bytes == s.bytes_read
        with pytest.raises(ValueError, match="cold must be"):
            store.set_cold("o_direct")


def test_buffer_source_matches_file_source(model_file):
    path, spec, datas = model_file
    whole = np.fromfile(path, dtype=np.uint8)
    mem = {layer: [ExpertTensor(whole, t.offset, t.ggml_type, t.shape, t.n_experts) for t in ts]
           for layer, ts in spec.items()}
    with ExpertStore(spec) as a, ExpertStore(mem) as b:
        x, y = a.get(3, [1, 6]), b.get(3, [1, 6])
        assert all(torch.equal(p, q) for e in (1, 6) for p, q in zip(x[e], y[e], strict=True))
        assert a.stats().bytes_read == b.stats().bytes_read


def _vmas(path: Path) -> list[tuple[int, int, str, int]]:
    """(start, end, VmFlags, Rss kB) of this process's mappings of `path`."""
    out, cur = [], None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s+(.*)$", line)
        if m:
            cur = [int(m[1], 16), int(m[2], 16), "", 0] if m[3] == str(path) else None
            if cur is not None:
                out.append(cur)
        elif cur is not None and line.startswith("Rss:"):
            cur[3] = int(line.split()[1])
        elif cur is not None and line.startswith("VmFlags:"):
            cur[2] = line.split(":", 1)[1]
    return [tuple(v) for v in out]


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_mapping_is_lazy_and_random_advised(model_file):
    path, spec, _ = model_file
    with ExpertStore(spec, release_pages=False) as store:
        vmas = _vmas(path)
        assert vmas and sum(v[3] for v in vmas) == 0  # nothing faulted in at open: no populate
        assert any(" rr" in v[2] for v in vmas)  # MADV_RANDOM on the expert ranges
        store.get(3, [0])
        assert sum(v[3] for v in _vmas(path)) > 0
    with ExpertStore(spec, madvise_random=False):
        assert not any(" rr" in v[2] for v in _vmas(path))


def _big_expert_file(tmp_path: Path, n_experts: int = 3) -> tuple[Path, dict[int, list[ExpertTensor]]]:
    """One layer, one MXFP4 projection of 2.1 MiB per expert: more than the 2 MiB windows the
    store drops, so releasing expert 0 cannot reach expert 2."""
    rng = np.random.default_rng(9)
    shape = (4096, 1024)
    data = _random_quant(T.MXFP4, shape[0] * shape[1] * n_experts, rng)
    path = tmp_path / "big.bin"
    path.write_bytes(data.tobytes())
    return path, {0: [ExpertTensor(path, 0, T.MXFP4, shape, n_experts, "gate")]}


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_miss_leaves_no_mapped_pages_in_rss(tmp_path):
    """After a miss the expert's bytes live in the page cache and the dequantized LRU, not in
    this process's mapping (smaps Rss of the file); release_pages=False keeps them mapped."""
    path, spec = _big_expert_file(tmp_path)
    expert_kib = spec[0][0].expert_nbytes // 1024
    with ExpertStore(spec, release_pages=False, cache_mib=16) as keep:
        w = keep.get(0, [1])[1][0]
        assert sum(v[3] for v in _vmas(path)) >= expert_kib
    with ExpertStore(spec, cache_mib=16) as store:
        got = store.get(0, [1])[1][0]
        assert torch.equal(got, w)  # released after the copy: the data is intact
        assert sum(v[3] for v in _vmas(path)) == 0
        assert store.is_cached(0, 1) and torch.equal(store.get(0, [1])[1][0], w)


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_release_and_loader_wrapper_unmap_one_expert(tmp_path):
    """`release(layer, expert)` (and loader.release_pages over it) drops exactly that expert's
    pages; a neighbour faulted in with release_pages=False stays mapped."""
    from k3kit.runtime.loader import release_pages

    path, spec = _big_expert_file(tmp_path)
    expert_kib = spec[0][0].expert_nbytes // 1024
    with ExpertStore(spec, release_pages=False) as store:
        store.get(0, [0, 2])
        assert sum(v[3] for v in _vmas(path)) >= 2 * expert_kib
        store.release(0, 0)
        assert expert_kib <= sum(v[3] for v in _vmas(path)) < 2 * expert_kib
        release_pages(store, 0, 2)
        assert sum(v[3] for v in _vmas(path)) == 0
        store.release(0, 1)  # never read: nothing to drop, no error


@pytest.mark.parametrize("cold", [False, "fadvise", "direct"])
def test_tensors_from_earlier_misses_survive_later_reads(model_file, cold):
    """Misses read into one reused scratch buffer: what they return must not alias it."""
    path, spec, datas = model_file
    with ExpertStore(spec, cold=cold) as store:  # cache 0: every get is a miss
        first = store.get(3, [4])[4]
        for e in range(N_EXP):
            store.get(7, [e])
        assert all(torch.equal(w, want) for w, want in zip(first, _expected(datas, 3, 4), strict=True))


def test_release_is_a_no_op_without_a_mapping(model_file):
    path, spec, datas = model_file
    whole = np.fromfile(path, dtype=np.uint8)
    mem = {layer: [ExpertTensor(whole, t.offset, t.ggml_type, t.shape, t.n_experts) for t in ts]
           for layer, ts in spec.items()}
    with ExpertStore(mem) as a, ExpertStore(spec, cold="fadvise") as b:
        for store in (a, b):
            w = store.get(3, [2])[2]
            store.release(3, 2)
            assert all(torch.equal(x, y) for x, y in zip(w, _expected(datas, 3, 2), strict=True))


def test_changed_file_raises_format_error(model_file):
    path, spec, _ = model_file
    with ExpertStore(spec) as store:
        store.get(3, [0])
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
        with pytest.raises(FormatError, match=re.escape(str(path)) + ".*changed"):
            store.get(3, [1])
        assert store.stats().bytes_read == store.expert_nbytes(3)  # nothing read after the change


@pytest.mark.parametrize("cold", [False, "fadvise", "direct"])
def test_truncated_after_open_raises_instead_of_sigbus(model_file, cold):
    path, spec, _ = model_file
    with ExpertStore(spec, cold=cold) as store:
        os.truncate(path, spec[3][1].offset)
        with pytest.raises(FormatError, match=re.escape(str(path))):
            store.get(7, [N_EXP - 1])


def test_truncated_file_is_rejected_at_open(model_file):
    path, spec, _ = model_file
    last = spec[7][2]
    os.truncate(path, last.offset + last.nbytes - 1)
    with pytest.raises(FormatError, match=re.escape(str(path)) + ".*blk.7.down.*past end of file"):
        ExpertStore(spec)


def test_unsupported_type_and_bad_geometry_are_format_errors(model_file):
    path, spec, _ = model_file
    t = spec[3][0]
    with pytest.raises(FormatError, match=re.escape(str(path)) + ".*Q8_K has no dequant kernel"):
        ExpertStore({0: [ExpertTensor(path, t.offset, T.Q8_K, (256, 4), 2, "x")]})
    with pytest.raises(FormatError, match="bad geometry"):
        ExpertStore({0: [ExpertTensor(path, t.offset, T.MXFP4, (48, 4), 2, "x")]})


def test_compute_dtype_halves_resident_bytes(model_file):
    _, spec, datas = model_file
    with ExpertStore(spec, cache_mib=1, dtype=torch.bfloat16) as store:
        w = store.get(3, [2])[2]
        assert all(x.dtype == torch.bfloat16 for x in w)
        assert torch.equal(w[0], _expected(datas, 3, 2)[0].to(torch.bfloat16))
        assert store.stats().resident_bytes == ENTRY_BYTES // 2


def test_from_gguf_model(tmp_path):
    """Expert tensors found through the GGUF reader's Model: offsets, shards and types."""
    from k3kit.gguf.shards import Model
    from k3kit.gguf.writer import TensorSpec, write_model

    rng = np.random.default_rng(9)
    tensors, datas = [], {}
    for layer in (0, 1):
        datas[layer] = _layer_bytes(rng)
        for (name, qtype, shape), data in zip(PROJ, datas[layer], strict=True):
            name = f"blk.{layer}.ffn_{name}_exps.weight"
            tensors.append(TensorSpec(name, (*shape, N_EXP), qtype, data.size, data))
    paths = write_model(tmp_path / "m.gguf", [], tensors, max_shard_bytes=4 * 4096)
    assert len(paths) >= 2
    names = {layer: [f"blk.{layer}.ffn_{p}_exps.weight" for p in ("gate", "up", "down")] for layer in (0, 1)}
    with Model.open(paths[0]) as model, ExpertStore.from_gguf(model, names, cache_mib=1) as store:
        assert {t.source for ts in store.layers.values() for t in ts} == set(model.paths)
        for layer in (0, 1):
            got = store.get(layer, [2, 7])
            for e in (2, 7):
                assert all(torch.equal(w, x) for w, x in zip(got[e], _expected(datas, layer, e), strict=True))
        with pytest.raises(FormatError, match="no tensor 'blk.5.ffn_up_exps.weight'"):
            ExpertStore.from_gguf(model, {5: ["blk.5.ffn_up_exps.weight"]})


def test_planned_fetches_read_ahead_with_the_same_bytes_and_ledger(tmp_path):
    """plan() on a quantized store: each fetch starts the next planned miss in the background.
    Same weights and the same ledger as fetching without a plan; one read in flight at most;
    nothing stays mapped in this process (the background read is a pread)."""
    path, spec = _big_expert_file(tmp_path, n_experts=5)
    order = [4, 0, 2, 3]
    with ExpertStore(spec, cache_mib=3, keep="quantized", map_misses=False, read_ahead=False) as plain:
        want = [bytes(plain.get(0, [e])[e][0].raw.numpy()) for e in order]
        want_stats = plain.stats()
    # holds one 2.1 MiB expert
    with ExpertStore(spec, cache_mib=3, keep="quantized", map_misses=False) as store:
        store.plan(0, order)
        assert len(store._pending) == 1 and (0, 4) in store._pending
        for e, w in zip(order, want, strict=True):
            got = store.get(0, [e])[e][0]
            assert bytes(got.raw.numpy()) == w
            assert len(store._pending) <= 1
        assert not store._pending and not store._queue and store._cache.in_flight == 0
        s = store.stats()
        assert (s.misses, s.hits, s.bytes_read, s.io_bytes) == \
            (want_stats.misses, want_stats.hits, want_stats.bytes_read, want_stats.io_bytes)
        if Path("/proc/self/smaps").exists():
            assert sum(v[3] for v in _vmas(path)) == 0


def test_read_ahead_of_a_changed_file_raises_on_fetch(tmp_path):
    """A file that changes under a background read is reported by the fetch that wanted it."""
    path, spec = _big_expert_file(tmp_path, n_experts=3)
    with ExpertStore(spec, cache_mib=16, keep="quantized", map_misses=False) as store:
        store.get(0, [0])
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
        store.plan(0, [1, 2])
        with pytest.raises(FormatError, match=re.escape(str(path)) + ".*changed"):
            store.get(0, [1])


def test_plan_is_ignored_where_read_ahead_does_not_apply(model_file):
    """Dequantizing stores, in-memory buffers and read_ahead=False fetch on the caller's thread."""
    _, spec, _ = model_file
    buffers = {3: [ExpertTensor(np.zeros(t.nbytes, np.uint8), 0, t.ggml_type, t.shape, t.n_experts, t.name)
                   for t in spec[3]]}
    for layers, kwargs in ((spec, {}), (spec, {"keep": "quantized", "read_ahead": False}),
                           (buffers, {"keep": "quantized"})):
        with ExpertStore(layers, cache_mib=1, **kwargs) as store:
            store.plan(3, [0, 1])
            store.prefetch(3, [2])
            assert not store._pending and not store._queue


@pytest.mark.parametrize("cold", [False, "fadvise", "direct"])
def test_deep_read_ahead_stays_within_the_budget(tmp_path, cold):
    """Several reads in flight (every read mode), same bytes and payload ledger as no read-ahead;
    what the cache holds plus what is in flight never exceeds the budget."""
    path, spec = _big_expert_file(tmp_path, n_experts=8)
    per = spec[0][0].expert_nbytes                     # 2.1 MiB
    order = [7, 1, 2, 5, 0, 3]
    with ExpertStore(spec, cache_mib=0, keep="quantized", map_misses=False, read_ahead=False,
                     cold=cold) as plain:
        want = [bytes(plain.get(0, [e])[e][0].raw.numpy()) for e in order]
        want_stats = plain.stats()
    with ExpertStore(spec, cache_mib=12, keep="quantized", map_misses=False, cold=cold,
                     read_threads=2) as store:
        budget = store.cache_bytes
        store.plan(0, order)
        assert len(store._pending) == (budget // 2) // per == 2     # half the budget ahead
        for e, w in zip(order, want, strict=True):
            assert bytes(store.get(0, [e])[e][0].raw.numpy()) == w
            s = store.stats()
            assert s.resident_bytes + store._cache.in_flight <= budget
        s = store.stats()
        assert (s.misses, s.bytes_read, s.io_bytes) == (want_stats.misses, want_stats.bytes_read,
                                                       want_stats.io_bytes)
        assert s.ahead_reads == len(order) and s.wasted_bytes == 0 and s.prefetched == 0


def test_prefetch_reads_the_guess_and_only_fetches_change_the_cache(tmp_path, monkeypatch):
    """prefetch(layer + 1, guess) while layer runs: right guesses become misses served by the
    background read, wrong ones are dropped when the real plan comes (wasted_bytes), and the
    cache holds only what was fetched: the same contents and results as without prefetch. No
    grower: with one, which expert a filling cache recycles depends on its thread's pace."""
    monkeypatch.setattr(cache_mod, "spare_core", lambda: False)
    path, spec1 = _big_expert_file(tmp_path, n_experts=8)
    spec = {0: spec1[0], 1: spec1[0]}      # two layers over the same bytes
    per = spec1[0][0].expert_nbytes

    def run(store: ExpertStore, guess: list[int] | None) -> list[bytes]:
        got = []
        store.plan(0, [1, 2])
        if guess is not None:
            store.prefetch(1, guess)
            wait(list(store._pending.values()))    # every guess read: the counts below are exact
        got += [bytes(store.get(0, [e])[e][0].raw.numpy()) for e in (1, 2)]
        store.plan(1, [3, 4, 5])
        got += [bytes(store.get(1, [e])[e][0].raw.numpy()) for e in (3, 4, 5)]
        return got

    with ExpertStore(spec, cache_mib=64, keep="quantized", map_misses=False) as plain:
        want = run(plain, None)
        want_cached = sorted(k for k in plain._cache._entries)
    with ExpertStore(spec, cache_mib=64, keep="quantized", map_misses=False) as store:
        assert run(store, [4, 5, 6, 7]) == want
        s = store.stats()
        assert sorted(store._cache._entries) == want_cached
        assert (s.prefetched, s.prefetch_used) == (4, 2)
        assert s.wasted_bytes == 2 * per and s.bytes_read == 5 * per
        assert s.io_bytes == s.bytes_read + s.wasted_bytes
        assert not store.is_cached(1, 6) and store._cache.in_flight == 0


def _misaligned_file(tmp_path: Path, n_experts: int = 6) -> tuple[Path, dict[int, list[ExpertTensor]], bytes]:
    """Two projections at odd offsets whose expert size is no multiple of 4096, so every expert's
    slice sits at another offset within a page (what O_DIRECT must read around)."""
    rng = np.random.default_rng(5)
    shape = (1056, 96)     # 53,856 bytes of MXFP4 per expert
    datas = [_random_quant(T.MXFP4, shape[0] * shape[1] * n_experts, rng) for _ in range(2)]
    junk = rng.integers(0, 256, 1000, dtype=np.uint8)
    path = tmp_path / "odd.bin"
    blob = np.concatenate([junk[:333], datas[0], junk[333:], datas[1], junk[:77]])
    path.write_bytes(blob.tobytes())
    spec = {0: [ExpertTensor(path, 333, T.MXFP4, shape, n_experts, "gate"),
                ExpertTensor(path, 333 + datas[0].size + 667, T.MXFP4, shape, n_experts, "up")]}
    return path, spec, blob.tobytes()


@pytest.mark.parametrize("read_ahead", [True, False])
def test_direct_reads_land_in_the_cache_buffer_with_the_same_bytes(tmp_path, read_ahead):
    """cold="direct" (what cold=True means): each quantized miss is read by O_DIRECT straight into
    the buffer the cache keeps, never through the scratch buffer; the bytes, the payload ledger
    and the results equal those of the page-cache store, also when evicted buffers are reused for
    slices at other offsets within a page."""
    path, spec, blob = _misaligned_file(tmp_path)
    order = [5, 0, 3, 1, 4, 2, 0, 5]
    n = spec[0][0].expert_nbytes
    with ExpertStore(spec, cache_mib=0.25, keep="quantized", map_misses=False, cold=True,
                     read_ahead=read_ahead) as store:
        if not store.direct_io:
            pytest.skip("this filesystem refuses O_DIRECT")
        assert store.cold == "direct"
        with ExpertStore(spec, cache_mib=0.25, keep="quantized", map_misses=False, read_ahead=False) as plain:
            for i in range(0, len(order), 3):
                batch = order[i:i + 3]
                store.plan(0, batch)
                got, want = store.get(0, batch), plain.get(0, batch)
                for e in batch:
                    for t, w, x in zip(spec[0], got[e], want[e], strict=True):
                        start = t.offset + e * n
                        assert bytes(w.raw.numpy()) == blob[start:start + n] == bytes(x.raw.numpy())
                        assert w.raw.data_ptr() % 4096 == start % 4096      # laid out around its span
                        assert w.raw.data_ptr() in store._cache._direct
                        xin = torch.randn(2, t.shape[0])
                        assert torch.equal(w.matmul(xin), x.matmul(xin))
            s, p = store.stats(), plain.stats()
            assert (s.misses, s.hits, s.bytes_read) == (p.misses, p.hits, p.bytes_read)
            assert s.evictions > 0 and s.io_bytes >= s.bytes_read
        assert store._direct._buf is None and not store._scratches     # no bounce buffer was used


def test_a_dropped_guess_stops_reading_and_the_ledger_adds_up(tmp_path):
    """Guesses still being read when the real plan comes are told to stop after their current
    slice; whatever they read is wasted_bytes, never a cached expert, and io = payload + wasted."""
    path, spec1 = _big_expert_file(tmp_path, n_experts=8)
    spec = {0: spec1[0], 1: spec1[0] * 3}      # layer 1: three projections over the same bytes
    with ExpertStore(spec, cache_mib=64, keep="quantized", map_misses=False, read_threads=2) as store:
        store.prefetch(1, [0, 1, 2, 3, 4, 5])
        store.plan(1, [6, 7])                  # none guessed right: every guess is dropped
        got = store.get(1, [6, 7])
        store.clear()                          # waits for the stopped reads
        s = store.stats()
        assert s.bytes_read == 2 * store.expert_nbytes(1) and s.prefetch_used == 0
        assert s.io_bytes == s.bytes_read + s.wasted_bytes
        assert s.wasted_bytes <= s.prefetched * store.expert_nbytes(1)
        assert store._cache.in_flight == 0 and not store._stops
    with ExpertStore(spec, cache_mib=64, keep="quantized", map_misses=False, read_ahead=False) as plain:
        want = plain.get(1, [6, 7])
    for e in (6, 7):
        assert [bytes(w.raw.numpy()) for w in got[e]] == [bytes(w.raw.numpy()) for w in want[e]]


def test_a_stopped_read_reports_what_it_read(tmp_path):
    from k3kit.runtime.experts.store import _Stopped
    path, spec1 = _big_expert_file(tmp_path, n_experts=2)
    with ExpertStore(spec1, cache_mib=64, keep="quantized", map_misses=False) as store:
        stop = threading.Event()
        stop.set()
        buffers = [store._buffer(t, 1) for t in store.layers[0]]
        with pytest.raises(_Stopped) as err:
            store._read_expert(0, 1, buffers, stop)
        assert (err.value.io_bytes, err.value.payload) == (0, 0)


@pytest.mark.parametrize("precision", [0.0, 0.5])
def test_prefetch_is_scored_and_read_only_while_it_guesses_well_enough(tmp_path, precision):
    """Each hint is scored against the plan that follows (read or not). With prefetch_precision
    (default 0.5), hints stop being read once fewer than that share were right, and are still
    scored; with 0 every hint is read."""
    from k3kit.runtime.experts.store import PRECISION_WARMUP
    path, spec1 = _big_expert_file(tmp_path, n_experts=8)
    spec = {0: spec1[0], 1: spec1[0]}
    with ExpertStore(spec, cache_mib=64, keep="quantized", map_misses=False, read_threads=1,
                     prefetch_precision=precision) as store:
        rounds = PRECISION_WARMUP // 4
        for _ in range(rounds):
            store.plan(0, [0])
            store.prefetch(1, [0, 1, 2, 3])        # one right of four: precision 0.25
            store.plan(1, [3, 4])
        s = store.stats()
        assert (s.guesses, s.guesses_right) == (4 * rounds, rounds)
        store.plan(0, [0])
        store.prefetch(1, [5, 6])
        queued = {k for k in (*store._queue, *store._pending) if k[0] == 1}
        assert queued == (set() if precision else {(1, 5), (1, 6)})
        store.plan(1, [5])
        assert store.stats().guesses == 4 * rounds + 2 and store.stats().guesses_right == rounds + 1
