"""The native row-wise steps (k3kit.kernels.fused): ggml's norm arithmetic, batch invariance, and
agreement with the torch steps they replace."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from k3kit.kernels import fused
from k3kit.layers.norm import rms_norm
from k3kit.models.kimi_k3 import activations
from k3kit.models.kimi_k3.attn_res import res_mix

pytestmark = pytest.mark.skipif(not fused.available(), reason="the _fused extension is not built")

EPS = 1e-6


def ggml_rms_norm(x: np.ndarray, w: np.ndarray | None, eps: float, l2: bool = False) -> np.ndarray:
    """ggml's rms_norm: float squares summed in double (8 lanes, as _fused.c), the mean rounded to
    float, scale = 1 / sqrtf(mean + eps), y = x * scale * w, each step rounded to float32."""
    x = x.astype(np.float32)
    n = x.shape[-1]
    sq = (x * x).astype(np.float64)
    full = n - n % 8
    lanes = sq[..., :full].reshape(*x.shape[:-1], -1, 8).sum(axis=-2, dtype=np.float64) if full else \
        np.zeros((*x.shape[:-1], 8))
    tail = sq[..., full:]
    lanes = lanes.copy()
    lanes[..., :tail.shape[-1]] += tail
    total = np.zeros(x.shape[:-1])
    for lane in range(8):
        total = total + lanes[..., lane]
    if l2:
        scale = np.float32(1.0) / np.sqrt(total.astype(np.float32) + np.float32(eps))
    else:
        mean = (total / n).astype(np.float32)
        scale = np.float32(1.0) / np.sqrt(mean + np.float32(eps))
    y = x * scale.astype(np.float32)[..., None]
    return y if w is None else y * w.astype(np.float32)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.mark.parametrize("n", [7, 64, 256, 7168])
def test_rms_norm_is_ggml_arithmetic(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(5, n, generator=g) * 3
    w = torch.randn(n, generator=g)
    y = fused.rms_norm(x, w, EPS)
    assert y is not None
    assert np.array_equal(y.numpy(), ggml_rms_norm(x.numpy(), w.numpy(), EPS))
    torch_steps = x * torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS).reciprocal() * w
    torch.testing.assert_close(y, torch_steps, rtol=2e-6, atol=1e-6)
    l2 = fused.l2_norm(x, EPS)
    assert l2 is not None and np.array_equal(l2.numpy(), ggml_rms_norm(x.numpy(), None, EPS, l2=True))


def test_gated_norm_and_layouts():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 4, 64, generator=g)
    w, gate = torch.randn(64, generator=g), torch.rand(2, 3, 4, 64, generator=g)
    y = fused.rms_norm(x, w, EPS, gate)
    assert y is not None
    assert torch.equal(y, torch.from_numpy(ggml_rms_norm(x.numpy(), w.numpy(), EPS)) * gate)
    # a non-contiguous view gets the same bits as its contiguous copy
    big = torch.randn(3, 128, generator=g)
    view = big[:, ::2]
    assert not view.is_contiguous()
    assert torch.equal(fused.rms_norm(view, None, EPS), fused.rms_norm(view.contiguous(), None, EPS))


def test_rows_are_the_same_alone_in_company_and_on_any_thread_count():
    g = torch.Generator().manual_seed(2)
    n, rows = 512, 300          # rows * n past the threading threshold
    x, w = torch.randn(rows, n, generator=g), torch.randn(n, generator=g)
    bank = [torch.randn(rows, n, generator=g) for _ in range(3)]
    up = torch.randn(rows, n, generator=g)
    threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2):
            torch.set_num_threads(t)
            outs.append((fused.rms_norm(x, w, EPS), fused.res_mix(bank, x, w, EPS),
                         fused.situ(x, up, 2.0, 3.0)))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
    for r in (0, 17, rows - 1):
        one = slice(r, r + 1)
        assert torch.equal(fused.rms_norm(x[one], w, EPS), outs[0][0][one])
        assert torch.equal(fused.res_mix([b[one] for b in bank], x[one], w, EPS), outs[0][1][one])
        assert torch.equal(fused.situ(x[one], up[one], 2.0, 3.0), outs[0][2][one])


def _torch_res_mix(bank, cur, w, eps):
    both = torch.stack((*bank, cur), dim=-2)
    normed = both * torch.sqrt(both.pow(2).mean(-1, keepdim=True) + eps).reciprocal()
    probs = torch.softmax((normed * w).sum(-1), dim=-1)
    return (both[..., :-1, :] * probs[..., :-1, None]).sum(-2) + cur * probs[..., -1:]


@pytest.mark.parametrize("n_bank", [1, 2, 5])
def test_res_mix_agrees_with_the_torch_steps(n_bank):
    g = torch.Generator().manual_seed(n_bank)
    cur = torch.randn(2, 3, 96, generator=g)
    bank = [torch.randn(2, 3, 96, generator=g) for _ in range(n_bank)]
    w = torch.randn(96, generator=g) * 0.3
    y = res_mix(bank, cur, w, EPS)
    torch.testing.assert_close(y, _torch_res_mix(bank, cur, w, EPS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("linear_beta", [0.0, 4.0])
def test_situ_agrees_with_the_torch_steps(linear_beta):
    g = torch.Generator().manual_seed(3)
    gate, up = torch.randn(1000, generator=g) * 6, torch.randn(1000, generator=g) * 6
    y = activations.situ(gate, up, 3.0, linear_beta)
    a = torch.tanh(gate * (1.0 / 3.0)) * 3.0 * torch.sigmoid(gate)
    u = torch.tanh(up * (1.0 / linear_beta)) * linear_beta if linear_beta > 0 else up
    torch.testing.assert_close(y, a * u, rtol=1e-5, atol=1e-6)


def test_torch_runs_where_the_native_step_does_not():
    x = torch.randn(4, 32)
    with torch.enable_grad():
        assert fused.rms_norm(x, None, EPS) is None and fused.situ(x, x, 1.0, 0.0) is None
        p = torch.ones(32, requires_grad=True)
        y = rms_norm(x, p, EPS)
        assert y.requires_grad                   # training keeps torch's differentiable ops
    assert fused.rms_norm(x.double(), None, EPS) is None
    assert fused.res_mix([], x, torch.ones(32), EPS) is None
    assert fused.rms_norm(x, torch.ones(16), EPS) is None           # a weight of another width


def test_short_conv_agrees_with_the_torch_convs_and_steps_row_by_row():
    import torch.nn.functional as F

    from k3kit.models.kimi_k3.kda import causal_conv
    g = torch.Generator().manual_seed(4)
    B, T, C, K = 2, 5, 48, 4
    window, x = torch.randn(B, 3, K - 1, C, generator=g), torch.randn(B, T, 3, C, generator=g)
    w = torch.randn(3, C, K, generator=g)                  # q/k/v conv weights [C, K] each
    got = fused.short_conv(window, x, w.transpose(1, 2).contiguous())
    assert got is not None
    out, new_window = got
    for i in range(3):
        y, win = causal_conv(window[:, i], x[:, :, i], w[i])
        torch.testing.assert_close(out[i], F.silu(y), rtol=1e-5, atol=1e-6)
        assert torch.equal(new_window[:, i], win)         # the window is copied, never rounded
    # one row at a time, the window carried along: the same bits as the block
    win, rows = window, []
    for t in range(T):
        o, win = fused.short_conv(win, x[:, t:t + 1], w.transpose(1, 2).contiguous())
        rows.append(o)
    assert torch.equal(torch.cat(rows, dim=2), out) and torch.equal(win, new_window)


def test_short_conv_reads_a_strided_view_in_place_with_the_same_bits():
    """conv_in as a [B, T, 3, C] view of [3, B*T, C] projections (what one fused product call
    returns) is read through its strides, not copied; a view with uneven rows is made contiguous."""
    g = torch.Generator().manual_seed(5)
    B, T, C, K = 3, 4, 40, 4
    window, planar = torch.randn(B, 3, K - 1, C, generator=g), torch.randn(3, B * T, C, generator=g)
    taps = torch.randn(3, K, C, generator=g)
    view = planar.as_strided((B, T, 3, C), (T * C, C, B * T * C, 1))
    assert not view.is_contiguous()
    want = fused.short_conv(window, view.contiguous(), taps)
    got = fused.short_conv(window, view, taps)
    assert want is not None and got is not None
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    rows = view[:, 1:3]                       # rows of a batch 2 apart: not evenly strided across b
    cut = fused.short_conv(window, rows, taps)
    ref = fused.short_conv(window, rows.contiguous(), taps)
    assert cut is not None and ref is not None and torch.equal(cut[0], ref[0])


def test_situ_is_within_float_rounding_of_the_exact_function_and_its_tail_is_not_special():
    x = torch.cat([torch.linspace(-30, 30, 200001), torch.linspace(-1e-3, 1e-3, 10001)])
    y = fused.situ(x, torch.ones_like(x), 1.0, 0.0)
    exact = torch.tanh(x.double()) * torch.sigmoid(x.double())
    assert ((y.double() - exact).abs() / exact.abs().clamp_min(1e-30)).max() < 1e-6
    # a value's bits do not depend on where it sits (vector body or padded tail) nor on the length
    for n in (1, 3, 8, 13, 100):
        assert torch.equal(fused.situ(x[:n], torch.ones(n), 1.0, 0.0), y[:n])
        assert torch.equal(fused.situ(x[-n:], torch.ones(n), 1.0, 0.0), y[-n:])


def test_slot_sum_has_the_bits_of_the_torch_scatter_and_slot_sum():
    from k3kit.layers.moe import _sum_slots, group_routes
    g = torch.Generator().manual_seed(5)
    N, k, E, d = 7, 3, 5, 24
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    weights = torch.rand(N, k, generator=g)
    groups = group_routes(ids)
    y = torch.randn(N * k, d, generator=g)
    slots = torch.zeros(N, k, d)
    slots.index_put_((groups.rows, groups.cols), y * weights[groups.rows, groups.cols, None])
    assert torch.equal(fused.slot_sum(y, groups.order, weights), _sum_slots(slots))
    with pytest.raises(ValueError, match="permutation"):
        fused.slot_sum(y, torch.zeros(N * k, dtype=torch.int64), weights)


@pytest.mark.parametrize("heads, hd, rd", [(4, 64, 64), (2, 128, 64), (3, 16, 16)])
def test_rope_has_the_bits_of_the_torch_steps(heads, hd, rd):
    from k3kit.layers.rope import inv_freq, rope_table
    g = torch.Generator().manual_seed(heads)
    x = torch.randn(9, heads, hd, generator=g) * 3
    t = rope_table(torch.arange(1000, 1009), inv_freq(rd, 10000.0), 1.2, torch.float32)
    xr, xp = x[..., :rd], x[..., rd:]
    rot = torch.cat([-xr[..., rd // 2:], xr[..., : rd // 2]], dim=-1)
    want = torch.cat([xr * t.cos + rot * t.sin, xp], dim=-1)
    got = fused.rope_neox(x, t.cos, t.sin)
    assert got is not None and torch.equal(got, want)
    assert torch.equal(t.apply(x), want)
    # a row alone has its bits in company; a strided input is read as its values
    assert torch.equal(fused.rope_neox(x[3:4], t.cos[3:4], t.sin[3:4]), want[3:4])
    wide = torch.randn(9, heads, 2 * hd, generator=g)
    wide[..., :hd] = x
    assert torch.equal(fused.rope_neox(wide[..., :hd], t.cos, t.sin), want)
    with torch.enable_grad():
        assert fused.rope_neox(x.requires_grad_(), t.cos, t.sin) is None


def _markov_reference(base: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, anchor: int):
    """The chain row by row in float64 (tokens) and torch's float32 (rows)."""
    toks, rows, prev = [], [], anchor
    for k in range(base.shape[0]):
        row = base[k] + w2 @ w1[prev]
        rows.append(row)
        prev = int(torch.argmax(base[k].double() + w2.double() @ w1[prev].double()))
        toks.append(prev)
    return toks, torch.stack(rows)


