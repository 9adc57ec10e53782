"""Token distributions shared by the target and the draft.

Speculative sampling is lossless only if the draft's proposal distribution q and the target's
p are built by the same transform of their logits, so both go through `probs` here.

The order of the transforms (vLLM's): the logit bias is added to the raw logits (`biased`), then
the history penalties (presence, frequency, repetition: k3kit.runtime.sampling.History, which
needs the tokens seen so far and so lives with the Sampler), then `probs`: temperature, top-k,
min-p, top-p. Greedy is the argmax of the biased and penalized logits (temperature, top-k,
min-p and top-p cannot change it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from k3kit.errors import K3Error

MAX_LOGIT_BIAS = 100.0          # OpenAI's range for logit_bias values: [-100, 100]
MAX_PENALTY = 2.0               # OpenAI's range for presence/frequency penalties: [-2, 2]


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0      # 0: greedy
    top_k: int = 0                # 0: off
    top_p: float = 1.0            # 1: off
    seed: int = 0
    min_p: float = 0.0            # 0: off; drops tokens below min_p * the best token's probability
    presence_penalty: float = 0.0     # 0: off; OpenAI's, over the generated tokens
    frequency_penalty: float = 0.0    # 0: off; OpenAI's, over the generated tokens
    repetition_penalty: float = 1.0   # 1: off; vLLM's, over the prompt and the generated tokens
    logit_bias: tuple[tuple[int, float], ...] = ()    # (token id, bias) added to the logits

    def __post_init__(self) -> None:
        if (self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0 or not 0 <= self.min_p <= 1
                or not -MAX_PENALTY <= self.presence_penalty <= MAX_PENALTY
                or not -MAX_PENALTY <= self.frequency_penalty <= MAX_PENALTY
                or not self.repetition_penalty > 0 or self.repetition_penalty == float("inf")
                or any(t < 0 or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for t, b in self.logit_bias)):
            raise K3Error(f"sampling: bad parameters {self}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether a token's logit depends on the tokens before it (presence, frequency or
        repetition penalty): picking needs the history (k3kit.runtime.sampling.History)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed)


@functools.lru_cache(maxsize=256)
def _bias_tensors(bias: tuple[tuple[int, float], ...]) -> tuple[Tensor, Tensor]:
    ids = torch.tensor([t for t, _ in bias], dtype=torch.long)
    return ids, torch.tensor([b for _, b in bias], dtype=torch.float64)


def biased(logits: Tensor, s: Sampling) -> Tensor:
    """Rows of logits [..., V] with `s.logit_bias` added (in the logits' dtype); the same tensor
    when there is no bias."""
    if not s.logit_bias:
        return logits
    ids, vals = _bias_tensors(s.logit_bias)
    vals = vals.to(logits.device, logits.dtype).expand(*logits.shape[:-1], len(ids))
    return logits.index_add(-1, ids.to(logits.device), vals)


def probs(logits: Tensor, s: Sampling) -> Tensor:
    """Rows of logits [..., V] -> float64 probabilities after temperature, top-k, min-p and top-p.
    The logits are the biased (and, where the sampling has them, penalized) ones: `biased`."""
    x = logits.to(torch.float64) / s.temperature
    if s.top_k and s.top_k < x.shape[-1]:
        kth = torch.topk(x, s.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if s.min_p > 0.0:
        p = p * (p >= s.min_p * p.amax(dim=-1, keepdim=True))
        p = p / p.sum(dim=-1, keepdim=True)
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
    """One token from one row of logits (the logit bias added; no history penalties: those need
    a k3kit.runtime.sampling.Sampler)."""
    x = biased(logits, s)
    if s.greedy:
        return int(torch.argmax(x).item())
    return sample(probs(x, s), gen)
