"""Deciding how many proposals the target accepts.

Greedy: the longest prefix where proposal k equals the target's argmax at row k, plus the
target's own token at the first mismatch (or after the last proposal: the bonus).

Sampling (Leviathan et al. / Chen et al.): proposal x_k ~ q_k is kept with probability
min(1, p_k(x_k) / q_k(x_k)); on the first rejection the replacement is drawn from
norm(max(0, p_k - q_k)); if every proposal survives, the bonus is drawn from p at the last row.
The output is then distributed exactly as sampling the target alone.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3kit.runtime.speculative.sampling import sample


def accept_greedy(proposals: list[int], target_logits: Tensor) -> tuple[int, int]:
    """-> (accepted count m, next token). target_logits has len(proposals) + 1 rows."""
    assert target_logits.shape[0] == len(proposals) + 1
    best = torch.argmax(target_logits, dim=-1).tolist()
    m = 0
    while m < len(proposals) and proposals[m] == best[m]:
        m += 1
    return m, best[m]


def accept_sampled(proposals: list[int], q: Tensor, p: Tensor, gen: torch.Generator) -> tuple[int, int]:
    """-> (accepted count m, next token). q: [P, V] draft, p: [P + 1, V] target distributions."""
    assert p.shape[0] == len(proposals) + 1 and q.shape[0] >= len(proposals)
    for k, x in enumerate(proposals):
        pk, qk = p[k, x].item(), q[k, x].item()
        u = torch.rand((), generator=gen, dtype=torch.float64).item()
        if qk > 0 and u * qk < pk:          # u < p/q without dividing
            continue
        resid = (p[k] - q[k]).clamp_min(0)
        total = resid.sum()
        # p == q up to rounding cannot reject; if rounding says otherwise fall back to p itself
        return k, sample(resid / total if total > 0 else p[k], gen)
    return len(proposals), sample(p[len(proposals)], gen)
