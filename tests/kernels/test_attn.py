"""MLA attention's native products (k3kit.kernels.attn, `_attn.c`, AVX-512): equal to float64
products within float32 rounding for shapes with every kind of tail and strided rows; each
output's bits fixed by its row and column (the same for any subset of rows and any thread
count); `attend` gives the torch path's values with them; where they cannot run, False."""

from __future__ import annotations

import pytest
import torch

from k3kit.kernels import attn
from k3kit.models.kimi_k3 import mla

pytestmark = pytest.mark.skipif(not attn.available(), reason="needs the _attn extension and AVX-512F")

SHAPES = [(1, 1, 1), (5, 7, 3), (6, 160, 32), (13, 160, 33), (218, 160, 300), (7, 64, 129)]


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_scores_and_values_match_float64(m, k, n):
    g = torch.Generator().manual_seed(m * 1000 + k * 10 + n)
    q = torch.randn(m, k + 3, generator=g)[:, :k]            # strided rows
    keys = torch.randn(n, k + 5, generator=g)[:, :k]
    out = torch.empty(m, n)
    assert attn.scores(q, attn.keys(keys), n, out, 0.125)
    ref = q.double() @ keys.double().T * 0.125
    assert torch.allclose(out.double(), ref, rtol=0, atol=1e-5 * ref.abs().max().item() + 1e-12)
    p = torch.rand(m, n, generator=g)
    v = torch.randn(n, k + 2, generator=g)[:, :k]
    o = torch.full((m, k), float("nan"))
    assert attn.values(p, v, o)
    ref = p.double() @ v.double()
    assert torch.allclose(o.double(), ref, rtol=0, atol=1e-5 * ref.abs().max().item() + 1e-12)


def test_an_outputs_bits_depend_on_its_row_and_column_alone():
    g = torch.Generator().manual_seed(7)
    m, k, n = 50, 160, 700
    q, keys = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    p, v = torch.rand(m, n, generator=g), torch.randn(n, 128, generator=g)
    whole_s, whole_v = torch.empty(m, n), torch.empty(m, 128)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        attn.scores(q, attn.keys(keys), n, whole_s, 0.3)
        attn.values(p, v, whole_v)
        torch.set_num_threads(1)
        for a, b in [(0, 1), (3, 10), (17, 50)]:
            part_s, part_v = torch.empty(b - a, n), torch.empty(b - a, 128)
            attn.scores(q[a:b], attn.keys(keys), n, part_s, 0.3)
            attn.values(p[a:b], v, part_v)
            assert torch.equal(part_s, whole_s[a:b]) and torch.equal(part_v, whole_v[a:b])
        cols = torch.empty(m, 40)
        attn.scores(q, attn.keys(keys[100:140]), 40, cols, 0.3)
        assert torch.equal(cols, whole_s[:, 100:140])
    finally:
        torch.set_num_threads(threads)


def test_refused_where_it_cannot_run():
    q, keys, out = torch.randn(4, 8), torch.randn(5, 8), torch.empty(4, 5)
    packed = attn.keys(keys)
    assert packed is not None and attn.keys(keys.double()) is None
    assert not attn.scores(q.double(), packed, 5, out.double(), 1.0)
    assert not attn.scores(q.T.contiguous().T, packed, 5, out, 1.0)     # columns not unit-stride
    assert not attn.scores(q, packed, 5, torch.empty(4, 6), 1.0)
    assert not attn.scores(q, packed[1:], 5, out, 1.0)                  # not the keys' packing
    with torch.enable_grad():
        assert not attn.scores(q, packed, 5, out, 1.0)


def test_attend_gives_the_torch_paths_values(monkeypatch):
    g = torch.Generator().manual_seed(3)
    B, T, H, C, L, offset = 2, 40, 2, 160, 128, 300
    Q = torch.randn(B, T, H, C, generator=g)
    K = torch.randn(B, offset + T, C, generator=g)
    native = mla.attend(Q, K, K[..., :L], offset, 0.125)
    monkeypatch.setattr(attn, "_AVAILABLE", False)
    plain = mla.attend(Q, K, K[..., :L], offset, 0.125)
    assert torch.allclose(native, plain, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows,n,heads,first",
                         [(200, 5239, 2, 9999), (12, 100, 2, 95), (8, 33, 4, 1), (3, 17, 1, 16)])
def test_causal_softmax_matches_torchs_masked_softmax(rows, n, heads, first):
    g = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, n, generator=g) * 5
    y = x.clone()
    assert attn.softmax(y, heads, first)
    s = x.clone().view(rows // heads, heads, n)
    if first < n:
        future = torch.ones(rows // heads, n - first, dtype=torch.bool).triu()
        s[..., first:].masked_fill_(future[:, None, :], float("-inf"))
    ref = torch.softmax(s.double(), dim=-1).view(rows, n)
    assert torch.equal(y == 0, ref == 0)                  # the masked columns are 0, the rest not
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-9)
    assert torch.allclose(y.sum(-1), torch.ones(rows), atol=1e-5)
    part = x[heads:].clone()                              # a row's bits: its values and its limit alone
    attn.softmax(part, heads, first + 1)
    assert torch.equal(part, y[heads:])


def test_the_workspace_is_kept_per_thread_and_slot_up_to_its_limit(monkeypatch):
    import threading
    a = attn.workspace(1000, "t-a")
    assert a.numel() == 1000 and a.dtype is torch.float32
    assert attn.workspace(800, "t-a").data_ptr() == a.data_ptr()        # kept: no new pages
    assert attn.workspace(800, "t-b").data_ptr() != a.data_ptr()        # another slot, another buffer
    other: list[int] = []
    t = threading.Thread(target=lambda: other.append(attn.workspace(800, "t-a").data_ptr()))
    t.start()
    t.join()
    assert other[0] != a.data_ptr()                                     # another thread, another buffer
    grown = attn.workspace(2000, "t-a")
    assert grown.numel() == 2000 and attn.workspace(1500, "t-a").data_ptr() == grown.data_ptr()
    monkeypatch.setattr(attn, "WORKSPACE_KEEP", 100)
    assert attn.workspace(5000, "t-a").numel() == 5000                  # past the limit: fresh, not kept
    assert attn.workspace(1500, "t-a").data_ptr() == grown.data_ptr()


def test_attend_takes_its_scores_and_keys_from_the_workspace():
    g = torch.Generator().manual_seed(4)
    Q = torch.randn(1, 40, 2, 160, generator=g)
    K = torch.randn(1, 340, 160, generator=g)
    first = mla.attend(Q, K, K[..., :128], 300, 0.125)
    attn.workspace(1 << 16, "scores").fill_(float("nan"))                 # garbage left by another call
    attn.workspace(1 << 16, "keys0").fill_(float("nan"))
    assert torch.equal(mla.attend(Q, K, K[..., :128], 300, 0.125), first)
