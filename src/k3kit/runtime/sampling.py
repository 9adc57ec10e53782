"""Choosing the next token: greedy, or temperature / top-k / min-p / top-p sampling with a seed,
after the logit bias and the history penalties.

The distribution transform is the one the speculative runtime uses
(`k3kit.runtime.speculative.sampling`: `biased`, then `probs`): plain and speculative decoding
must sample from exactly the same distribution, or speculative sampling is no longer lossless.
Draws come from one `torch.Generator` per generation, seeded once, so the same seed and the same
logits give the same tokens; temperature 0 is argmax (of the biased, penalized logits) and draws
nothing.

The penalties that depend on the tokens before (`History`), added after the logit bias and before
temperature, as vLLM applies them (vLLM's definitions are followed; llama.cpp's differ in that
its penalties see only the last `penalty_last_n` tokens, 64 by default, and its frequency and
presence penalties count the prompt too):
* repetition_penalty r (> 0, 1 = off): a token seen in the prompt or generated so far has its
  logit divided by r when positive, multiplied by r otherwise (CTRL's penalty as vLLM has it);
* frequency_penalty f and presence_penalty a (OpenAI's, in [-2, 2], 0 = off): a token generated
  c times so far in this completion (the prompt does not count) has f * c + a * (c > 0)
  subtracted from its logit.
A Sampler with none of them (and no bias) does no per-token work beyond the plain pick.

A grammar (k3kit.runtime.constraint.Constraint, given to the Sampler) masks the tokens it forbids
after the bias and the penalties and before temperature and truncation, and is advanced over
every token picked.

Logprobs are not this module's: the serving layer reports the log-softmax of the model's raw
logits, before the bias, the penalties and temperature (k3kit.serve.sequence).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from k3kit.errors import K3Error
from k3kit.runtime.speculative.sampling import MAX_LOGIT_BIAS, MAX_PENALTY, Sampling, biased, probs

if TYPE_CHECKING:
    from k3kit.runtime.constraint import Constraint

__all__ = ["History", "Sampling", "Sampler", "make_sampling"]


def make_sampling(temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                  *, min_p: float = 0.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                  repetition_penalty: float = 1.0, logit_bias: dict[int, float] | None = None) -> Sampling:
    """Validated sampling parameters (K3Error naming the bad one). seed None: from the OS."""
    if not temperature >= 0 or temperature != temperature:
        raise K3Error(f"--temperature {temperature}: must be >= 0")
    if not 0 < top_p <= 1:
        raise K3Error(f"--top-p {top_p}: must be in (0, 1]")
    if top_k < 0:
        raise K3Error(f"--top-k {top_k}: must be >= 0 (0 = off)")
    if not 0 <= min_p <= 1:
        raise K3Error(f"min_p {min_p}: must be in [0, 1] (0 = off)")
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise K3Error(f"{name} {value}: must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 = off)")
    if not 0 < repetition_penalty < float("inf"):
        raise K3Error(f"repetition_penalty {repetition_penalty}: must be > 0 (1 = off)")
    bias = tuple(sorted((int(t), float(b)) for t, b in (logit_bias or {}).items() if b != 0))
    for t, b in bias:
        if t < 0 or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
            raise K3Error(f"logit_bias {t}: {b}: token ids must be >= 0 and biases in "
                          f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
    if seed is None:
        seed = int(torch.seed()) % (1 << 63)
    if not 0 <= seed < (1 << 63):
        raise K3Error(f"--seed {seed}: must be in [0, 2**63)")
    return Sampling(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p), seed=int(seed),
                    min_p=float(min_p), presence_penalty=float(presence_penalty),
                    frequency_penalty=float(frequency_penalty), repetition_penalty=float(repetition_penalty),
                    logit_bias=bias)


class History:
    """The tokens a sequence's penalties see: its prompt (repetition only) and the tokens it
    generated (all three), kept as per-vocabulary counts that grow with each token.

    `extend` only appends to a list (the tensors catch up at the next `penalize`), so a token
    costs O(1) until the next pick. `penalize(rows, proposals)` penalizes verify rows of a
    speculative block: row k sees the history plus proposals[:k], exactly as plain decoding would
    see it when it picks that row's token, so acceptance stays lossless."""

    def __init__(self, sampling: Sampling, prompt_ids: Iterable[int] = ()) -> None:
        self.sampling = sampling
        self.prompt = [int(t) for t in prompt_ids]
        self.tokens: list[int] = []               # generated so far
        self._counts: Tensor | None = None        # [V] generated counts (the logits' dtype)
        self._seen: Tensor | None = None          # [V] bool: in the prompt or generated
        self._done = 0                            # tokens already in the tensors

    def extend(self, tokens: Iterable[int]) -> None:
        """Tokens generated (picked, or accepted from a speculative block)."""
        self.tokens.extend(int(t) for t in tokens)

    def _state(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        v = logits.shape[-1]
        if self._counts is None or self._seen is None or self._counts.shape[0] != v:
            self._counts = torch.zeros(v, dtype=logits.dtype, device=logits.device)
            self._seen = torch.zeros(v, dtype=torch.bool, device=logits.device)
            prompt = [t for t in self.prompt if 0 <= t < v]
            if prompt:
                self._seen[torch.tensor(prompt, dtype=torch.long, device=logits.device)] = True
            self._done = 0
        new = [t for t in self.tokens[self._done:] if 0 <= t < v]
        if new:
            idx = torch.tensor(new, dtype=torch.long, device=logits.device)
            self._counts.index_add_(0, idx, torch.ones(len(new), dtype=logits.dtype, device=logits.device))
            self._seen[idx] = True
        self._done = len(self.tokens)
        return self._counts, self._seen

    def _row(self, x: Tensor, counts: Tensor, seen: Tensor) -> Tensor:
        s = self.sampling
        if s.repetition_penalty != 1.0:
            r = s.repetition_penalty
            x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        if s.frequency_penalty:
            x = x - s.frequency_penalty * counts
        if s.presence_penalty:
            x = x - s.presence_penalty * (counts > 0).to(x.dtype)
        return x

    def penalize(self, rows: Tensor, proposals: Sequence[int] = ()) -> Tensor:
        """Rows [R, V] of (biased) logits -> penalized copies; row k with proposals[:k] counted as
        generated after the history (R <= len(proposals) + 1)."""
        if rows.shape[0] > len(proposals) + 1:
            raise ValueError(f"{rows.shape[0]} rows need {rows.shape[0] - 1} proposals, got {len(proposals)}")
        counts, seen = self._state(rows)
        out = []
        for k in range(rows.shape[0]):
            if k:
                if k == 1:                                  # the history's own tensors stay as they are
                    counts, seen = counts.clone(), seen.clone()
                t = int(proposals[k - 1])
                if 0 <= t < counts.shape[0]:
                    counts[t] += 1
                    seen[t] = True
            out.append(self._row(rows[k], counts, seen))
        return torch.stack(out)


class Sampler:
    """Stateful token picker: one generator, advanced by every sampled token, and, when the
    sampling has history penalties, the sequence's `History` (its prompt, and every token this
    sampler picks; a speculative decoder given `history` adds the tokens it accepts); with a
    `constraint`, the sequence's grammar state (likewise: a speculative decoder given it masks its
    verify rows and advances it over the tokens it accepts)."""

    def __init__(self, sampling: Sampling, prompt_ids: Iterable[int] = (),
                 constraint: Constraint | None = None):
        self.sampling = sampling
        self.generator = sampling.generator()
        self.history: History | None = History(sampling, prompt_ids) if sampling.penalized else None
        self.constraint = constraint

    @property
    def ended_at(self) -> int | None:
        """With a constraint: the number of tokens after which its grammar was complete (the
        sequence ends there); None while it is not, or without one."""
        return self.constraint.ended_at if self.constraint is not None else None

    def logits(self, logits: Tensor) -> Tensor:
        """One row of logits [V] as the pick sees it: biased, penalized by the history, masked by
        the constraint."""
        row = biased(logits.reshape(-1), self.sampling)
        if self.history is not None:
            row = self.history.penalize(row[None])[0]
        if self.constraint is not None:
            row = self.constraint.mask(row[None])[0]
        return row

    def __call__(self, logits: Tensor) -> int:
        """One token from a row of logits [V]."""
        row = logits.reshape(-1)
        if self.sampling.logit_bias or self.history is not None or self.constraint is not None:
            row = self.logits(row)
        if self.sampling.greedy:
            token = int(torch.argmax(row).item())
        else:
            p = probs(row, self.sampling)
            token = int(torch.multinomial(p, 1, generator=self.generator).item())
        if self.history is not None:
            self.history.extend((token,))
        if self.constraint is not None:
            self.constraint.consume((token,))
        return token
