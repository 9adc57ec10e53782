"""The torch K3Model as a speculative-runtime Target, and acceptance measured with the real loop.

The drafter is trained against the HF (torch) mini K3, so its acceptance is measured against
the same model through k3kit.runtime.speculative's loop: verify runs rows speculatively (KDA
state untouched, rows captured), commit replays the accepted ones (`K3Model.commit_rows`).
The GGUF adapter (k3kit.adapters.kimi_k3) is the same contract over file-backed weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from k3kit.adapters.dflash import DSparkDrafter
from k3kit.models.dflash.network import DSparkDraft
from k3kit.models.kimi_k3.model import Captured, K3Model
from k3kit.runtime.speculative import (
    DecodeStats,
    Sampling,
    ScheduleConfig,
    VerifyOutput,
    speculative_generate,
)


class TorchK3Target:
    """One sequence of a torch K3Model behind the runtime's Target protocol."""

    def __init__(self, model: K3Model, tap_layers: Sequence[int]):
        self.model = model.eval()
        self.tap_layers = tuple(int(i) for i in tap_layers)
        self.vocab_size = model.cfg.vocab_size
        self.state = model.new_state(1)
        self._pending: Captured | None = None

    @property
    def position(self) -> int:
        return self.state.pos

    @torch.no_grad()
    def verify(self, ids: Sequence[int], capture: bool = True, all_logits: bool = True) -> VerifyOutput:
        taps = self.tap_layers if capture else ()
        t = torch.tensor([list(ids)], dtype=torch.long)
        out = self.model(t, self.state, capture_layers=taps, speculative=True,
                         logits="all" if all_logits else "last")
        self._pending = out.captured
        feats = torch.cat([out.layer_inputs[il][0] for il in taps], dim=-1).float() if capture else None
        return VerifyOutput(out.logits[0].float(), feats)

    def commit(self, n: int) -> None:
        if self._pending is None:
            if n:
                raise ValueError("commit without a pending verify")
            return
        self.model.commit_rows(self.state, self._pending, n)
        self._pending = None

    def rollback(self) -> None:
        self.commit(0)

    def cost(self, n_rows: int) -> float:
        return 1.0          # weights resident: verify width is free, the scheduler goes widest

    def embed(self, ids: Tensor) -> Tensor:
        return self.model.embed(ids)

    def head(self, hidden: Tensor) -> Tensor:
        return self.model.lm_head(hidden)


@dataclass
class Acceptance:
    """Greedy speculative decoding over some prompts: tokens committed per target pass (tau)
    and how many of the block's proposals each pass accepted."""

    tau: float
    passes: int
    tokens: int
    histogram: list[int]            # [m] = passes that accepted m proposals

    def to_dict(self) -> dict:
        return {"tau": self.tau, "passes": self.passes, "tokens": self.tokens, "histogram": self.histogram}


def attach(draft: DSparkDraft, target: K3Model) -> DSparkDraft:
    """Give the draft the target's embedding and LM head (borrowed, frozen)."""
    draft.set_target(target.embed.weight.detach(), target.lm_head.weight.detach())
    return draft


@torch.no_grad()
def measure_acceptance(target: K3Model, draft: DSparkDraft, prompts: Sequence[Sequence[int]],
                       max_tokens: int) -> Acceptance:
    """Greedy decode every prompt with the runtime's speculative loop, full verify width
    (anchor + all proposals), and pool the statistics."""
    was = draft.training
    draft.eval()
    taps = [i + 1 for i in draft.cfg.target_layer_ids]      # HF id i = input of layer i + 1
    attach(draft, target)
    committed, hist = [], [0] * (draft.cfg.n_proposals + 1)
    for p in prompts:
        tgt = TorchK3Target(target, taps)
        r = speculative_generate(tgt, DSparkDrafter(draft), list(p), max_tokens, Sampling(),
                                 schedule=ScheduleConfig(budget=draft.cfg.n_proposals + 1),
                                 ring_storage="f32")
        st: DecodeStats = r.stats
        committed += st.committed_per_pass
        hist = [a + b for a, b in zip(hist, st.acceptance_histogram, strict=True)]
    draft.train(was)
    n = len(committed)
    return Acceptance(sum(committed) / max(1, n), n, sum(committed), hist)
