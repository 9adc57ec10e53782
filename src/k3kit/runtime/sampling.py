"""Choosing the next token: greedy, or temperature / top-k / top-p sampling with a seed.

The distribution transform is the one the speculative runtime uses
(`k3kit.runtime.speculative.sampling.probs`): plain and speculative decoding must sample
from exactly the same distribution, or speculative sampling is no longer lossless. Draws
come from one `torch.Generator` per generation, seeded once, so the same seed and the same
logits give the same tokens; temperature 0 is argmax and draws nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3kit.errors import K3Error
from k3kit.runtime.speculative.sampling import Sampling, probs

__all__ = ["Sampling", "Sampler", "make_sampling"]


def make_sampling(temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None
                  ) -> Sampling:
    """Validated sampling parameters (K3Error naming the bad one). seed None: from the OS."""
    if not temperature >= 0 or temperature != temperature:
        raise K3Error(f"--temperature {temperature}: must be >= 0")
    if not 0 < top_p <= 1:
        raise K3Error(f"--top-p {top_p}: must be in (0, 1]")
    if top_k < 0:
        raise K3Error(f"--top-k {top_k}: must be >= 0 (0 = off)")
    if seed is None:
        seed = int(torch.seed()) % (1 << 63)
    if not 0 <= seed < (1 << 63):
        raise K3Error(f"--seed {seed}: must be in [0, 2**63)")
    return Sampling(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p), seed=int(seed))


class Sampler:
    """Stateful token picker: one generator, advanced by every sampled token."""

    def __init__(self, sampling: Sampling):
        self.sampling = sampling
        self.generator = sampling.generator()

    def __call__(self, logits: Tensor) -> int:
        """One token from a row of logits [V]."""
        row = logits.reshape(-1)
        if self.sampling.greedy:
            return int(torch.argmax(row).item())
        p = probs(row, self.sampling)
        return int(torch.multinomial(p, 1, generator=self.generator).item())
