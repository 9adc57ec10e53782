import pytest
import torch
from toy_target import (
    OracleDraft,
    ToyTarget,
    one_thread,  # noqa: F401  (autouse fixture)
)

from k3kit.adapters.dflash import DSparkDrafter
from k3kit.models.dflash.config import DraftConfig
from k3kit.models.dflash.network import DSparkDraft
from k3kit.runtime.speculative import (
    FeatureRing,
    Sampling,
    ScheduleConfig,
    ar_generate,
    speculative_generate,
)

PROMPT = [3, 17, 5, 9, 1]
GREEDY = Sampling()


def _reference(n_tokens, **kw):
    t = ToyTarget(**kw)
    res = ar_generate(t, PROMPT, n_tokens, GREEDY)
    return res.tokens, t.state()


def _check_run(target, res, ref_tokens, ref_state, ring=None):
    assert res.tokens == ref_tokens
    # the committed recurrent state is exactly what plain decoding reaches: replay is exact
    assert target.position == len(PROMPT) + len(ref_tokens) - 1
    for a, b in zip(target.state(), ref_state, strict=True):
        assert torch.equal(a, b)
    st = res.stats
    assert sum(st.committed_per_pass) + 1 == len(res.tokens)
    assert sum(st.acceptance_histogram) == st.target_passes == len(st.verify_rows)
    if ring is not None:
        assert ring.length == target.position


@pytest.mark.parametrize("block", range(1, 8))
def test_greedy_equals_ar_oracle_draft(block):
    n = 30
    ref, ref_state = _reference(n)
    hist_total = [0] * (block + 1)
    for p_good in (0.0, 0.6, 0.95):
        for sched in (ScheduleConfig(), ScheduleConfig(budget=1), ScheduleConfig(budget=2),
                      ScheduleConfig(budget=block + 1)):
            t = ToyTarget()
            ring = FeatureRing(2 * t.hidden, storage="q8")
            res = speculative_generate(t, OracleDraft(t, block, p_good, seed=block), PROMPT, n,
                                       GREEDY, schedule=sched, ring=ring)
            _check_run(t, res, ref, ref_state, ring)
            assert max(res.stats.verify_rows) <= min(block + 1, sched.budget or block + 1)
            hist_total = [a + b for a, b in zip(hist_total, res.stats.acceptance_histogram, strict=True)]
    # acceptance really varied: rejections at 0 and, for longer blocks, long accepted runs
    assert hist_total[0] > 0
    assert sum(hist_total[1:]) > 0
    if block >= 3:
        assert sum(hist_total[3:]) > 0


def test_good_draft_reduces_passes_and_reports_counters():
    n = 40
    t = ToyTarget()
    res = speculative_generate(t, OracleDraft(t, 7, 0.9), PROMPT, n, GREEDY)
    ar = ar_generate(ToyTarget(), PROMPT, n, GREEDY)
    assert res.tokens == ar.tokens
    assert res.stats.target_passes < ar.stats.target_passes / 2
    assert res.stats.tau > 2.0
    assert max(res.stats.verify_rows) == 8           # flat cost: verify anchor + all 7 proposals
    d = res.stats.to_dict()
    assert d["replay_fast_commits"] > 0 and d["replay_full_replays"] > 0
    assert d["replay_failed_fallbacks"] == 0
    assert d["draft_steps"] == res.stats.target_passes


def test_costly_rows_narrow_the_verify_and_stay_exact():
    n = 30
    ref, ref_state = _reference(n)
    flat = ToyTarget()
    r_flat = speculative_generate(flat, OracleDraft(flat, 7, 0.5), PROMPT, n, GREEDY)
    costly = ToyTarget(cost=lambda rows: float(rows) ** 2)
    r_cost = speculative_generate(costly, OracleDraft(costly, 7, 0.5), PROMPT, n, GREEDY)
    _check_run(costly, r_cost, ref, ref_state)
    assert sum(r_cost.stats.verify_rows) / len(r_cost.stats.verify_rows) < \
        sum(r_flat.stats.verify_rows) / len(r_flat.stats.verify_rows)


