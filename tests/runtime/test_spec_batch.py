"""Drafting many sequences in one draft forward (a server's pass): each sequence's block and
proposal must be the one its own serial draft step gives."""

import pytest
import torch
from toy_target import draft_config, one_thread  # noqa: F401  (one_thread: autouse fixture)

from k3kit.adapters.dflash import DSparkDrafter
from k3kit.models.dflash.network import DSparkDraft
from k3kit.runtime.speculative import FeatureRing, Sampling, ScheduleConfig, SpeculativeDecoder
from k3kit.runtime.speculative.decoder import batchable, draft_blocks, propose_many

V, H = 32, 16


def _draft(**kw):
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    d = DSparkDraft(draft_config(**kw), embed=torch.randn(V, H, generator=g, dtype=torch.float64),
                    lm_head=torch.randn(V, H, generator=g, dtype=torch.float64)).double()
    for p in d.parameters():
        if p.dim() == 1:
            p.data = 1 + 0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64)
    return d


@pytest.mark.parametrize("anchor_row", [True, False])
def test_blocks_drafted_together_are_each_blocks_own(anchor_row):
    """Three rings of different lengths (one empty: no context; one beyond the attention window):
    one forward gives each the logits and hidden rows of its own draft_block, for DSpark (every row
    a proposal) and DFlash (row 0 re-reads the anchor); grouped-query heads; the head 4 rows a call."""
    drafter = DSparkDrafter(_draft(sample_from_anchor=anchor_row), max_context=9)
    drafter.head_rows = 4           # fewer than a block: one block per head call
    g = torch.Generator().manual_seed(5)
    rings = []
    for n in (0, 6, 14):
        ring = FeatureRing(2 * H, storage="f32")
        if n:
            ring.append(torch.randn(n, 2 * H, generator=g, dtype=torch.float64))
        rings.append(ring)
    anchors, positions = [3, 7, 11], [r.length for r in rings]
    alone, ctxs = [], []
    for ring, a, p in zip(rings, anchors, positions, strict=True):
        drafter.sync(ring)
        ctxs.append(drafter.context())
        alone.append(drafter.draft_block(a, p))
    assert ctxs[0] is None and ctxs[2][0][0].shape[0] == 9
    for head_rows in (4, 64):
        drafter.head_rows = head_rows
        together = drafter.draft_blocks(ctxs, anchors, positions)
        for a, b in zip(alone, together, strict=True):
            assert a.logits.shape == b.logits.shape == (drafter.n_proposals, V)
            torch.testing.assert_close(b.logits, a.logits, rtol=0, atol=1e-12)
            torch.testing.assert_close(b.hidden, a.hidden, rtol=0, atol=1e-12)


def test_blocks_that_fill_their_span_out_of_order_get_their_own_positions():
    """Two blocks at positions [b, 2b) and [0, b), in that order: together they cover [0, 2b)
    exactly, but not in order, so each must still be roped at its own positions."""
    drafter = DSparkDrafter(_draft())
    b = drafter.block_size
    g = torch.Generator().manual_seed(7)
    rings = []
    for n in (b, 0):
        ring = FeatureRing(2 * H, storage="f32")
        if n:
            ring.append(torch.randn(n, 2 * H, generator=g, dtype=torch.float64))
        rings.append(ring)
    anchors, positions = [4, 9], [r.length for r in rings]
    alone, ctxs = [], []
    for ring, a, p in zip(rings, anchors, positions, strict=True):
        drafter.sync(ring)
        ctxs.append(drafter.context())
        alone.append(drafter.draft_block(a, p))
    together = drafter.draft_blocks(ctxs, anchors, positions)
    for a, t in zip(alone, together, strict=True):
        torch.testing.assert_close(t.logits, a.logits, rtol=0, atol=1e-12)


@pytest.fixture(scope="module")
def mini():
    from k3kit.adapters.session import open_session
    from k3kit.mini.paths import shipped_draft, shipped_gguf
    from k3kit.runtime.loader import LoadOptions

    session = open_session(shipped_gguf(), LoadOptions(), draft=shipped_draft())
    yield session
    session.close()


def _decoders(session, samplings):
    model, draft = session.model, session.draft_model
    texts = ["import os", "def add(a, b):", "class Foo:\n    def __init__(self):", "x = [",
             "for i in range(10):", "while True:\n    print(i)"]
    decs = []
    for text, s in zip(texts, samplings, strict=False):
        h = model.open_sequence()
        dec = SpeculativeDecoder(model.sequence_target(h), draft, s, torch.Generator().manual_seed(s.seed),
                                 schedule=ScheduleConfig(draft_cost=None))
        dec.prefill(session.codec.encode(text))
        dec.handle = h
        decs.append(dec)
    return decs