@pytest.mark.parametrize("V, r", [(4096, 32), (1000, 8), (77, 5)])
def test_markov_greedy_chain_follows_the_row_by_row_chain(V, r):
    g = torch.Generator().manual_seed(V)
    base = torch.randn(7, V, generator=g) * 4
    w1, w2 = torch.randn(V, r, generator=g), torch.randn(V, r, generator=g) / r ** 0.5
    out = fused.markov_greedy(base, w1, w2.t().contiguous(), 5)
    assert out is not None
    toks, rows, w1s = out
    want_toks, want_rows = _markov_reference(base, w1, w2, 5)
    assert toks.tolist() == want_toks
    torch.testing.assert_close(rows, want_rows, rtol=1e-5, atol=1e-5)
    assert torch.equal(w1s, w1[torch.tensor([5, *want_toks[:-1]])])
    # each row is the argmax of what it returns, and the same block gives the same bits again
    assert torch.equal(toks, rows.argmax(-1))
    again = fused.markov_greedy(base.clone(), w1, w2.t().contiguous(), 5)
    assert again is not None and torch.equal(again[1], rows)


def test_markov_greedy_ties_and_nan_pick_as_torch_argmax():
    V, r = 16, 2
    base = torch.zeros(3, V)
    base[0, [3, 9]] = 5.0                   # equal maxima: the first
    base[1, 6] = float("nan")               # a NaN wins
    base[2, [1, 2]] = float("inf")
    w1, w2t = torch.zeros(V, r), torch.zeros(r, V)
    out = fused.markov_greedy(base, w1, w2t, 0)
    assert out is not None
    assert out[0].tolist() == [3, 6, 1] == torch.argmax(base, -1).tolist()
    assert fused.markov_greedy(base.bfloat16(), w1, w2t, 0) is None
    assert fused.markov_greedy(base, w1, w2t, V) is None          # an anchor outside the table


