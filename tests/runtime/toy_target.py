"""A tiny recurrent causal LM with the target contract the speculative runtime expects.

Shaped like a hybrid linear-attention target: every layer has a short conv over its inputs
(window 2) and a gated diagonal recurrence s_t = a_t * s_{t-1} + (1 - a_t) * b_t. `verify`
runs rows from copies of the committed state and captures per-row (a, b) and the conv input,
so it never mutates committed state; `commit(n)` replays only the first n rows from that
capture (no projection recomputed) or, when every row was accepted, adopts the state verify
already reached. float64 and per-row evaluation keep batched and one-row runs bit-identical.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from torch import Tensor

from k3kit.models.dflash.config import DraftConfig
from k3kit.runtime.protocols import VerifyOutput


class ToyTarget:
    def __init__(self, vocab: int = 32, hidden: int = 16, n_layers: int = 4,
                 tap_layers: Sequence[int] = (0, 2), seed: int = 0, state_weight: float = 1.0,
                 cost: Callable[[int], float] | None = None, logit_scale: float = 3.0):
        g = torch.Generator().manual_seed(seed)

        def w(*shape, s=1.0):
            return torch.randn(*shape, generator=g, dtype=torch.float64) * s / shape[-1] ** 0.5

        self.vocab_size, self.hidden, self.n_layers = vocab, hidden, n_layers
        self.tap_layers = tuple(sorted(tap_layers))
        self.emb = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
        self.head_w = w(vocab, hidden, s=logit_scale)
        self.wa = [w(hidden, hidden) for _ in range(n_layers)]
        self.wb = [w(hidden, hidden) for _ in range(n_layers)]
        self.wc = [w(hidden, hidden, s=0.5) for _ in range(n_layers)]
        self.wo = [w(hidden, 2 * hidden) for _ in range(n_layers)]
        self.state_weight = state_weight
        self._cost = cost or (lambda n: 1.0)
        self.reset()

    # ---------------------------------------------------------------- state
    def reset(self) -> None:
        self.s = [torch.zeros(self.hidden, dtype=torch.float64) for _ in range(self.n_layers)]
        self.conv = [torch.zeros(self.hidden, dtype=torch.float64) for _ in range(self.n_layers)]
        self._position = 0
        self._pending = None
        self.replay_fast_commits = self.replay_full_replays = self.replay_failed_fallbacks = 0
        self.rows_replayed = 0

    @property
    def position(self) -> int:
        return self._position

    def state(self) -> list[Tensor]:
        return [t.clone() for t in (*self.s, *self.conv)]

    def clone(self) -> ToyTarget:
        other = object.__new__(ToyTarget)
        other.__dict__.update(self.__dict__)
        other.s = [t.clone() for t in self.s]
        other.conv = [t.clone() for t in self.conv]
        other._pending = None
        return other

    # ---------------------------------------------------------------- contract
    def embed(self, ids: Tensor) -> Tensor:
        return self.emb[ids]

    def head(self, hidden: Tensor) -> Tensor:
        return hidden.to(torch.float64) @ self.head_w.T

    def cost(self, n_rows: int) -> float:
        return self._cost(n_rows)

    def counters(self) -> dict[str, int]:
        return {"replay_fast_commits": self.replay_fast_commits,
                "replay_full_replays": self.replay_full_replays,
                "replay_failed_fallbacks": self.replay_failed_fallbacks}

    def _step(self, l: int, x: Tensor, s: Tensor, prev: Tensor):
        u = x + self.wc[l] @ prev                       # conv over (previous input, this input)
        a = torch.sigmoid(self.wa[l] @ u)
        b = torch.tanh(self.wb[l] @ u)
        s = a * s + (1 - a) * b
        out = x + torch.tanh(self.wo[l] @ torch.cat([u, self.state_weight * s]))
        return out, s, a, b

    def verify(self, ids: Sequence[int], capture: bool = True, all_logits: bool = True) -> VerifyOutput:
        ids = [int(t) for t in ids]
        if not ids or any(not 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"bad verify rows {ids}")
        s = list(self.s)
        prev = list(self.conv)
        cap_a = [[] for _ in range(self.n_layers)]
        cap_b = [[] for _ in range(self.n_layers)]
        cap_x = [[] for _ in range(self.n_layers)]
        logits, taps = [], []
        for t in ids:
            x = self.emb[t]
            row_taps = []
            for l in range(self.n_layers):
                cap_x[l].append(x)
                x_next, s[l], a, b = self._step(l, x, s[l], prev[l])
                prev[l] = x
                cap_a[l].append(a)
                cap_b[l].append(b)
                x = x_next
                if l in self.tap_layers:
                    row_taps.append(x)
            logits.append(self.head(x))
            taps.append(torch.cat(row_taps))          # layers in increasing order = tap order
        self._pending = (len(ids), cap_a, cap_b, cap_x, s)
        logits = torch.stack(logits) if all_logits else logits[-1][None]
        return VerifyOutput(logits, torch.stack(taps) if capture else None)

    def commit(self, n: int) -> None:
        if self._pending is None or not 0 <= n <= self._pending[0]:
            raise ValueError(f"commit({n}) without enough verified rows")
        rows, cap_a, cap_b, cap_x, s_end = self._pending
        if n == rows:
            self.s = s_end
            self.replay_fast_commits += 1
        elif n > 0:
            for l in range(self.n_layers):
                s = self.s[l]
                for i in range(n):
                    s = cap_a[l][i] * s + (1 - cap_a[l][i]) * cap_b[l][i]
                self.s[l] = s
            self.replay_full_replays += 1
            self.rows_replayed += n
        if n > 0:
            self.conv = [cap_x[l][n - 1] for l in range(self.n_layers)]
        self._position += n
        self._pending = None

    def rollback(self) -> None:
        self._pending = None

    # ---------------------------------------------------------------- helpers for tests
    def greedy_continuation(self, anchor: int, n: int) -> list[int]:
        """The next n greedy tokens after `anchor` from the committed state, without touching it."""
        other, out, tok = self.clone(), [], anchor
        for _ in range(n):
            tok = int(torch.argmax(other.verify([tok], capture=False).logits[-1]))
            other.commit(1)
            out.append(tok)
        return out


class OracleDraft:
    """A toy draft that knows the target's greedy continuation and tells the truth for each
    row with probability `p_good` (a random token otherwise), so acceptance varies pass to pass.
    Its logits are peaked at the chosen token: under sampling q is a real, non-degenerate
    distribution that differs from the target's p."""

    has_markov = False
    has_confidence = False

    def __init__(self, target: ToyTarget, block_size: int, p_good: float, seed: int = 0,
                 peak: float = 3.0):
        self.target, self.block_size, self.p_good, self.peak = target, block_size, p_good, peak
        self.gen = torch.Generator().manual_seed(seed)
        self.synced = -1

    @property
    def n_proposals(self) -> int:
        return self.block_size

    @property
    def feature_width(self) -> int:
        return len(self.target.tap_layers) * self.target.hidden

    def sync(self, ring) -> None:
        assert ring.length == self.target.position
        self.synced = ring.length

    def draft_block(self, anchor: int, position: int):
        from k3kit.runtime.protocols import DraftBlock

        assert position == self.synced == self.target.position
        truth = self.target.greedy_continuation(anchor, self.block_size)
        v = self.target.vocab_size
        logits = torch.randn(self.block_size, v, generator=self.gen, dtype=torch.float64) * 0.3
        for k in range(self.block_size):
            good = torch.rand((), generator=self.gen).item() < self.p_good
            tok = truth[k] if good else int(torch.randint(v, (), generator=self.gen))
            logits[k, tok] += self.peak
        return DraftBlock(logits=logits, hidden=torch.zeros(self.block_size, 1, dtype=torch.float64))


