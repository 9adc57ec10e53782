"""What the draft server spends on rows that do not draft (shipped mini K3 + its drafter): a decoder
without proposals in a pass runs the plain committed row an AR server runs (not a pending one-row
verify block to commit afterwards), and the model's cost() is worked out once per width while the
expert cache stands, not in every pass."""

from __future__ import annotations

import pytest
import torch
from scheduling import ar_tokens, serve_and_close
from test_spec_declined import _requests

from k3kit.runtime.speculative.schedule import DraftGuard
from k3kit.serve import batch
from k3kit.serve.batch import BatchScheduler


class _Never(DraftGuard):
    def allow(self, n: int) -> bool:
        return False


def _spied(monkeypatch, model):
    """Every verify_batch call's (rows, verify set) and the number of commit_sequence calls."""
    seen: list[tuple[list[tuple[int, int]], set[int]]] = []
    commits = [0]
    verify_batch, commit = model.verify_batch, model.commit_sequence

    def spy_verify(rows, *, verify=(), capture=()):
        seen.append(([(sid, len(ids)) for sid, ids in rows], set(verify)))
        return verify_batch(rows, verify=verify, capture=capture)

    def spy_commit(seq, n):
        commits[0] += 1
        return commit(seq, n)
    monkeypatch.setattr(model, "verify_batch", spy_verify)
    monkeypatch.setattr(model, "commit_sequence", spy_commit)
    return seen, commits


@pytest.mark.parametrize("drafting", [False, True])
def test_only_blocks_with_proposals_are_verified(spec_session, monkeypatch, spec_factory, drafting):
    """Drafting declined everywhere: no pass verifies anything and nothing is committed afterwards
    (every decode row is committed by its pass, as in the AR server). Drafting allowed: the verified
    sequences are exactly those whose entry holds proposals (more than one row), each committed once.
    Greedy output is AR's either way."""
    model, codec = spec_session.model, spec_session.codec
    reqs = _requests(codec, max_tokens=16)
    ref = ar_tokens(spec_session, reqs)
    seen, commits = _spied(monkeypatch, model)
    guard = DraftGuard(judge=False) if drafting else _Never()
    sp = BatchScheduler(model, codec, max_batch=64, max_queue=16, step_factory=spec_factory, guard=guard)
    got, st = serve_and_close(sp, reqs)
    assert got == ref
    assert seen
    blocks = 0
    for rows, verify in seen:
        lengths = dict(rows)
        assert verify <= set(lengths)
        for sid in verify:
            assert lengths[sid] > 1          # a verified entry is a block with proposals
        blocks += len(verify)
    assert commits[0] == blocks              # each block committed once, plain rows never
    if drafting:
        assert st.spec_proposed > 0 and blocks > 0
    else:
        assert blocks == 0 and st.drafted_passes == 0 and st.decode_passes > 0
    assert model.sequences == 0


def test_a_committed_row_is_one_row(spec_session, spec_factory):
    """accept(committed=True) is for a plain row the pass committed: a block with proposals is
    refused (its rows are pending, not committed)."""
    from k3kit.runtime.protocols import VerifyOutput
    from k3kit.runtime.sampling import Sampler, make_sampling
    from k3kit.runtime.speculative.proposal import Proposal

    model = spec_session.model
    h = model.open_sequence()
    try:
        dec = spec_factory(model.sequence_target(h), Sampler(make_sampling(0.0)))
        props = Proposal([5, 6], torch.zeros(2, model.vocab_size), None, None)
        v = VerifyOutput(torch.zeros(3, model.vocab_size), torch.zeros(3, dec.ring.width))
        with pytest.raises(ValueError, match="one-row block"):
            dec.accept(props, 3, v, committed=True)
    finally:
        model.close_sequence(h)


def test_cost_is_asked_once_per_width_while_the_expert_cache_stands(spec_session, spec_factory, monkeypatch):
    """_cost asks the model once per row count; again after an expert miss (the cache's contents
    changed) and after COST_REFRESH passes (a model loaded without stats)."""
    model, codec = spec_session.model, spec_session.codec
    calls: list[int] = []
    cost = model.cost

    def counted(n):
        calls.append(n)
        return cost(n)
    monkeypatch.setattr(model, "cost", counted)
    sp = BatchScheduler(model, codec, max_batch=64, max_queue=16, step_factory=spec_factory)
    try:
        first = [sp._cost(n) for n in (3, 5, 3, 5, 3)]
        assert calls == [3, 5] and first[0] == first[2] == cost(3)
        sp._stats.expert_misses += 1
        sp._cost(3)
        sp._cost(3)
        assert calls == [3, 5, 3]
        sp._passes += batch.COST_REFRESH
        sp._cost(3)
        assert calls == [3, 5, 3, 3]
    finally:
        sp.close()
