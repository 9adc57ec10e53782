"""The contract: what the runtime needs from a model, and what a loaded model gives its users.

The runtime never names an architecture. An adapter (k3kit.adapters.<arch>) turns a file
into an object with these shapes; the engine, the speculative decoder, the CLI, the
benchmarks and the server use only them.

CausalModel (what `k3kit.runtime.engine.generate` drives) — one sequence:
  * `forward(ids, all_logits=False)` runs len(ids) rows after the committed state, commits
    them and returns float32 logits: every row's [n, V], or the last row's [1, V];
  * `reset()` starts a new sequence; `position` is the number of committed rows;
  * `vocab_size` bounds the ids it accepts and the logits it returns; `context_length` is
    the positions one sequence may hold (prompt + generated tokens).

ExpertLedger — a model whose routed experts are read from its file through an expert store:
  * `expert_stats()` is the store's ledger (k3kit.runtime.experts.ExpertStats). The engine
    reports the payload of a generation as the difference of two snapshots, so the figure
    is what was read, not an estimate. Models without one report zero payload.
ExpertBacked adds what the CLI shows about that store: `memory()` and `expert_kernel`.

Target (the big model of speculative decoding) — rows are token ids fed after the committed state:
  * `verify(ids, capture, all_logits)` runs len(ids) rows at positions position .. position+n-1
    on top of the committed state and returns logits per row (row j predicts the token after
    ids[j]; only the last row when all_logits=False, as in prefill) and, with capture, the tap
    features of every row: the hidden states of `tap_layers`, concatenated in that order,
    [n, n_taps * hidden]. It must NOT change committed state: recurrent state stays pristine,
    attention caches may hold the rows only as pending.
  * `commit(n)` makes the first n rows of the last verify permanent (position += n) and drops
    the rest. A recurrent target replays only those n rows from what verify captured.
  * `rollback()` drops the pending rows without committing anything (same as commit(0)).
  * `cost(n)` is the expected cost of verifying n rows. The scheduler only compares it with
    itself (it maximises expected tokens / cost), so any positive unit works; the K3 adapter
    returns estimated SECONDS of the pass (trunk and per-row compute, plus reading and
    dequantizing the experts its cache would not hold), which lets the decoder add the draft
    step's measured time to it: ScheduleConfig(draft_cost=None).
  * `embed(ids)` / `head(hidden)` are the token embedding and LM head a draft borrows.
  * optional `counters() -> dict[str, int]` (e.g. replay_fast_commits) merged into the stats.

Draft — produces one block of proposals per call:
  * `feature_width` = n_taps * target hidden: the width of the rows it reads from the ring;
  * `sync(ring)` brings its context (projected K/V of committed tap features) up to the ring;
  * `draft_block(anchor, position)` runs one forward over [anchor, MASK x (B-1)] placed at
    position .. position+B-1 and returns the base logits and hidden rows of the proposal rows;
  * Markov / confidence heads, when present (`has_markov`, `has_confidence`);
  * optional `draft_blocks(contexts, anchors, positions)`: N sequences' blocks in one forward,
    each equal to its own `draft_block` (a batching server drafts every sequence at once; found
    by `hasattr`, serial `draft_block` calls otherwise).
AttachableDraft is a draft loaded from its own file: `attach(target)` borrows the target's
embedding and LM head, checks that the two fit and tells the target which layers to capture
(`set_taps`); `set_block_size(k)` runs it with fewer proposals than it was trained for.

BatchedModel — several sequence states per model and one pass over rows of many of them
(see the class); the continuous-batching server (k3kit.serve.batch) needs only this.
SpeculativeBatchedModel adds draft-block verification inside those passes, per sequence.
SnapshotModel adds copying a sequence's state out and back in (`SequenceState`): what the
server's prompt cache (k3kit.serve.prompt_cache) keeps between requests.

LoadedModel — a model file opened by `k3kit.adapters.load_model`: its `architecture`, the
`model` object (a CausalModel and Target for a target, a Draft for a draft), the text
`codec` built from the file's tokenizer, the expert ledger (`stats()`), `memory()` figures,
the `expert_kernel` that multiplies its experts, `check()` (the file is unchanged) and
`close()`. Today the model object is one sequence; what belongs to the weights (the store,
its ledger, memory, the file) is on the LoadedModel so that several sequences can share it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from torch import Tensor

from k3kit.runtime.experts import ExpertStats

if TYPE_CHECKING:   # runtime.speculative imports this module: no cycle at run time
    from k3kit.runtime.speculative.feature_ring import FeatureRing


@runtime_checkable
class CausalModel(Protocol):
    vocab_size: int
    context_length: int

    @property
    def position(self) -> int: ...

    def reset(self) -> None: ...

    def forward(self, ids: Sequence[int], all_logits: bool = False) -> Tensor: ...


@runtime_checkable
class BatchedModel(Protocol):
    """Several sequences through one set of weights (what a batching server drives).

    `open_sequence()` makes an empty sequence state and returns its handle; `close_sequence(h)`
    frees it; `sequences` counts the open ones. `forward_batch([(h, ids), ...])` runs every
    entry's rows in ONE pass, each after (and committed to) its own sequence, and returns float32
    logits [entries, V] of each entry's last row. A model batches what it can across the entries
    (for K3: every row-wise product and the routed experts, each read once per pass) and runs
    attention per sequence. `batch_invariant_rows` is how many rows a pass may hold while each
    row's result stays bitwise independent of the other rows (0: no such guarantee); a
    scheduler that promises batch invariance keeps mixed passes within it. The single-sequence
    CausalModel API of the same object is separate and unaffected.
    """

    vocab_size: int
    context_length: int

    @property
    def sequences(self) -> int: ...

    @property
    def batch_invariant_rows(self) -> int: ...

    def open_sequence(self) -> int: ...

    def close_sequence(self, seq: int) -> None: ...

    def forward_batch(self, rows: Sequence[tuple[int, Sequence[int]]]) -> Tensor: ...


@runtime_checkable
class SpeculativeBatchedModel(BatchedModel, Protocol):
    """A BatchedModel that verifies draft blocks inside its shared passes (batched speculation).

    `verify_batch(rows, verify=handles, capture=handles)` is forward_batch returning one
    VerifyOutput per entry: an entry whose handle is in `verify` is a verify block (rows not
    committed, every row's logits; `commit_sequence(h, n)` keeps the first n, as Target.commit),
    the others commit and return their last row; entries in `capture` carry their rows' tap
    features. `sequence_target(h)` is one sequence as a Target (verify/commit/cost/embed/head),
    what a SpeculativeDecoder drives; `cost(n)` is the Target cost of a pass of n rows.
    """

    tap_layers: tuple[int, ...]

    def verify_batch(self, rows: Sequence[tuple[int, Sequence[int]]], *, verify: Collection[int] = (),
                     capture: Collection[int] = ()) -> list[VerifyOutput]: ...

    def commit_sequence(self, seq: int, n: int) -> None: ...

    def sequence_target(self, seq: int) -> Target: ...

    def cost(self, n_rows: int) -> float: ...


@dataclass(frozen=True)
class SequenceState:
    """A copy of one sequence's state after `pos` committed tokens, split by how it can be reused.

    `recurrent`: fixed-size tensors that summarize every position (K3: each KDA layer's S and
    conv window); valid only at exactly `pos`. `positional`: one tensor per position-indexed
    cache, rows [0, pos) along dim 0 (K3: each MLA layer's latent kv and pe rows); row i depends
    only on tokens [0, i], so the first p rows serve any sequence that shares those p tokens.
    Empty when the copy was asked without them. Tensors live on the CPU."""

    pos: int
    recurrent: tuple[Tensor, ...]
    positional: tuple[Tensor, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.recurrent, *self.positional))


@runtime_checkable
class SnapshotModel(BatchedModel, Protocol):
    """A BatchedModel whose sequence states can be copied out and restored (a prompt cache).

    `sequence_state(h, positional)` copies sequence h's committed state (pending verify rows
    excluded); `load_sequence_state(h, recurrent, positional, pos)` replaces h's state with the
    one at `pos`: the recurrent tensors taken at `pos` and the first `pos` rows of each
    positional tensor. Shapes and dtypes that do not fit raise ValueError and leave h as it was.
    `positional_row_bytes` is the bytes one position adds; `recurrent_bytes` one recurrent copy."""

    def sequence_state(self, seq: int, positional: bool = True) -> SequenceState: ...

    def load_sequence_state(self, seq: int, recurrent: Sequence[Tensor], positional: Sequence[Tensor],
                            pos: int) -> None: ...

    @property
    def positional_row_bytes(self) -> int: ...

    @property
    def recurrent_bytes(self) -> int: ...


@dataclass(frozen=True)
class RoutedExperts:
    """One layer's routed experts as the store holds them."""

    layer: int
    n_experts: int
    file_bytes: int       # one expert, all projections, as the file stores it (a miss reads this)
    cached_bytes: int     # the same expert as the cache holds it (what the budget counts)


@dataclass(frozen=True)
class MemoryFigures:
    """What a loaded model's weights take, in bytes."""

    trunk_bytes: int = 0           # non-expert weights as held in memory for compute
    trunk_file_bytes: int = 0      # the same weights as stored in the file (read at load)
    expert_cache_bytes: int = 0    # held by the expert cache now (pinned included)
    expert_cache_budget: int = 0   # the cache's budget
    experts_per_token: int = 0     # routed experts each token uses per layer (top-k)
    experts: tuple[RoutedExperts, ...] = ()
    trunk: str = "float"           # "float" (dequantized to the compute dtype) or "quantized" (file bytes)
    input_bytes: int = 0           # of trunk_bytes, the input embedding table (a token reads one row)


@runtime_checkable
class ExpertLedger(Protocol):
    def expert_stats(self) -> ExpertStats: ...


@runtime_checkable
class ExpertBacked(ExpertLedger, Protocol):
    @property
    def expert_kernel(self) -> str: ...

    def memory(self) -> MemoryFigures: ...

    def reset_expert_cache(self, cache_mib: float | None = None) -> None: ...


@dataclass
class VerifyOutput:
    logits: Tensor             # [n, V]
    taps: Tensor | None        # [n, n_taps * hidden] when captured


@runtime_checkable
class CommittingTarget(Protocol):
    """A Target that can also run rows committed at once with their tap features: a speculative
    decoder's one-row (plain) pass, which has no proposals to reject and so nothing to keep
    pending, runs as a plain decode step (a target's `forward`) instead of a verify and a commit."""

    def forward_taps(self, ids: Sequence[int]) -> VerifyOutput: ...


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


@runtime_checkable
class AttachableDraft(Draft, Protocol):
    def set_block_size(self, block_size: int | None) -> None: ...

    def attach(self, target: Target) -> None: ...


class TokenStream(Protocol):
    def push(self, token: int) -> str: ...

    def flush(self) -> str: ...


class Codec(Protocol):
    """Text in and out of a model (k3kit's TextCodec is one): what the CLI and server use."""

    @property
    def n_vocab(self) -> int: ...

    def encode(self, text: str, *, add_bos: bool | None = None, special: bool = True) -> list[int]: ...

    def decode_bytes(self, ids: Sequence[int]) -> bytes: ...

    def stop_ids(self) -> set[int]: ...

    def chat_prompt(self, user: str) -> str: ...

    def streamer(self) -> TokenStream: ...


class LoadedModel(Protocol):
    @property
    def architecture(self) -> str: ...

    @property
    def path(self) -> Path: ...

    @property
    def model(self) -> CausalModel | Draft: ...

    @property
    def codec(self) -> Codec: ...

    @property
    def expert_kernel(self) -> str: ...

    def stats(self) -> ExpertStats: ...

    def memory(self) -> MemoryFigures: ...

    def reset_expert_cache(self, cache_mib: float | None = None) -> None: ...

    def check(self) -> None: ...

    def close(self) -> None: ...
