"""What the speculative runtime needs from a target model and from a draft.

Target (the big model) — rows are token ids fed after the committed state:
  * `verify(ids, capture, all_logits)` runs len(ids) rows at positions position .. position+n-1
    on top of the committed state and returns logits per row (row j predicts the token after
    ids[j]; only the last row when all_logits=False, as in prefill) and, with capture, the tap
    features of every row: the hidden states of `tap_layers`, concatenated in that order,
    [n, n_taps * hidden]. It must NOT change committed state: recurrent state stays pristine,
    attention caches may hold the rows only as pending.
  * `commit(n)` makes the first n rows of the last verify permanent (position += n) and drops
    the rest. A recurrent target replays only those n rows from what verify captured.
  * `rollback()` drops the pending rows without committing anything (same as commit(0)).
  * `cost(n)` is the expected cost of verifying n rows, in any unit, only compared with itself:
    e.g. expert bytes that are not cached plus compute. The scheduler divides by it. A target
    whose cost is in seconds (the K3 adapter's is) lets the decoder add the draft step's
    measured time: ScheduleConfig(draft_cost=None).
  * `embed(ids)` / `head(hidden)` are the token embedding and LM head a draft borrows.
  * optional `counters() -> dict[str, int]` (e.g. replay_fast_commits) merged into the stats.

Draft — produces one block of proposals per call:
  * `feature_width` = n_taps * target hidden: the width of the rows it reads from the ring;
  * `sync(ring)` brings its context (projected K/V of committed tap features) up to the ring;
  * `draft_block(anchor, position)` runs one forward over [anchor, MASK x (B-1)] placed at
    position .. position+B-1 and returns the base logits and hidden rows of the proposal rows;
  * Markov / confidence heads, when present (`has_markov`, `has_confidence`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torch import Tensor

from k3kit.runtime.speculative.feature_ring import FeatureRing


@dataclass
class VerifyOutput:
    logits: Tensor             # [n, V]
    taps: Tensor | None        # [n, n_taps * hidden] when captured


@runtime_checkable
class Target(Protocol):
    tap_layers: tuple[int, ...]
    vocab_size: int

    @property
    def position(self) -> int: ...

    def verify(self, ids: Sequence[int], capture: bool = True, all_logits: bool = True) -> VerifyOutput: ...

    def commit(self, n: int) -> None: ...

    def rollback(self) -> None: ...

    def cost(self, n_rows: int) -> float: ...

    def embed(self, ids: Tensor) -> Tensor: ...

    def head(self, hidden: Tensor) -> Tensor: ...


@dataclass
class DraftBlock:
    logits: Tensor             # [P, V] base logits of the P proposal rows (before the Markov bias)
    hidden: Tensor             # [P, H] final-normed hidden rows (the confidence head's input)


@runtime_checkable
class Draft(Protocol):
    has_markov: bool
    has_confidence: bool

    @property
    def n_proposals(self) -> int: ...

    @property
    def feature_width(self) -> int: ...

    def sync(self, ring: FeatureRing) -> None: ...

    def draft_block(self, anchor: int, position: int) -> DraftBlock: ...

    def markov_embed(self, prev: Tensor) -> Tensor: ...

    def markov_bias(self, w1_prev: Tensor) -> Tensor: ...

    def confidence(self, hidden: Tensor, w1_prev: Tensor | None) -> Tensor: ...