def bigram_dspark(target: ToyTarget, block: int):
    """A DSpark draft whose block rows carry nothing (final norm zeroed) and whose Markov head
    holds the target's bigram argmax from a fresh state: good when the target's state matters
    little, and only if the chain is seeded by the anchor and run left to right."""
    from k3kit.adapters.dflash import DSparkDrafter
    from k3kit.models.dflash.config import DraftConfig
    from k3kit.models.dflash.network import DSparkDraft

    v = target.vocab_size
    fresh = target.clone()
    fresh.reset()
    bigram = [fresh.greedy_continuation(t, 1)[0] for t in range(v)]
    cfg = DraftConfig(hidden_size=target.hidden, num_layers=1, num_heads=2, num_kv_heads=2,
                      head_dim=target.hidden // 2, intermediate_size=16, vocab_size=v, block_size=block,
                      target_layer_ids=target.tap_layers, mask_token_id=0, markov_rank=v,
                      has_confidence=True)
    torch.manual_seed(0)
    d = DSparkDraft(cfg, embed=target.emb, lm_head=target.head_w).double()
    with torch.no_grad():
        d.norm.weight.zero_()
        d.markov_head.markov_w1.weight.copy_(torch.eye(v, dtype=torch.float64))
        w2 = torch.zeros(v, v, dtype=torch.float64)
        w2[bigram, torch.arange(v)] = 10.0
        d.markov_head.markov_w2.weight.copy_(w2)
    return DSparkDrafter(d)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: thread hand-off costs more than the math, badly so on a loaded 2-core box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def draft_config(**kw) -> DraftConfig:
    """A toy DSpark/DFlash drafter's config (vocab 32, hidden 16, block 5, taps 0 and 2, Markov
    rank 4, a confidence head) with `kw` changed."""
    base = dict(hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=24,
                vocab_size=32, block_size=5, target_layer_ids=(0, 2), mask_token_id=31, markov_rank=4,
                has_confidence=True, rms_norm_eps=1e-5, rope_theta=1000.0)
    base.update(kw)
    return DraftConfig(**base)