def _close(session, decs):
    for d in decs:
        session.draft_model.release(d.ring)
        session.model.close_sequence(d.handle)
    assert session.model.sequences == 0 and session.draft_model.contexts == 0


def test_propose_many_gives_each_sequence_its_serial_proposal(mini, monkeypatch):
    """Six sequences of the shipped mini (different context lengths), four greedy and two seeded
    sampled: one draft forward for all; every block is its serial draft_block bit for bit, greedy
    proposals are the serial tokens (their Markov rows may round in the last bit), sampled ones are
    the serial proposals exactly (tokens, logits, q; the generator left in the same state)."""
    draft = mini.draft_model
    assert draft.head_rows == mini.model.batch_invariant_rows > 0
    samplings = [Sampling(), Sampling(temperature=0.8, top_p=0.9, seed=11), Sampling(), Sampling(),
                 Sampling(temperature=1.0, top_k=40, seed=12), Sampling()]
    decs = _decoders(mini, samplings)
    try:
        anchors = [17, 198, 25, 5, 300, 42]
        states = [d.gen.get_state() for d in decs]
        serial, blocks = [], []
        for d, a in zip(decs, anchors, strict=True):
            draft.sync(d.ring)
            blocks.append(draft.draft_block(a, d.target.position))
            serial.append(d.propose(a, 20))
        after = [d.gen.get_state() for d in decs]
        for d, s in zip(decs, states, strict=True):
            d.gen.set_state(s)
        together, _ = draft_blocks(decs, anchors)
        for a, b in zip(blocks, together, strict=True):
            assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden)

        calls = []
        real = draft.draft_blocks
        monkeypatch.setattr(draft, "draft_blocks", lambda c, a, p: calls.append(len(a)) or real(c, a, p))
        steps = [d.stats.draft_steps for d in decs]
        got = propose_many(decs, anchors, [20] * len(decs))
        assert calls == [len(decs)]
        for d, s, a, b, st, n in zip(decs, samplings, serial, got, after, steps, strict=True):
            assert b is not None and b.tokens == a.tokens and len(a.tokens) == draft.n_proposals
            assert torch.equal(b.confidence, a.confidence)
            if s.greedy:
                torch.testing.assert_close(b.logits, a.logits, rtol=0, atol=1e-4)
            else:
                assert torch.equal(b.logits, a.logits) and torch.equal(b.q, a.q)
                assert torch.equal(d.gen.get_state(), st)
            assert d.stats.draft_steps == n + 1 and d.draft_seconds > 0
        # one token left: no draft step for that sequence, the others still draft together
        calls.clear()
        got = propose_many(decs[:3], anchors[:3], [1, 20, 20])
        assert got[0] is None and got[1] is not None and calls == [2]
    finally:
        _close(mini, decs)


def test_only_plain_decoders_of_one_draft_batch(mini):
    """A decoder whose propose was replaced (instrumented) drafts alone, as do decoders of other drafts."""
    decs = _decoders(mini, [Sampling(), Sampling(), Sampling()])
    try:
        assert batchable(decs) and not batchable(decs[:1])
        decs[1].propose = lambda anchor, remaining: None
        assert not batchable(decs)
        assert propose_many(decs, [1, 2, 3], [9, 9, 9])[1] is None
        other = SpeculativeDecoder(decs[0].target, DSparkDrafter(mini.draft_model.draft), Sampling(),
                                   torch.Generator(), ring=decs[0].ring)
        assert not batchable([decs[0], other])
    finally:
        _close(mini, decs)


def test_draft_cost_shares_a_batched_step():
    """A step of n sequences drafted together costs f + p n: the fit recovers f and p from the steps
    run and gives each sequence its share; from one size alone it assumes no shared part (each
    costs what it did), and a cost that falls with n is read as all shared."""
    from k3kit.runtime.speculative.schedule import DraftCost

    fit = DraftCost()
    assert fit.per_sequence(4) is None
    fit.record(1, 0.005)
    assert fit.per_sequence(8) == pytest.approx(0.005)
    for n in (2, 4, 8, 1, 16):
        fit.record(n, 0.004 + 0.001 * n)
    f, p = fit.coefficients()
    assert f == pytest.approx(0.004) and p == pytest.approx(0.001)
    assert fit.per_sequence(8) == pytest.approx(0.0015) and fit.per_sequence(1) == pytest.approx(0.005)
    down = DraftCost()
    down.record(1, 0.006)
    down.record(4, 0.004)
    assert down.coefficients()[1] == 0.0                       # the (weighted) mean step, shared by all
    assert down.per_sequence(4) == pytest.approx((0.95 * 0.006 + 0.004) / 1.95 / 4)
