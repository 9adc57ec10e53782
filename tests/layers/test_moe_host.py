"""A decode step's MoE bookkeeping on the host: routings grouped by a Python sort, experts read
where their rows are (`experts_q8`'s `rows`), slot sums ordered by a host list, products called
with addresses, an adapter's experts fetched in one store call, and a quantized dense FFN's gate
and up in one product. Each is checked against the way it replaces, bit for bit."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_moe_fused import H, make_store
from test_quantized_linear import ggml_weight

from k3kit.adapters.store_experts import StoreExperts
from k3kit.kernels import fused, qmatmul
from k3kit.layers import moe as moe_mod
from k3kit.layers.moe import group_routes
from k3kit.layers.quantized_linear import QuantizedLinear, fused_products
from k3kit.models.kimi_k3.config import tiny_config
from k3kit.models.kimi_k3.moe import DenseFFN

native = pytest.mark.skipif(not qmatmul.native_available() or not hasattr(qmatmul._qmatmul, "experts_q8"),
                            reason="the native kernels are not built")


@pytest.mark.parametrize("n,k,experts", [(1, 4, 32), (7, 4, 6), (16, 8, 3), (128, 4, 64), (200, 4, 9)])
def test_host_grouping_equals_the_device_sort(n, k, experts, monkeypatch):
    g = torch.Generator().manual_seed(n * 31 + k)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n)])
    host = group_routes(ids)
    monkeypatch.setattr(moe_mod, "HOST_GROUP_PAIRS", -1)      # every routing through argsort
    dev = group_routes(ids)
    assert (host.host_order is not None) == (n * k <= 512) and dev.host_order is None
    assert host.experts == dev.experts and host.counts == dev.counts
    for name in ("order", "sorted_ids", "rows", "cols"):
        assert torch.equal(getattr(host, name), getattr(dev, name)), name
    if host.host_order is not None:
        assert host.host_rows == dev.rows.tolist()
    assert dev.host_rows is None


@native
@pytest.mark.parametrize("qtype", [T.MXFP4, T.Q4_K])
def test_experts_read_in_place_equal_a_gathered_copy(qtype):
    store = make_store(qtype, T.MXFP4)
    w = store.get(0, [1, 4, 7])
    mats = [[w[e][0], w[e][1]] for e in (1, 4, 7)]
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(3))
    rows, counts = [0, 3, 3, 1, 4, 0, 2], [2, 3, 2]
    gathered = qmatmul.experts_matmul_q8(mats, x[rows], counts)
    in_place = qmatmul.experts_matmul_q8(mats, x, counts, rows)
    assert torch.equal(gathered.view(torch.int32), in_place.view(torch.int32))
    assert gathered.abs().sum() > 0
    with pytest.raises(ValueError, match="outside x"):
        qmatmul.experts_matmul_q8(mats, x, counts, [0, 3, 3, 1, 5, 0, 2])
    with pytest.raises(ValueError):
        qmatmul.experts_matmul_q8(mats, x, counts, rows[:-1])


@native
def test_products_by_address_equal_products_by_buffer():
    m = QuantizedLinear(ggml_weight(T.Q8_0, 256, 96), arith="ggml").matrix
    assert m is not None
    x = torch.randn(3, 256)
    by_buf, by_addr = torch.empty(3, 96), torch.empty(3, 96)
    q, path = qmatmul._qmatmul, qmatmul.I8_PATH
    q.matmul_q8(m._qtype_id, m._raw_np, qmatmul.buf(x), qmatmul.buf(by_buf), 96, 256, 3, -1, 1, 1, path)
    q.matmul_q8(m._qtype_id, m._raw_np, x.data_ptr(), by_addr.data_ptr(), 96, 256, 3, -1, 1, 1, path)
    assert torch.equal(by_buf, by_addr) and by_buf.abs().sum() > 0
    assert torch.equal(m.matmul(x), by_buf)
    with pytest.raises(ValueError, match="null address"):
        q.matmul_q8(m._qtype_id, m._raw_np, 0, by_addr.data_ptr(), 96, 256, 3)


@pytest.mark.skipif(not fused.available(), reason="the native kernels are not built")
@torch.no_grad()
def test_slot_sum_takes_a_host_order():
    g = torch.Generator().manual_seed(1)
    N, k, d = 3, 4, 64
    ids = torch.stack([torch.randperm(9, generator=g)[:k] for _ in range(N)])
    groups = group_routes(ids)
    y, w = torch.randn(N * k, d, generator=g), torch.rand(N, k, generator=g)
    assert groups.host_order is not None
    from_list = fused.slot_sum(y, groups.host_order, w)
    from_tensor = fused.slot_sum(y, groups.order, w)
    assert from_list is not None and from_tensor is not None and torch.equal(from_list, from_tensor)
    with pytest.raises(ValueError, match="permutation"):
        fused.slot_sum(y, [0] * (N * k), w)
    assert fused.slot_sum(y, groups.host_order[:-1], w) is None     # a count that does not fit


@native
def test_get_all_equals_one_get_per_expert():
    store = make_store(T.MXFP4, T.MXFP4)
    provider = StoreExperts(store, [torch.device("cpu")])
    each = [provider.get(0, e) for e in (2, 5, 11)]
    together = provider.get_all(0, [2, 5, 11])
    assert provider.requests == 6
    for a, b in zip(each, together, strict=True):
        assert all(x is y for x, y in zip(a, b, strict=True))   # the cache's own objects


@native
def test_quantized_dense_ffn_runs_gate_and_up_in_one_product():
    cfg = tiny_config()
    ffn = DenseFFN(cfg, 128)
    d = cfg.hidden_size
    ffn.gate_proj = QuantizedLinear(ggml_weight(T.Q8_0, d, 128, seed=1), arith="ggml")
    ffn.up_proj = QuantizedLinear(ggml_weight(T.Q8_0, d, 128, seed=2), arith="ggml")
    ffn.down_proj = QuantizedLinear(ggml_weight(T.Q8_0, 128, d, seed=3), arith="ggml")
    x = torch.randn(2, 3, d)
    with torch.no_grad():
        ffn.gate_proj(x), ffn.up_proj(x)                # the first products run the bytes' check
        assert fused_products((ffn.gate_proj, ffn.up_proj), x) is not None
        y = ffn(x)
        from k3kit.models.kimi_k3.activations import situ
        ref = ffn.down_proj(situ(ffn.gate_proj(x), ffn.up_proj(x), cfg.situ_beta, cfg.situ_linear_beta))
    assert y.shape == (2, 3, d) and torch.equal(y, ref) and y.abs().sum() > 0


def _file_store(path, **kw):
    from k3kit.runtime.experts import ExpertStore, ExpertTensor
    return ExpertStore({0: [ExpertTensor(path, 0, T.MXFP4, (256, 64), 6, "gate")]}, cache_mib=64,
                       keep="quantized", **kw)


@pytest.mark.parametrize("ahead", [True, False], ids=["read-ahead", "no-read-ahead"])
def test_get_resident_is_plan_and_get_in_one_step(tmp_path, ahead):
    """All cached and nothing read: the same weights, hits, recency and plan state as plan + get;
    anything else: None and nothing changed."""
    import numpy as np

    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 6 * 64 * 8 * 17, dtype=np.uint8)
    data.reshape(-1, 17)[:, 0] = 120
    path = tmp_path / "experts.bin"
    path.write_bytes(data.tobytes())
    with _file_store(path, read_ahead=ahead) as a, _file_store(path, read_ahead=ahead) as b:
        for s in (a, b):
            assert s.get_resident(0, [1, 4]) is None          # not cached yet: nothing done
            s.get(0, range(6))
            s.get(0, [2, 0])                                  # recency: 2 and 0 the latest
        assert a._reads_ahead(0) == ahead
        a.plan(0, [1, 4])
        want = a.get(0, [1, 4])
        got = b.get_resident(0, [1, 4])
        assert got is not None and len(got) == 2
        for e, w in zip([1, 4], got, strict=True):
            assert torch.equal(w[0].raw, want[e][0].raw)
        assert a.stats().hits == b.stats().hits and a.stats().misses == b.stats().misses
        assert a.stats().per_layer[0].hits == b.stats().per_layer[0].hits
        assert list(a._cache._entries) == list(b._cache._entries)
        assert a._cache.protect == b._cache.protect
        assert (a._planned, a._plan_order, a._plan_rank) == (b._planned, b._plan_order, b._plan_rank)
        if ahead:                                             # a guess for the layer: plan's work
            b.prefetch(0, [3])
            hits = b.stats().hits
            assert b.get_resident(0, [1, 4]) is None and b.stats().hits == hits
