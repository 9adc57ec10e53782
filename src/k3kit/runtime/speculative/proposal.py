"""One draft step: a block forward, then the Markov chain across the block.

The draft forward gives every proposal row its base logits in one pass. DSpark's Markov head
then makes the block semi-autoregressive: row k's logits get W2 . W1[x_{k-1}], where x_{-1} is
the anchor and x_{k-1} the proposal just chosen for row k-1, so the chain runs left to right.
The token chosen for a row is the one the acceptance test will judge: the argmax when greedy,
a sample from q_k (the same transform the target's p goes through, the logit bias included;
the target's history penalties are not the draft's to know) otherwise. Conditioning
row k on the token actually proposed at k-1 is what keeps rejection sampling exact. With a
grammar (a k3kit.runtime.constraint.Constraint), row k is masked with the grammar's state after
the proposals before it, so the block follows the grammar; the masked row is q_k. A greedy
row's pick under a grammar is its best allowed token: the draft's native chain takes the row's
bitmask where it offers `markov_masked`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from k3kit.runtime.protocols import Draft, DraftBlock
from k3kit.runtime.speculative.sampling import Sampling, biased, probs, sample

if TYPE_CHECKING:
    from k3kit.runtime.constraint import Constraint, Walk


@dataclass
class Proposal:
    tokens: list[int]           # P proposals, in order
    logits: Tensor              # [P, V] Markov-corrected logits
    q: Tensor | None            # [P, V] proposal distributions (sampling only)
    confidence: Tensor | None   # [P] c_k, or None without a confidence head


def propose(draft: Draft, anchor: int, position: int, sampling: Sampling,
            gen: torch.Generator | None = None, constraint: Constraint | None = None) -> Proposal:
    """Run one draft forward at `position` (the anchor's position) and chain its rows (under
    `constraint`'s grammar, when given: see the module docstring)."""
    block = draft.draft_block(anchor, position)
    fast = _greedy_chain(draft, block, anchor, sampling) if constraint is None \
        else _masked_chain(draft, block, anchor, sampling, constraint)
    if fast is not None:
        return fast
    n = block.logits.shape[0]
    rows, qs, w1s, tokens = [], [], [], []
    picked: list[Tensor] = []       # greedy: the chain's tokens stay where the logits are
    prev: int | Tensor = anchor
    walk = constraint.walk() if constraint is not None else None
    try:
        for k in range(n):
            logits_k = block.logits[k]
            if draft.has_markov:
                w1 = draft.markov_embed(prev if isinstance(prev, Tensor) else torch.tensor([prev]))
                w1s.append(w1)
                logits_k = logits_k + draft.markov_bias(w1)[0].to(logits_k.dtype)
            if walk is not None:
                if sampling.greedy:
                    tok, logits_k = walk.greedy(biased(logits_k, sampling))
                else:
                    logits_k = walk.mask(biased(logits_k, sampling))
                    q_k = probs(logits_k, sampling)
                    tok = sample(q_k, gen)
                    qs.append(q_k)
                walk.step(tok)
                tokens.append(tok)
                prev = tok
            elif sampling.greedy:
                prev = torch.argmax(biased(logits_k, sampling), dim=-1, keepdim=True)   # [1]: no host read
                picked.append(prev)
            else:
                q_k = probs(biased(logits_k, sampling), sampling)
                tok = sample(q_k, gen)
                qs.append(q_k)
                tokens.append(tok)
                prev = tok
            rows.append(logits_k)
    finally:
        if walk is not None:
            walk.close()
    if picked:
        tokens = torch.cat(picked).tolist()     # one host read for the whole block
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


def _greedy_chain(draft: Draft, block: DraftBlock, anchor: int, sampling: Sampling) -> Proposal | None:
    """A greedy block's whole Markov chain in one call of the draft's `markov_greedy` (optional:
    a draft offers it where its weights allow), or None: the chain runs row by row. The rows it
    gives are what the row-by-row chain computes up to float rounding of the Markov product; the
    target judges the tokens, so greedy output cannot change, and every caller of a block takes
    this same path (`propose` and `chain` alike)."""
    fn = getattr(draft, "markov_greedy", None)
    if fn is None or not draft.has_markov or not sampling.greedy or sampling.logit_bias \
            or not block.logits.shape[0]:
        return None
    out = fn(block.logits, int(anchor))
    if out is None:
        return None
    tokens, rows, w1s = out
    confidence = None
    if draft.has_confidence:
        confidence = draft.confidence(block.hidden, w1s).detach().to(torch.float64)
    return Proposal(tokens=tokens.tolist(), logits=rows, q=None, confidence=confidence)


def _masked_chain(draft: Draft, block: DraftBlock, anchor: int, sampling: Sampling,
                  constraint: Constraint) -> Proposal | None:
    """`_greedy_chain` under a grammar: row k's token is the best one the grammar allows after
    the tokens before it (what the row-by-row chain's `Walk.greedy` picks), each row one native
    call with its bitmask (the walk keeps the masks for the verify, as it does row by row); once
    the walk has ended (the grammar done, or a row with nothing allowed) the rest is one
    `markov_greedy` call. None where the draft has no native chain: the chain runs row by row."""
    masked = getattr(draft, "markov_masked", None)
    greedy = getattr(draft, "markov_greedy", None)
    n = block.logits.shape[0]
    if masked is None or greedy is None or not draft.has_markov or not sampling.greedy \
            or sampling.logit_bias or not n or constraint.stopped:
        return None
    rows: list[Tensor] = []
    w1s: list[Tensor] = []
    tokens: list[int] = []
    prev = int(anchor)
    walk = constraint.walk()
    try:
        for k in range(n):
            if not walk.open:
                rest = greedy(block.logits[k:], prev)
                if rest is None:
                    return None
                tokens += rest[0].tolist()
                rows += list(rest[1].unbind(0))
                w1s += list(rest[2].unbind(0))
                break
            out = masked(block.logits[k], prev, walk.bits())
            if out is None:
                return None
            prev, row, w1 = out
            walk.step(prev)
            tokens.append(prev)
            rows.append(row)
            w1s.append(w1)
    finally:
        walk.close()
    w1_all = torch.stack(w1s)
    confidence = None
    if draft.has_confidence:
        confidence = draft.confidence(block.hidden, w1_all).detach().to(torch.float64)
    return Proposal(tokens=tokens, logits=torch.stack(rows), q=None, confidence=confidence)


def chain(draft: Draft, blocks: Sequence[DraftBlock], anchors: Sequence[int], samplings: Sequence[Sampling],
          gens: Sequence[torch.Generator | None],
          constraints: Sequence[Constraint | None] | None = None) -> list[Proposal]:
    """`propose`'s Markov chain for several draft blocks at once (a server drafting many sequences
    in one forward): step k of every chain together, each sequence choosing with its own sampling
    and generator. One block takes exactly `propose`'s calls, so its proposal is `propose`'s;
    with several, a step's Markov rows are one product, whose rows may round in the last bit
    unlike a one-row product (a GEMV): greedy chains (the target judges their tokens, so their
    output cannot change) may go together, a sampled one (its draws must be the seed's) goes
    alone (decoder.propose_many). `constraints`: each sequence's grammar (or None), as `propose`
    takes it. -> one Proposal per block."""
    n_seq = len(blocks)
    if not n_seq:
        return []
    cons = list(constraints) if constraints is not None else [None] * n_seq
    if all(s.greedy and not s.logit_bias for s in samplings):
        fast: list[Proposal | None] = []
        for b, a, s, c in zip(blocks, anchors, samplings, cons, strict=True):
            fast.append(_greedy_chain(draft, b, a, s) if c is None else _masked_chain(draft, b, a, s, c))
            if fast[-1] is None:
                break
        if len(fast) == n_seq and all(f is not None for f in fast):
            return [f for f in fast if f is not None]
    walks: list[Walk | None] = [c.walk() if c is not None else None for c in cons]
    try:
        return _chain(draft, blocks, anchors, samplings, gens, walks)
    finally:
        for w in walks:
            if w is not None:
                w.close()


def _chain(draft: Draft, blocks: Sequence[DraftBlock], anchors: Sequence[int], samplings: Sequence[Sampling],
           gens: Sequence[torch.Generator | None], walks: Sequence[Walk | None]) -> list[Proposal]:
    n_seq = len(blocks)
    n = blocks[0].logits.shape[0]
    logits = torch.stack([b.logits for b in blocks]) if n_seq > 1 else blocks[0].logits[None]
    rows: list[Tensor] = []
    w1s: list[Tensor] = []
    tokens: list[list[int]] = [[] for _ in blocks]
    qs: list[list[Tensor]] = [[] for _ in blocks]
    prev = [int(a) for a in anchors]
    for k in range(n):
        logits_k = logits[:, k]
        if draft.has_markov:
            w1 = draft.markov_embed(torch.tensor(prev))
            w1s.append(w1)
            logits_k = logits_k + draft.markov_bias(w1).to(logits_k.dtype)
        best = torch.argmax(logits_k, dim=-1).tolist() if any(s.greedy for s in samplings) else []
        masked = []
        for i, s in enumerate(samplings):
            walk = walks[i]
            row = logits_k[i]
            if walk is not None:
                if s.greedy:
                    tok, row = walk.greedy(biased(row, s))
                else:
                    row = walk.mask(biased(row, s))
            elif s.greedy:
                tok = int(best[i]) if not s.logit_bias else int(torch.argmax(biased(row, s)).item())
            if not s.greedy:
                q_k = probs(row if walk is not None else biased(row, s), s)
                tok = sample(q_k, gens[i])
                qs[i].append(q_k)
            if walk is not None:
                walk.step(tok)
            tokens[i].append(tok)
            prev[i] = tok
            masked.append(row)
        rows.append(torch.stack(masked) if any(w is not None for w in walks) else logits_k)
    out = []
    for i, block in enumerate(blocks):
        confidence = None
        if draft.has_confidence and n:
            w1_all = torch.cat([w[i:i + 1] for w in w1s]) if w1s else None
            confidence = draft.confidence(block.hidden, w1_all).detach().to(torch.float64)
        out.append(Proposal(tokens=tokens[i], logits=torch.stack([r[i] for r in rows]),
                            q=torch.stack(qs[i]) if qs[i] else None, confidence=confidence))
    return out