def _bits(allowed: torch.Tensor, W: int) -> torch.Tensor:
    """A bool row [V] as an int32 bitmask of W words (bit t % 32 of word t // 32)."""
    out = torch.zeros(W, dtype=torch.int64)
    for t in allowed.nonzero().flatten().tolist():
        if t < 32 * W:
            out[t >> 5] |= 1 << (t & 31)
    return torch.where(out >= 2 ** 31, out - 2 ** 32, out).to(torch.int32)


@pytest.mark.parametrize("V, r", [(4096, 32), (1000, 8), (77, 5)])
def test_markov_masked_row_is_the_chains_row_and_picks_the_best_allowed_token(V, r):
    """One row under a bitmask: the row has markov_greedy's bits; the token is the argmax where
    the mask allows it, else the best allowed token (torch's argmax of the masked row)."""
    g = torch.Generator().manual_seed(V + r)
    base = torch.randn(6, V, generator=g) * 4
    w1, w2 = torch.randn(V, r, generator=g), torch.randn(V, r, generator=g) / r ** 0.5
    w2t = w2.t().contiguous()
    W = (V + 31) // 32
    prev, forbidden_best = 3, 0
    for k in range(base.shape[0]):
        want = fused.markov_greedy(base[k:k + 1], w1, w2t, prev)
        assert want is not None
        row = want[1][0]
        allowed = torch.rand(V, generator=g) < (0.02 if k % 2 else 0.5)
        allowed[int(torch.randint(V, (1,), generator=g))] = True
        forbidden_best += not bool(allowed[int(row.argmax())])
        out = fused.markov_masked(base[k], w1, w2t, prev, _bits(allowed, W))
        assert out is not None
        tok, got_row, w1row = out
        assert torch.equal(got_row, row) and torch.equal(w1row, w1[prev])
        assert tok == int(torch.argmax(row.masked_fill(~allowed, float("-inf"))))
        prev = tok
    assert forbidden_best >= 2           # the masked pick was tested, not only the argmax


