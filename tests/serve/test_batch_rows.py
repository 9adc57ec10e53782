"""The model side of a batched decode pass (forward_batch on the shipped mini K3): the single rows
of several sequences in one pass get, bit for bit, the logits each sequence gets in a pass of its
own, pass after pass and when the set of decoding sequences changes; the KDA states of sequences
that keep decoding together are stepped in place (no copy of every state per pass); MLA's W_kb
product over several rows gives each row the floats it gets alone."""

from __future__ import annotations

import pytest
import torch

from k3kit.models.kimi_k3 import mla as mla_mod
from k3kit.models.kimi_k3.state import KDAState


@pytest.fixture(scope="module")
def mini():
    from k3kit.adapters import load_model
    from k3kit.mini.paths import shipped_gguf
    from k3kit.runtime.loader import LoadOptions

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    loaded = load_model(shipped_gguf(), LoadOptions())
    yield loaded.model
    loaded.close()
    torch.set_num_threads(threads)


def _kda_S(adapter, seq: int) -> torch.Tensor:
    state = adapter._state_of(seq)
    return next(layer.S for layer in state.layers if isinstance(layer, KDAState))


def test_decode_rows_of_several_sequences_equal_each_alone_and_step_in_place(mini):
    cfg = mini.cfg
    assert any(cfg.is_kda(il) for il in range(cfg.num_layers))
    assert not all(cfg.is_kda(il) for il in range(cfg.num_layers))        # MLA layers too
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, mini.vocab_size, (n,), generator=g).tolist() for n in (5, 3, 7, 4)]
    alone = [mini.open_sequence() for _ in prompts]
    batched = [mini.open_sequence() for _ in prompts]
    try:
        ref = [mini.forward_batch([(s, p)])[0] for s, p in zip(alone, prompts, strict=True)]
        got = mini.forward_batch(list(zip(batched, prompts, strict=True)))
        for i, r in enumerate(ref):
            assert torch.equal(got[i], r), f"prompt {i}"
        nxt = [int(r.argmax()) for r in ref]
        ptrs: list[int] | None = None
        for step in range(5):
            # the third sequence sits out pass 2: the others' states stop being one batch there
            active = [i for i in range(len(prompts)) if not (step == 2 and i == 2)]
            ref = {i: mini.forward_batch([(alone[i], [nxt[i]])])[0] for i in active}
            got = mini.forward_batch([(batched[i], [nxt[i]]) for i in active])
            for j, i in enumerate(active):
                assert torch.equal(got[j], ref[i]), f"pass {step}, sequence {i}"
                nxt[i] = int(ref[i].argmax())
            now = [_kda_S(mini, batched[i]).data_ptr() for i in active]
            if step in (1, 4):            # the same sequences as the pass before: stepped in place
                assert now == ptrs
            ptrs = now
        for a, b in zip(alone, batched, strict=True):
            for la, lb in zip(mini._state_of(a).layers, mini._state_of(b).layers, strict=True):
                if isinstance(la, KDAState):
                    assert torch.equal(la.S, lb.S) and torch.equal(la.conv, lb.conv)
    finally:
        for s in alone + batched:
            mini.close_sequence(s)
    assert mini.sequences == 0


@torch.no_grad()
def test_absorb_rows_gives_each_row_its_own_product():
    g = torch.Generator().manual_seed(0)
    H, d, L = 6, 16, 40
    kv_b = torch.randn(H, 2 * d, L, generator=g)
    w_kb = kv_b[:, :d]                       # a strided view, as MLA takes it
    x = torch.randn(5, H, d, generator=g)
    many = mla_mod.absorb_rows(x, w_kb)
    for i in range(5):
        one = mla_mod.absorb_rows(x[i:i + 1], w_kb)
        assert torch.equal(many[i], one[0])
        assert torch.equal(one[0], torch.einsum("bthd,hdl->bthl", x[i][None, None], w_kb)[0, 0])
    torch.testing.assert_close(many, torch.einsum("nhd,hdl->nhl", x, w_kb))


def test_invariant_rows_follow_the_experts_arithmetic():
    """The mini's experts are MXFP4: in the ggml arithmetic (int8 products in the native kernel at any
    row count) they bound nothing, and with the Q8_0 trunk neither does anything else; in the float
    arithmetic their kernel's 64-row limit is the model's."""
    import sys

    from k3kit.adapters import load_model
    from k3kit.mini.paths import shipped_gguf
    from k3kit.runtime.loader import LoadOptions

    for arith, rows in (("ggml", sys.maxsize), ("float", 64)):
        loaded = load_model(shipped_gguf(), LoadOptions(arith=arith))
        try:
            assert loaded.model.store.arith == arith
            assert loaded.model.batch_invariant_rows == rows, arith
        finally:
            loaded.close()
