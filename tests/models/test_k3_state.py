"""Sequence state: decode == full forward, MLA rollback by position, KDA capture + commit.

The tiny model (KDA, KDA, MLA, KDA, KDA, MLA; dense layer 0; attn-res block 2; conv 4)
over 13 tokens crosses three residual banks per token and several conv windows.
float64 runs check the algebra tightly (1e-9); float32 runs check what the engine uses,
with an absolute logit tolerance of 2e-3 (logits have std ~1; float32 round-off grows
through the RMS norms of small KDA and routed outputs).
"""

from __future__ import annotations

import pytest
import torch
from k3_model_helpers import decode, tiny_model, tokens

from k3kit.models.kimi_k3.kda import KDA, commit_rows, delta_rule
from k3kit.models.kimi_k3.state import KDAState

F64_TOL = 1e-9
F32_TOL = 2e-3


@pytest.mark.parametrize("chunks", [[1] * 13, [5, 1, 4, 3], [2, 11]])
def test_decode_with_state_equals_full_forward_f64(chunks):
    model = tiny_model(dtype=torch.float64)
    toks = tokens(model, 13, batch=2)
    with torch.no_grad():
        full = model(toks).logits
        got, state, _ = decode(model, toks, chunks)
    assert state.pos == 13
    assert (got - full).abs().max().item() < F64_TOL


def test_long_training_forward_uses_the_chunked_recurrence_and_matches_steps(monkeypatch):
    # with gradients on, 40 rows take the chunked KDA path; 5-row steps take the step loop
    import k3kit.models.kimi_k3.kda as kda_mod

    calls = []
    real = kda_mod.delta_rule_chunked
    monkeypatch.setattr(kda_mod, "delta_rule_chunked", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = tiny_model(dtype=torch.float64)
    toks = tokens(model, 40, seed=8)
    full = model(toks).logits.detach()
    assert len(calls) == sum(model.cfg.is_kda(i) for i in range(model.cfg.num_layers))
    chunked_state = model.new_state()
    model(toks, chunked_state)
    with torch.no_grad():
        got, _, _ = decode(model, toks, [5] * 8)
        _, step_state, _ = decode(model, toks, [5] * 8)
    assert (got - full).abs().max().item() < F64_TOL
    for a, b in zip(chunked_state.layers, step_state.layers, strict=True):
        if isinstance(a, KDAState):
            assert (a.S - b.S).abs().max().item() < 1e-12 and (a.conv - b.conv).abs().max().item() < 1e-12


def test_decode_with_state_equals_full_forward_f32():
    model = tiny_model()
    toks = tokens(model, 13)
    with torch.no_grad():
        full = model(toks).logits
        got, _, _ = decode(model, toks, [1] * 13)
        chunked, _, _ = decode(model, toks, [6, 7])
    assert (got - full).abs().max().item() < F32_TOL
    assert (chunked - full).abs().max().item() < F32_TOL
    assert full.std().item() > 0.3        # a live model, not a constant


def test_state_is_what_carries_the_context():
    model = tiny_model(dtype=torch.float64)
    toks = tokens(model, 9)
    with torch.no_grad():
        with_ctx, _, _ = decode(model, toks, [8, 1])
        alone = model(toks[:, 8:]).logits
    assert (with_ctx[:, -1:] - alone).abs().max().item() > 1e-2


def test_layer_inputs_captured_in_decode_match_full():
    model = tiny_model(dtype=torch.float64)
    L = model.cfg.num_layers
    toks = tokens(model, 7)
    taps = [0, 2, 5, L]
    with torch.no_grad():
        full = model(toks, capture_layers=taps)
        _, _, outs = decode(model, toks, [3, 1, 3], capture_layers=taps)
        mixed = model(toks, capture_layers=taps, capture_mode="mixed")
    for il in taps:
        dec = torch.cat([o.layer_inputs[il] for o in outs], dim=1)
        assert dec.shape == (1, 7, model.cfg.hidden_size)
        assert (dec - full.layer_inputs[il]).abs().max().item() < F64_TOL
    assert torch.equal(full.layer_inputs[0], model.embed(toks))
    # layer 0 has an empty bank (mix = stream); later layers really mix
    assert torch.equal(mixed.layer_inputs[0], full.layer_inputs[0])
    assert not torch.allclose(mixed.layer_inputs[5], full.layer_inputs[5])


def test_mla_truncate_by_position_then_redecode_equals_fresh():
    model = tiny_model(dtype=torch.float64)
    toks = tokens(model, 10, seed=3)
    other = tokens(model, 4, seed=4)
    with torch.no_grad():
        state = model.new_state()
        model(toks[:, :6], state)
        snap = state.clone()
        model(toks[:, 6:], state)                      # 4 more tokens, then roll back
        assert state.pos == 10 and all(c.length == 10 for c in state.mla_caches())
        with pytest.raises(ValueError):
            state.truncate(6)                          # KDA layers need a snapshot
        state.truncate(6, recurrent=snap)
        assert all(c.length == 6 for c in state.mla_caches())
        again = model(other, state).logits
        fresh_state = model.new_state()
        model(toks[:, :6], fresh_state)
        fresh = model(other, fresh_state).logits
    assert torch.equal(again, fresh)
    for a, b in zip(state.mla_caches(), fresh_state.mla_caches(), strict=True):
        assert torch.equal(a.view()[0], b.view()[0]) and torch.equal(a.view()[1], b.view()[1])


def _kda_layer(dtype):
    model = tiny_model(dtype=dtype)
    layer = model.layers[0].attn
    assert isinstance(layer, KDA)
    g = torch.Generator().manual_seed(11)
    x0 = torch.randn(2, 5, model.cfg.hidden_size, generator=g).to(dtype)
    x = torch.randn(2, 7, model.cfg.hidden_size, generator=g).to(dtype)
    state = layer.empty_state(2, dtype=dtype)
    with torch.no_grad():
        layer(x0, state)
    return layer, state, x


def test_kda_speculative_leaves_state_pristine_and_commit_all_is_bitwise():
    layer, state, x = _kda_layer(torch.float32)
    before = state.clone()
    with torch.no_grad():
        out_spec, rows = layer(x, state, commit=False)
        assert torch.equal(state.S, before.S) and torch.equal(state.conv, before.conv)
        normal = before.clone()
        out_norm, none = layer(x, normal)
    assert none is None and rows.n_rows == 7
    assert torch.equal(out_spec, out_norm)
    commit_rows(state, rows, 7)
    assert torch.equal(state.S, normal.S) and torch.equal(state.conv, normal.conv)


@pytest.mark.parametrize("n", [0, 1, 3, 6])
def test_kda_commit_rows_equals_running_n_rows(n):
    # float32 agrees to 1e-6 (the projections of n rows and of 7 rows come from different
    # matmul shapes, so they may differ in the last bit); float64 to 1e-12
    for dtype, tol in ((torch.float32, 1e-6), (torch.float64, 1e-12)):
        layer, state, x = _kda_layer(dtype)
        ref = state.clone()
        with torch.no_grad():
            _, rows = layer(x, state, commit=False)
            if n:
                layer(x[:, :n], ref)
        commit_rows(state, rows, n)
        assert (state.conv - ref.conv).abs().max().item() <= tol
        assert (state.S - ref.S).abs().max().item() <= tol
    # on the captured rows themselves the commit is the recurrence's own prefix, bit for bit
    S0 = torch.zeros_like(ref.S)
    kv = KDAState(S0.clone(), ref.conv.clone())
    commit_rows(kv, rows, n)
    if n:
        k, v, g, beta = rows.k[:, :n], rows.v[:, :n], rows.g[:, :n], rows.beta[:, :n]
        _, S_pref = delta_rule(S0, k, k, v, g, beta)        # q does not touch S
        assert torch.equal(kv.S, S_pref)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, F64_TOL), (torch.float32, F32_TOL)])