def test_markov_masked_ties_nan_words_and_nothing_allowed():
    V, r = 70, 2
    w1, w2t = torch.zeros(V, r), torch.zeros(r, V)
    base = torch.zeros(V)
    base[[3, 9, 40]] = 5.0
    every = torch.ones(V, dtype=torch.bool)
    assert fused.markov_masked(base, w1, w2t, 0, _bits(every, 3))[0] == 3         # equal maxima: the first
    no3 = every.clone()
    no3[3] = False
    assert fused.markov_masked(base, w1, w2t, 0, _bits(no3, 3))[0] == 9
    assert fused.markov_masked(base, w1, w2t, 0, _bits(every, 1))[0] == 3     # tokens past 32 W: not allowed
    assert fused.markov_masked(base, w1, w2t, 0, _bits(torch.arange(V) >= 32, 1))[0] == 0   # none allowed
    nan = base.clone()
    nan[[12, 50]] = float("nan")
    assert fused.markov_masked(nan, w1, w2t, 0, _bits(every, 3))[0] == 12         # a NaN wins, as in argmax
    no12 = every.clone()
    no12[12] = False
    assert fused.markov_masked(nan, w1, w2t, 0, _bits(no12, 3))[0] == 50
    assert fused.markov_masked(base, w1, w2t, V, _bits(every, 3)) is None         # a token outside the table
    assert fused.markov_masked(base, w1, w2t, 0, _bits(every, 3).long()) is None  # bits not int32


