"""Token distributions shared by the target and the draft.

Speculative sampling is lossless only if the draft's proposal distribution q and the target's
p are built by the same transform of their logits, so both go through `probs` here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from k3kit.errors import K3Error


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0      # 0: greedy
    top_k: int = 0                # 0: off
    top_p: float = 1.0            # 1: off
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise K3Error(f"sampling: bad parameters {self}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed)


def probs(logits: Tensor, s: Sampling) -> Tensor:
    """Rows of logits [..., V] -> float64 probabilities after temperature, top-k and top-p."""
    x = logits.to(torch.float64) / s.temperature
    if s.top_k and s.top_k < x.shape[-1]:
        kth = torch.topk(x, s.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if s.top_p < 1.0:
        sp, idx = torch.sort(p, dim=-1, descending=True)
        before = torch.cumsum(sp, dim=-1) - sp          # mass strictly above each token
        keep = before < s.top_p                         # smallest prefix reaching top_p
        sp = sp * keep
        p = torch.zeros_like(p).scatter(-1, idx, sp)
        p = p / p.sum(dim=-1, keepdim=True)
    return p


def sample(p: Tensor, gen: torch.Generator | None) -> int:
    """One token id drawn from probabilities `p` [V]; `gen` None: torch's default generator."""
    return int(torch.multinomial(p, 1, generator=gen).item())


def pick(logits: Tensor, s: Sampling, gen: torch.Generator) -> int:
    """One token from one row of logits."""
    if s.greedy:
        return int(torch.argmax(logits).item())
    return sample(probs(logits, s), gen)