def test_stop_token_and_max_tokens():
    ref, _ = _reference(30)
    stop = ref[9]
    first = ref.index(stop)
    t = ToyTarget()
    res = speculative_generate(t, OracleDraft(t, 7, 1.0), PROMPT, 30, GREEDY, stop_ids=[stop])
    assert res.tokens == ref[: first + 1]
    assert t.position == len(PROMPT) + first           # the stop token itself is not committed
    for n in (1, 2, 7, 8, 9):
        t = ToyTarget()
        res = speculative_generate(t, OracleDraft(t, 7, 1.0), PROMPT, n, GREEDY)
        assert res.tokens == ref[:n] and t.position == len(PROMPT) + n - 1


def _toy_dspark(target: ToyTarget, block: int, markov: bool, seed: int = 0) -> DSparkDraft:
    cfg = DraftConfig(hidden_size=target.hidden, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      intermediate_size=32, vocab_size=target.vocab_size, block_size=block,
                      target_layer_ids=target.tap_layers, mask_token_id=target.vocab_size - 1,
                      markov_rank=6 if markov else 0, has_confidence=markov)
    torch.manual_seed(seed)
    return DSparkDraft(cfg, embed=target.emb, lm_head=target.head_w).double()


@pytest.mark.parametrize("block", [1, 3, 7])
@pytest.mark.parametrize("markov", [False, True])
def test_greedy_equals_ar_dspark_draft(block, markov):
    n = 20
    ref, ref_state = _reference(n)
    for sched in (ScheduleConfig(), ScheduleConfig(threshold=0.5), ScheduleConfig(budget=2)):
        t = ToyTarget()
        drafter = DSparkDrafter(_toy_dspark(t, block, markov), max_context=9)
        ring = FeatureRing(2 * t.hidden, storage="bf16")
        res = speculative_generate(t, drafter, PROMPT, n, GREEDY, schedule=sched, ring=ring)
        _check_run(t, res, ref, ref_state, ring)
        begin, end = drafter.context_span
        assert end - begin == 9 and 0 < ring.length - end <= block + 1


def test_chunked_prefill_is_invisible():
    ref, ref_state = _reference(12)
    rings = []
    for chunk in (1, 2, 512):
        t = ToyTarget()
        ring = FeatureRing(2 * t.hidden, storage="f32")
        res = speculative_generate(t, OracleDraft(t, 4, 0.7), PROMPT, 12, GREEDY, ring=ring,
                                   prefill_chunk=chunk)
        _check_run(t, res, ref, ref_state, ring)
        rings.append(ring.get(0, len(PROMPT)))
    assert torch.equal(rings[0], rings[1]) and torch.equal(rings[0], rings[2])


def test_ring_must_match_target_position():
    t = ToyTarget()
    ring = FeatureRing(2 * t.hidden)
    ring.append(torch.zeros(1, 2 * t.hidden))
    with pytest.raises(ValueError, match="feature ring"):
        speculative_generate(t, OracleDraft(t, 3, 0.5), PROMPT, 5, GREEDY, ring=ring)


def test_toy_target_honours_the_target_contract():
    from target_contract import check_target_contract

    from k3kit.runtime.speculative import Target

    assert isinstance(ToyTarget(), Target)
    check_target_contract(ToyTarget, PROMPT, [4, 8, 15, 16, 23, 2])

    class Leaky(ToyTarget):          # a target whose verify commits: the check must catch it
        def verify(self, ids, capture=True, all_logits=True):
            out = super().verify(ids, capture, all_logits)
            super().commit(len(ids))
            return out

        def commit(self, n):
            pass

    with pytest.raises(AssertionError):
        check_target_contract(Leaky, PROMPT, [4, 8, 15, 16, 23, 2])