@pytest.mark.parametrize("R,V,W", [(1, 4096, 128), (8, 4096, 128), (3, 5000, 128), (2, 100, 5), (2, 37, 1)])
def test_apply_bitmask_gives_the_torch_ops_values(R, V, W, monkeypatch):
    from k3kit.runtime import constraint
    g = torch.Generator().manual_seed(R * V + W)
    rows = torch.randn(R, V + 3, generator=g)[:, :V]           # strided rows: taken contiguous
    rows[0, 0] = float("nan")
    bits = torch.randint(-2**31, 2**31 - 1, (R, W), dtype=torch.int32, generator=g)
    with torch.no_grad():
        native = fused.apply_bitmask(rows, bits)
        assert native is not None and native.shape == (R, V)
        monkeypatch.setattr(fused, "_fused", None)
        torch_ops = constraint.apply_bitmask(rows, bits)        # the ops it replaces
    assert torch.equal(native.isnan(), torch_ops.isnan())
    assert torch.equal(native.nan_to_num(), torch_ops.nan_to_num())
    assert bool(torch.isinf(native[:, 32 * W:]).all())          # past the mask's last word: off


def _ibits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("n", [1, 7, 64, 256, 4099])
def test_add_mul_scale_have_the_bits_of_torch_add_and_mul(n):
    """The row step's residual adds and KDA's gate arithmetic: each element one IEEE operation,
    as torch's add and mul of float32 tensors (and a Python scalar taken as its float32), over
    ordinary, tiny (subnormal), huge, signed-zero, infinite and NaN values, in place too."""
    g = torch.Generator().manual_seed(n)
    a, b = torch.randn(n, generator=g) * 1e3, torch.randn(n, generator=g)
    special = torch.tensor([1e-40, -0.0, 3e38, float("inf"), float("nan"), -1e-45, 0.1])
    a[: min(n, 7)] = special[: min(n, 7)]
    b[-min(n, 7):] = special.flip(0)[: min(n, 7)]
    F = fused._fused
    y = torch.empty(n)
    F.add(a.data_ptr(), b.data_ptr(), y.data_ptr(), n)
    assert torch.equal(_ibits(y), _ibits(a + b))
    F.mul(a.data_ptr(), b.data_ptr(), y.data_ptr(), n)
    assert torch.equal(_ibits(y), _ibits(a * b))
    c = a.clone()
    F.add(c.data_ptr(), b.data_ptr(), c.data_ptr(), n)            # y may be a
    assert torch.equal(_ibits(c), _ibits(a + b))
    for lb in (-5.0, 0.1, 1 / 3):                                  # a tensor times a Python float
        s = torch.tensor([lb], dtype=torch.float32)
        F.scale(a.data_ptr(), s.data_ptr(), y.data_ptr(), 1, n)
        assert torch.equal(_ibits(y), _ibits(a * lb))