def test_model_speculative_verify_then_commit(dtype, tol):
    model = tiny_model(dtype=dtype)
    toks = tokens(model, 14, seed=5)
    prefix, block, after = toks[:, :6], toks[:, 6:11], toks[:, 11:]
    n = 3
    with torch.no_grad():
        state = model.new_state()
        model(prefix, state)
        pristine = state.clone()
        spec = model(block, state, speculative=True, capture_layers=[3])
        assert state.pos == 6 and spec.captured.start_pos == 6 and spec.captured.n_rows == 5
        for il, layer_state in enumerate(state.layers):
            if isinstance(layer_state, KDAState):
                assert torch.equal(layer_state.S, pristine.layers[il].S)
        # verification logits are the normal logits of those rows
        normal_state = pristine.clone()
        normal = model(block, normal_state, capture_layers=[3])
        assert torch.equal(spec.logits, normal.logits)
        assert torch.equal(spec.layer_inputs[3], normal.layer_inputs[3])
        model.commit_rows(state, spec.captured, n)
        assert state.pos == 6 + n
        cont = model(after, state).logits

        ref_state = pristine.clone()
        model(block[:, :n], ref_state)
        ref = model(after, ref_state).logits
        full = model(torch.cat((prefix, block[:, :n], after), dim=1)).logits[:, -after.shape[1]:]
    assert (cont - ref).abs().max().item() < tol
    assert (cont - full).abs().max().item() < tol


def test_rejected_speculation_is_discarded_by_the_next_forward():
    model = tiny_model(dtype=torch.float64)
    toks = tokens(model, 8, seed=6)
    with torch.no_grad():
        state = model.new_state()
        model(toks[:, :5], state)
        model(toks[:, 5:], state, speculative=True)     # all rejected: commit nothing
        nxt = model(toks[:, 5:6], state).logits
        ref_state = model.new_state()
        model(toks[:, :5], ref_state)
        ref = model(toks[:, 5:6], ref_state).logits
    assert torch.equal(nxt, ref)


def test_commit_rejects_mismatched_state():
    model = tiny_model()
    toks = tokens(model, 6)
    with torch.no_grad():
        state = model.new_state()
        spec = model(toks, state, speculative=True)
        model(toks[:, :1], state)
    with pytest.raises(ValueError):
        model.commit_rows(state, spec.captured, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_decode_steps_kda_state_in_place_with_the_same_floats(dtype):
    """Decoding writes each KDA layer's state where it already is (no new [B, H, d, d] tensor per
    token); the logits and states are those of stepping a fresh copy of the state each token."""
    model = tiny_model(dtype=dtype)
    toks = tokens(model, 9, batch=2)
    state, copied = model.new_state(2), model.new_state(2)
    kda_layers = [i for i, x in enumerate(state.layers) if isinstance(x, KDAState)]
    assert kda_layers
    with torch.no_grad():
        model(toks[:, :4], state)
        model(toks[:, :4], copied)
        ptrs = [state.layers[i].S.data_ptr() for i in kda_layers]
        for t in range(4, 9):
            got = model(toks[:, t:t + 1], state).logits
            for i in kda_layers:
                copied.layers[i].S = copied.layers[i].S.clone()
            want = model(toks[:, t:t + 1], copied).logits
            assert [state.layers[i].S.data_ptr() for i in kda_layers] == ptrs
            assert torch.equal(got, want)
    for i in kda_layers:
        assert torch.equal(state.layers[i].S, copied.layers[i].S)
