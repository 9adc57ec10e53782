"""A black-box check of the Target contract, for any adapter (the toy here; a real model's
adapter can call it with its own factory). Only observable behaviour is used: logits, taps and
position, so it holds for recurrent and attention targets alike."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def check_target_contract(make_target: Callable[[], object], prompt: Sequence[int],
                          rows: Sequence[int], atol: float = 0.0) -> None:
    """make_target() must return fresh, identical targets; len(rows) >= 3."""

    def close(a, b):
        return torch.equal(a, b) if atol == 0 else torch.allclose(a, b, atol=atol, rtol=0)

    # reference: feed prompt + rows one at a time
    ref = make_target()
    ref.verify(list(prompt))
    ref.commit(len(prompt))
    ref_logits, ref_taps = [], []
    for t in rows:
        out = ref.verify([t])
        ref.commit(1)
        ref_logits.append(out.logits[-1])
        ref_taps.append(out.taps[-1])
    tail = ref.verify([rows[0]]).logits[-1]

    tgt = make_target()
    out = tgt.verify(list(prompt), capture=True)
    assert out.logits.shape[0] == len(prompt) and out.taps.shape[0] == len(prompt)
    last = tgt.verify(list(prompt), all_logits=False)
    assert last.logits.shape[0] == 1 and close(last.logits[0], out.logits[-1])
    tgt.commit(len(prompt))
    assert tgt.position == len(prompt)

    # verify does not commit: twice the same answer, position unchanged, rollback is a no-op
    a = tgt.verify(list(rows))
    b = tgt.verify(list(rows))
    tgt.rollback()
    c = tgt.verify(list(rows))
    assert tgt.position == len(prompt)
    assert close(a.logits, b.logits) and close(a.logits, c.logits) and close(a.taps, c.taps)
    assert a.taps.shape[0] == len(rows) and a.taps.shape[1] % len(tgt.tap_layers) == 0
    # a batched verify equals one-at-a-time processing, row for row
    for j in range(len(rows)):
        assert close(a.logits[j], ref_logits[j]) and close(a.taps[j], ref_taps[j])

    # commit(0) keeps nothing; commit(n) keeps exactly rows[:n]
    tgt.commit(0)
    assert tgt.position == len(prompt)
    n = len(rows) - 2
    tgt.verify(list(rows))
    tgt.commit(n)
    assert tgt.position == len(prompt) + n
    out = tgt.verify(list(rows[n:]))         # continue from the partial commit
    for j, row in enumerate(out.logits):
        assert close(row, ref_logits[n + j])
    tgt.commit(len(rows) - n)
    assert close(tgt.verify([rows[0]]).logits[-1], tail)
