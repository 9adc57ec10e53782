"""One draft step: a block forward, then the Markov chain across the block.

The draft forward gives every proposal row its base logits in one pass. DSpark's Markov head
then makes the block semi-autoregressive: row k's logits get W2 . W1[x_{k-1}], where x_{-1} is
the anchor and x_{k-1} the proposal just chosen for row k-1, so the chain runs left to right.
The token chosen for a row is the one the acceptance test will judge: the argmax when greedy,
a sample from q_k (the same transform the target's p goes through) otherwise. Conditioning
row k on the token actually proposed at k-1 is what keeps rejection sampling exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from k3kit.runtime.protocols import Draft
from k3kit.runtime.speculative.sampling import Sampling, probs, sample


@dataclass
class Proposal:
    tokens: list[int]           # P proposals, in order
    logits: Tensor              # [P, V] Markov-corrected logits
    q: Tensor | None            # [P, V] proposal distributions (sampling only)
    confidence: Tensor | None   # [P] c_k, or None without a confidence head


def propose(draft: Draft, anchor: int, position: int, sampling: Sampling,
            gen: torch.Generator | None = None) -> Proposal:
    """Run one draft forward at `position` (the anchor's position) and chain its rows."""
    block = draft.draft_block(anchor, position)
    n = block.logits.shape[0]
    rows, qs, w1s, tokens = [], [], [], []
    prev = anchor
    for k in range(n):
        logits_k = block.logits[k]
        if draft.has_markov:
            w1 = draft.markov_embed(torch.tensor([prev]))
            w1s.append(w1)
            logits_k = logits_k + draft.markov_bias(w1)[0].to(logits_k.dtype)
        if sampling.greedy:
            tok = int(torch.argmax(logits_k).item())
        else:
            q_k = probs(logits_k, sampling)
            tok = sample(q_k, gen)
            qs.append(q_k)
        rows.append(logits_k)
        tokens.append(tok)
        prev = tok
    confidence = None
    if draft.has_confidence and n:      # all rows at once: c_k depends on the chain only via W1[x_{k-1}]
        w1_all = torch.cat(w1s) if w1s else None
        confidence = draft.confidence(block.hidden, w1_all).detach().to(torch.float64)
    return Proposal(
        tokens=tokens,
        logits=torch.stack(rows) if rows else block.logits,
        q=torch.stack(qs) if qs else None,
        confidence=confidence,
    )
