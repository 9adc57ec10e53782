"""Sampled speculative decoding must have exactly the target's distribution.

Checked twice: the acceptance rule alone against p for random (p, q) pairs, and the whole loop
(draft, Markov-free oracle proposals, rejection, residual, bonus, replay) on the first three
tokens against the exact distribution enumerated from the toy target. A deliberately broken
acceptance rule must fail the same test, so the test has teeth.
"""

import torch
from chi2 import chi2 as _chi2
from chi2 import chi2_critical as _chi2_critical
from toy_target import (
    OracleDraft,
    ToyTarget,
    bigram_dspark,
    one_thread,  # noqa: F401  (autouse fixture)
)

import k3kit.runtime.speculative.decoder as decoder
from k3kit.runtime.speculative import Sampling, ar_generate, speculative_generate
from k3kit.runtime.speculative.accept import accept_sampled
from k3kit.runtime.speculative.sampling import probs, sample


def _resample_from_p(proposals, q, p, gen):
    """A classic bug: on rejection draw from p instead of norm(max(0, p - q))."""
    for k, x in enumerate(proposals):
        u = torch.rand((), generator=gen, dtype=torch.float64).item()
        if u * q[k, x] < p[k, x]:
            continue
        return k, sample(p[k], gen)
    return len(proposals), sample(p[len(proposals)], gen)


def test_acceptance_rule_reproduces_p():
    g = torch.Generator().manual_seed(0)
    v, n = 6, 6000
    for trial in range(3):
        p = torch.softmax(torch.randn(2, v, generator=g, dtype=torch.float64) * 1.5, -1)
        q = torch.softmax(torch.randn(1, v, generator=g, dtype=torch.float64) * 1.5, -1)
        for rule, lossless in ((accept_sampled, True), (_resample_from_p, False)):
            counts = [0] * v
            for _ in range(n):
                x = int(torch.multinomial(q[0], 1, generator=g))
                m, nxt = rule([x], q, p, g)
                counts[x if m == 1 else nxt] += 1
            stat, df = _chi2(dict(enumerate(counts)), dict(enumerate(p[0].tolist())), n)
            assert (stat < _chi2_critical(df)) == lossless, (trial, rule.__name__, stat, df)


PROMPT = [1, 4, 2]


def _target(vocab: int) -> ToyTarget:
    return ToyTarget(vocab=vocab, hidden=8, n_layers=2, tap_layers=(0, 1), seed=5)


def _exact_first3(s: Sampling, vocab: int) -> dict:
    t = _target(vocab)
    p0 = probs(t.verify(PROMPT, capture=False).logits[-1], s)
    t.commit(len(PROMPT))
    out = {}
    for a in range(vocab):
        ta = t.clone()
        p1 = probs(ta.verify([a], capture=False).logits[-1], s)
        ta.commit(1)
        for b in range(vocab):
            tb = ta.clone()
            p2 = probs(tb.verify([b], capture=False).logits[-1], s)
            for c in range(vocab):
                pr = p0[a] * p1[b] * p2[c]
                if pr > 0:
                    out[(a, b, c)] = pr.item()
    return out


def _run_many(s: Sampling, vocab: int, n: int, spec: bool = True, markov: bool = False) -> dict:
    counts: dict = {}
    t = _target(vocab)
    drafter = bigram_dspark(t, 2) if markov else None
    for seed in range(n):
        si = Sampling(s.temperature, s.top_k, s.top_p, seed)
        t.reset()
        if spec:
            draft = drafter or OracleDraft(t, 3, 0.5, seed=seed + 10**6, peak=2.0)
            res = speculative_generate(t, draft, PROMPT, 3, si, ring_capacity=16)
        else:
            res = ar_generate(t, PROMPT, 3, si)
        key = tuple(res.tokens)
        counts[key] = counts.get(key, 0) + 1
    return counts


def test_speculative_sampling_matches_target_distribution(monkeypatch):
    vocab, n = 5, 1500
    for s in (Sampling(temperature=1.3), Sampling(temperature=0.9, top_k=4, top_p=0.9)):
        exact = _exact_first3(s, vocab)
        assert abs(sum(exact.values()) - 1) < 1e-9
        counts = _run_many(s, vocab, n)
        stat, df = _chi2(counts, exact, n)
        assert stat < _chi2_critical(df), (s, stat, df)
        # the reference AR loop passes the same test
        stat_ar, df_ar = _chi2(_run_many(s, vocab, 400, spec=False), exact, 400)
        assert stat_ar < _chi2_critical(df_ar)

    # the DSpark path (Markov-chained q, confidence-driven width) is lossless too
    s = Sampling(temperature=1.3)
    stat, df = _chi2(_run_many(s, vocab, 800, markov=True), _exact_first3(s, vocab), 800)
    assert stat < _chi2_critical(df)

    # teeth: accepting every proposal (no rejection) is visibly biased
    def accept_all(proposals, q, p, gen):
        return len(proposals), sample(p[len(proposals)], gen)

    monkeypatch.setattr(decoder, "accept_sampled", accept_all)
    s = Sampling(temperature=1.3)
    stat, df = _chi2(_run_many(s, vocab, 600), _exact_first3(s, vocab), 600)
    assert stat > _chi2_critical(df)


def test_top_k_top_p_transform():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0], dtype=torch.float64)
    p = probs(logits, Sampling(temperature=1.0, top_k=3))
    assert (p[3:] == 0).all() and abs(p.sum() - 1) < 1e-12
    full = torch.softmax(logits, -1)
    assert torch.allclose(p[:3], full[:3] / full[:3].sum())
    # top_p keeps the smallest prefix whose mass reaches top_p
    p = probs(logits, Sampling(temperature=1.0, top_p=float(full[0] + 0.01)))
    assert (p > 0).tolist() == [True, True, False, False, False]
