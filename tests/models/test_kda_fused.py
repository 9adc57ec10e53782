"""The native KDA steps (kernels/_kda.c through kernels/kda_step.py) against the torch steps.

What the serving path and the speculative runtime rely on: the native steps compute the torch
recurrence to float32 rounding; a sequence gets the same bits alone or batched with others, for
any thread count and SIMD level, in one call of T rows or T calls of one row, in place or not;
and inference (delta_rule, commit_rows) takes them while training keeps the torch steps.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3kit.kernels import kda_step
from k3kit.models.kimi_k3 import kda as kda_mod
from k3kit.models.kimi_k3.kda import KDARows, commit_rows, delta_rule, delta_rule_torch, delta_step
from k3kit.models.kimi_k3.state import KDAState

pytestmark = pytest.mark.skipif(kda_step.available() == "none", reason="the _kda extension is not built")


def _inputs(B: int, T: int, H: int, dk: int, dv: int, seed: int = 0,
            dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    S = torch.randn(B, H, dk, dv, generator=gen, dtype=torch.float64) * 0.1
    q = F.normalize(torch.randn(B, T, H, dk, generator=gen, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(B, T, H, dk, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, dv, generator=gen, dtype=torch.float64)
    g = -5.0 * torch.rand(B, T, H, dk, generator=gen, dtype=torch.float64) ** 4
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    return tuple(t.to(dtype) for t in (S, q, k, v, g, beta))


# dv 128 (K3), a tail past the last full vector (40, 200), dk != dv, one column
GEOMETRIES = [(128, 128), (32, 40), (64, 200), (16, 1)]


@pytest.mark.parametrize("dk,dv", GEOMETRIES)
def test_native_matches_float64_recurrence(dk, dv):
    x64 = _inputs(2, 5, 3, dk, dv, dtype=torch.float64)
    o64, S64 = delta_rule_torch(*x64)
    S, q, k, v, g, beta = (t.float() for t in x64)
    o32, S32 = delta_rule_torch(S, q, k, v, g, beta)
    for simd in (0, 1, 2):
        o, S_new = kda_step.rows(S, k, v, g, beta, q, simd=simd)
        assert o is not None
        # the float32 torch steps' own distance from float64, with a little room for the other order
        tol_o = 4 * (o32.double() - o64).abs().max().item() + 1e-6
        tol_S = 4 * (S32.double() - S64).abs().max().item() + 1e-6
        assert (o.double() - o64).abs().max().item() <= tol_o
        assert (S_new.double() - S64).abs().max().item() <= tol_S


@pytest.mark.parametrize("dk,dv", GEOMETRIES)
def test_same_bits_every_level_and_thread_count(dk, dv):
    S, q, k, v, g, beta = _inputs(3, 4, 5, dk, dv, seed=1)
    o_ref, S_ref = kda_step.rows(S, k, v, g, beta, q, simd=0, threads=1)
    assert o_ref is not None
    for simd in (0, 1, 2, -1):
        for threads in (1, 2, 3, 16):
            o, S_new = kda_step.rows(S, k, v, g, beta, q, simd=simd, threads=threads)
            assert o is not None
            assert torch.equal(o, o_ref) and torch.equal(S_new, S_ref), (simd, threads)


def test_sequence_alone_equals_batched():
    S, q, k, v, g, beta = _inputs(5, 3, 4, 128, 128, seed=2)
    o_all, S_all = kda_step.rows(S, k, v, g, beta, q)
    assert o_all is not None
    for b in range(5):
        s = slice(b, b + 1)
        o_b, S_b = kda_step.rows(S[s], k[s], v[s], g[s], beta[s], q[s], threads=1)
        assert o_b is not None
        assert torch.equal(o_b, o_all[s]) and torch.equal(S_b, S_all[s])


def test_rows_in_one_call_equal_row_by_row_and_in_place():
    S, q, k, v, g, beta = _inputs(2, 6, 3, 64, 64, seed=3)
    before = S.clone()
    o_all, S_all = kda_step.rows(S, k, v, g, beta, q)
    assert o_all is not None
    assert torch.equal(S, before)                       # not in place: the caller's S untouched
    state = S.clone()
    for t in range(6):
        o_t, out = kda_step.rows(state, k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1],
                                 q[:, t:t + 1], inplace=True)
        assert o_t is not None and out.data_ptr() == state.data_ptr()
        assert torch.equal(o_t, o_all[:, t:t + 1])
    assert torch.equal(state, S_all)
    _, S_noq = kda_step.rows(S, k, v, g, beta)          # no query: the same state
    assert torch.equal(S_noq, S_all)


def test_in_place_on_a_stacked_view():
    # the serving path steps a batch tensor whose rows are the sequences' states
    S, q, k, v, g, beta = _inputs(4, 1, 2, 32, 32, seed=4)
    batch = S.clone()
    views = [batch[j:j + 1] for j in range(4)]
    o, out = kda_step.rows(batch, k, v, g, beta, q, inplace=True)
    _, ref = kda_step.rows(S, k, v, g, beta, q)
    assert out.data_ptr() == batch.data_ptr() and torch.equal(batch, ref)
    assert all(torch.equal(view, ref[j:j + 1]) for j, view in enumerate(views))
    with pytest.raises(ValueError, match="contiguous"):
        kda_step.rows(batch.transpose(2, 3), k, v, g, beta, q, inplace=True)


def test_delta_rule_takes_native_steps_in_inference_only(monkeypatch):
    S, q, k, v, g, beta = _inputs(2, 3, 2, 32, 32, seed=5)
    o_nat, S_nat = kda_step.rows(S, k, v, g, beta, q)
    with torch.no_grad():
        o, S_new = delta_rule(S, q, k, v, g, beta)
    assert torch.equal(o, o_nat) and torch.equal(S_new, S_nat)
    # in place: the caller's tensor is the returned state
    S_own = S.clone()
    with torch.no_grad():
        _, S_ret = delta_rule(S_own, q, k, v, g, beta, inplace=True)
    assert S_ret is S_own and torch.equal(S_own, S_nat)
    # a gradient: the torch steps, differentiable
    vg = v.clone().requires_grad_(True)
    o_g, _ = delta_rule(S, q, k, vg, g, beta)
    o_g.sum().backward()
    assert vg.grad is not None and torch.isfinite(vg.grad).all() and vg.grad.abs().sum() > 0
    assert not kda_step.usable(S, vg)
    # float64 and the switch: the torch steps
    assert not kda_step.usable(S.double())
    monkeypatch.setattr(kda_mod, "NATIVE_STEPS", False)
    assert not kda_mod.native_steps(S)
    with torch.no_grad():
        o_t, S_t = delta_rule(S, q, k, v, g, beta)
        o_r, S_r = delta_rule_torch(S, q, k, v, g, beta)
    assert torch.equal(o_t, o_r) and torch.equal(S_t, S_r)


@pytest.mark.parametrize("n", [1, 3, 5])
def test_commit_replays_the_native_steps(n):
    # ReplaySSM: committing n of a verify block's rows leaves the state a plain decode of those
    # n rows (one row at a time) leaves, bit for bit
    S, q, k, v, g, beta = _inputs(1, 5, 3, 64, 64, seed=6)
    conv = torch.zeros(1, 3, 3, 3 * 64)
    with torch.no_grad():
        _, final = delta_rule(S, q, k, v, g, beta)
        rows = KDARows(torch.zeros(1, 5, 3, 3 * 64), k, v, g, beta, final)
        state = KDAState(S.clone(), conv.clone())
        commit_rows(state, rows, n)
        ref = S.clone()
        for t in range(n):
            delta_rule(ref, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1],
                       inplace=True)
    assert torch.equal(state.S, ref)


def test_native_step_matches_torch_step_closely():
    # one K3-sized step against delta_step (the torch reference of the update)
    S, q, k, v, g, beta = _inputs(2, 1, 4, 128, 128, seed=7)
    ref = delta_step(S, k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
    _, S_new = kda_step.rows(S, k, v, g, beta)
    assert (S_new - ref).abs().max().item() <= 1e-6 * ref.abs().max().item()


def test_bad_buffers_are_refused():
    from k3kit.kernels import _kda

    S, q, k, v, g, beta = (t.numpy() for t in _inputs(1, 1, 2, 8, 8))
    out = S.copy()
    with pytest.raises(ValueError, match="k buffer"):
        _kda.kda_rows(S, out, q, k[..., :4].copy(), v, g, beta, None, 1, 1, 2, 8, 8, 0.5)
    with pytest.raises(ValueError, match="bad dimensions"):
        _kda.kda_rows(S, out, q, k, v, g, beta, None, 1, 1, 2, 0, 8, 0.5)
    with pytest.raises(TypeError, match="may not be None"):
        _kda.kda_rows(S, out, q, None, v, g, beta, None, 1, 1, 2, 8, 8, 0.5)
