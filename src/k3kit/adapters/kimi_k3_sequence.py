"""One open sequence of a K3Adapter seen as a runtime Target, and a verify's pending rows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

from k3kit.models.kimi_k3.model import Captured
from k3kit.runtime.protocols import VerifyOutput

if TYPE_CHECKING:
    from k3kit.adapters.kimi_k3 import K3Adapter


@dataclass
class Pending:
    captured: Captured | None
    n_rows: int
    ids: list[int]


class SequenceTarget:
    """One open sequence of a K3Adapter as a runtime Target (K3Adapter.sequence_target)."""

    def __init__(self, adapter: K3Adapter, seq: int):
        self.adapter, self.seq = adapter, seq
        self.vocab_size = adapter.vocab_size

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return self.adapter.tap_layers

    @property
    def position(self) -> int:
        return self.adapter.sequence_position(self.seq)

    def verify(self, ids: Sequence[int], capture: bool = True, all_logits: bool = True) -> VerifyOutput:
        """A one-entry pass; all_logits=False (a prompt chunk) commits at once, like the
        single-sequence prefill's verify + commit(all)."""
        a, cap = self.adapter, {self.seq} if capture else set()
        if all_logits:
            return a.verify_batch([(self.seq, ids)], verify={self.seq}, capture=cap)[0]
        out = a.verify_batch([(self.seq, ids)], capture=cap)[0]
        a._seq_pending[self.seq] = Pending(None, len(ids), list(ids))
        return out

    def commit(self, n: int) -> None:
        self.adapter.commit_sequence(self.seq, n)

    def rollback(self) -> None:
        self.adapter.commit_sequence(self.seq, 0)

    def cost(self, n_rows: int) -> float:
        return self.adapter.cost(n_rows)

    def embed(self, ids: Tensor) -> Tensor:
        return self.adapter.embed(ids)

    def head(self, hidden: Tensor) -> Tensor:
        return self.adapter.head(hidden)

    def counters(self) -> dict[str, int]:
        return self.adapter.counters()
