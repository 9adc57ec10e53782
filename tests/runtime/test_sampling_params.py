"""The sampling parameters beyond temperature / top-k / top-p: logit bias, min-p and the history
penalties (presence, frequency: OpenAI's; repetition: vLLM's), in the Sampler and in speculative
decoding, where verify row k must see the history plus the block's proposals[:k]."""

from __future__ import annotations

import pytest
import torch
from toy_target import (
    ToyTarget,
    bigram_dspark,
    one_thread,  # noqa: F401  (autouse fixture)
)

from k3kit.errors import K3Error
from k3kit.runtime.sampling import History, Sampler, make_sampling
from k3kit.runtime.speculative import ScheduleConfig, SpeculativeDecoder, ar_generate, speculative_generate
from k3kit.runtime.speculative.sampling import Sampling, probs

V = 32


def _logits(seed: int = 0, n: int = 1) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def _old_pick(row: torch.Tensor, s: Sampling, gen: torch.Generator) -> int:
    """The picker before these parameters: argmax, or a draw from temperature/top-k/top-p."""
    if s.greedy:
        return int(torch.argmax(row).item())
    x = row.to(torch.float64) / s.temperature
    if s.top_k and s.top_k < x.shape[-1]:
        kth = torch.topk(x, s.top_k).values[-1:]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if s.top_p < 1.0:
        sp, idx = torch.sort(p, descending=True)
        keep = (torch.cumsum(sp, dim=-1) - sp) < s.top_p
        p = torch.zeros_like(p).scatter(-1, idx, sp * keep)
        p = p / p.sum()
    return int(torch.multinomial(p, 1, generator=gen).item())


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, top_k=12, seed=5),
                                dict(temperature=1.3, seed=11)])
def test_defaults_pick_as_before(kw):
    s = make_sampling(**kw)
    assert not s.penalized and s.logit_bias == () and s.min_p == 0
    sampler, gen = Sampler(s, [1, 2, 3]), s.generator()
    assert sampler.history is None                         # no per-token bookkeeping at defaults
    rows = _logits(1, 40)
    assert [sampler(r) for r in rows] == [_old_pick(r, s, gen) for r in rows]


def test_logit_bias_removes_and_forces_tokens():
    row = _logits(2)[0]
    best = int(row.argmax())
    assert Sampler(make_sampling(logit_bias={best: -100}))(row) != best
    assert Sampler(make_sampling(logit_bias={7: 100}))(row) == 7
    # sampled: a banned token is never drawn
    s = make_sampling(1.0, seed=3, logit_bias={best: -100})
    sampler = Sampler(s)
    assert best not in {sampler(row) for _ in range(200)}


def test_min_p_one_is_greedy_and_min_p_cuts_relative_to_the_best():
    rows = _logits(3, 20)
    greedy = [int(r.argmax()) for r in rows]
    for seed in range(3):
        sampler = Sampler(make_sampling(1.0, seed=seed, min_p=1.0))
        assert [sampler(r) for r in rows] == greedy
    s = make_sampling(0.7, seed=0, min_p=0.2)
    p, full = probs(rows[0], s), torch.softmax(rows[0].double() / 0.7, -1)
    keep = full >= 0.2 * full.max()                          # after temperature
    assert torch.equal(p > 0, keep) and torch.allclose(p[keep], full[keep] / full[keep].sum())