def test_scale_multiplies_each_row_by_its_own_float_as_a_broadcast_mul():
    """u [1, 1, H, D] * (-A) [H, 1] (KDA's decay before its sigmoid) row by row."""
    g = torch.Generator().manual_seed(3)
    H, D = 5, 64
    u, neg = torch.randn(1, 1, H, D, generator=g), -torch.rand(H, 1, generator=g).exp()
    y = torch.empty(1, 1, H, D)
    fused._fused.scale(u.data_ptr(), neg.data_ptr(), y.data_ptr(), H, D)
    assert torch.equal(_ibits(y), _ibits(u * neg))


def test_elementwise_steps_refuse_null_buffers_and_negative_sizes():
    x = torch.zeros(4)
    with pytest.raises(ValueError, match="add"):
        fused._fused.add(0, x.data_ptr(), x.data_ptr(), 4)
    with pytest.raises(ValueError, match="mul"):
        fused._fused.mul(x.data_ptr(), x.data_ptr(), x.data_ptr(), -1)
    with pytest.raises(ValueError, match="scale"):
        fused._fused.scale(x.data_ptr(), 0, x.data_ptr(), 1, 4)


def test_copy_rows_copies_strided_rows_as_a_concatenation():
    """MLA's query pieces per head: q_nope out of [H, qk] rows, then (q_abs, q_pe) side by side."""
    g = torch.Generator().manual_seed(5)
    H, nope, pe, L = 3, 32, 16, 48
    q = torch.randn(H, nope + pe, generator=g)
    q_abs = torch.randn(H, L, generator=g)
    F = fused._fused
    nope_c = torch.empty(H, nope)
    F.copy_rows(q.data_ptr(), nope + pe, nope_c.data_ptr(), nope, H, nope)
    assert torch.equal(nope_c, q[:, :nope])
    Q = torch.empty(H, L + pe)
    F.copy_rows(q_abs.data_ptr(), L, Q.data_ptr(), L + pe, H, L)
    F.copy_rows(q.data_ptr() + nope * 4, nope + pe, Q.data_ptr() + L * 4, L + pe, H, pe)
    assert torch.equal(Q, torch.cat((q_abs, q[:, nope:]), dim=-1))
    with pytest.raises(ValueError, match="copy_rows"):
        F.copy_rows(q.data_ptr(), 4, Q.data_ptr(), L + pe, H, 8)     # a stride shorter than a row


def test_add_and_scale_broadcast_as_torch_does():
    """u = f_b rows + dt_bias [C] (add with nb), then u [T, H, D] * (-A) [H, 1] (scale with a
    period of H): torch's broadcast add and mul, bit for bit."""
    g = torch.Generator().manual_seed(9)
    T, H, D = 6, 4, 32
    fb, bias = torch.randn(T, H * D, generator=g), torch.randn(H * D, generator=g)
    neg = -torch.rand(H, 1, generator=g).exp()
    F = fused._fused
    u = torch.empty(T, H * D)
    F.add(fb.data_ptr(), bias.data_ptr(), u.data_ptr(), T * H * D, H * D)
    assert torch.equal(_ibits(u), _ibits(fb + bias))
    y = torch.empty(T, H, D)
    F.scale(u.data_ptr(), neg.data_ptr(), y.data_ptr(), T * H, D, H)
    assert torch.equal(_ibits(y), _ibits(u.view(T, H, D) * neg))
    assert torch.equal(_ibits(y), _ibits(-(u.view(T, H, D) * -neg)))    # the module's -(u * A)
    with pytest.raises(ValueError, match="add"):
        F.add(fb.data_ptr(), bias.data_ptr(), u.data_ptr(), T * H * D, H * D - 1)   # rows not whole