def test_penalties_by_hand():
    """vLLM's order and definitions: repetition over prompt + generated (divide positive logits,
    multiply negative ones), then frequency * count and presence * (count > 0) over generated."""
    row = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0], dtype=torch.float32)
    s = make_sampling(0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    h = History(s, prompt_ids=[1])
    h.extend([3, 3, 0])
    got = h.penalize(row[None])[0]
    want = torch.tensor([2.0 / 2 - 0.5 - 0.25, -1.0 * 2, 0.5, 3.0 / 2 - 1.0 - 0.25, -2.0, 1.0])
    assert torch.allclose(got, want)
    # verify rows: row k sees proposals[:k] as generated
    rows = h.penalize(torch.stack([row] * 3), [2, 2])
    for k, extra in enumerate(([], [2], [2, 2])):
        ref = History(s, prompt_ids=[1])
        ref.extend([3, 3, 0, *extra])
        assert torch.equal(rows[k], ref.penalize(row[None])[0])
    assert torch.equal(h.penalize(row[None])[0], got)        # the history itself did not move


def test_strong_presence_penalty_avoids_repeats():
    row = torch.zeros(V)
    row[:4] = torch.tensor([1.0, 0.9, 0.8, 0.7])
    plain, pen = Sampler(make_sampling()), Sampler(make_sampling(presence_penalty=2.0))
    assert [plain(row) for _ in range(4)] == [0] * 4
    assert [pen(row) for _ in range(4)] == [0, 1, 2, 3]
    freq = Sampler(make_sampling(frequency_penalty=0.15))
    assert [freq(row) for _ in range(4)] == [0, 1, 0, 2]


def test_seeded_penalized_sampling_repeats():
    rows = _logits(4, 30)
    s = make_sampling(1.0, seed=77, frequency_penalty=0.8, repetition_penalty=1.3, min_p=0.05,
                      logit_bias={1: 5.0})
    a, b = Sampler(s, [5, 6]), Sampler(s, [5, 6])
    assert [a(r) for r in rows] == [b(r) for r in rows]


def test_validation_names_the_parameter():
    for kw, name in ((dict(presence_penalty=2.5), "presence_penalty"),
                     (dict(frequency_penalty=-3), "frequency_penalty"),
                     (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(min_p=1.5), "min_p"),
                     (dict(logit_bias={3: 101.0}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias")):
        with pytest.raises(K3Error, match=name):
            make_sampling(**kw)
    with pytest.raises(K3Error):
        Sampling(min_p=float("nan"))


PENALIZED = [dict(frequency_penalty=1.0), dict(presence_penalty=1.5), dict(repetition_penalty=1.8),
             dict(frequency_penalty=0.7, repetition_penalty=1.3, logit_bias={5: -3.0, 9: 2.0})]


@pytest.mark.parametrize("kw", PENALIZED)
def test_speculative_greedy_with_penalties_equals_ar(kw):
    """Lossless with the history penalties: each verify row is penalized with the proposals before it."""
    prompt = [3, 17, 5]
    s = make_sampling(0.0, **kw)
    ref = ar_generate(ToyTarget(state_weight=0.0), prompt, 40, s).tokens
    assert ref != ar_generate(ToyTarget(state_weight=0.0), prompt, 40, make_sampling(0.0)).tokens
    t = ToyTarget(state_weight=0.0)
    res = speculative_generate(t, bigram_dspark(t, 6), prompt, 40, s, schedule=ScheduleConfig(budget=6))
    assert res.tokens == ref
    assert res.stats.draft_steps > 0 and sum(m * n for m, n in enumerate(res.stats.acceptance_histogram)) > 0


def test_speculative_greedy_bias_and_min_p_equal_ar():
    prompt = [3, 17, 5]
    ref_plain = ar_generate(ToyTarget(state_weight=0.0), prompt, 30, make_sampling(0.0)).tokens
    s = make_sampling(0.0, min_p=0.5, logit_bias={ref_plain[3]: -100.0})
    ref = ar_generate(ToyTarget(state_weight=0.0), prompt, 30, s).tokens
    assert ref_plain[3] not in ref
    t = ToyTarget(state_weight=0.0)
    assert speculative_generate(t, bigram_dspark(t, 6), prompt, 30, s,
                                schedule=ScheduleConfig(budget=6)).tokens == ref


def test_speculative_sampling_with_penalties_stays_seeded():
    s = make_sampling(1.0, seed=4, frequency_penalty=1.0, presence_penalty=0.5)

    def run():
        t = ToyTarget(state_weight=0.0)
        return speculative_generate(t, bigram_dspark(t, 6), [3, 17, 5], 30, s,
                                    schedule=ScheduleConfig(budget=6)).tokens
    assert run() == run()


def test_a_penalized_decoder_needs_the_history():
    t = ToyTarget(state_weight=0.0)
    s = make_sampling(0.0, presence_penalty=1.0)
    with pytest.raises(ValueError, match="History"):
        SpeculativeDecoder(t, bigram_dspark(t, 6), s, s.generator())
