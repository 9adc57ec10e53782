"""The `kimi-k3` architecture: a GGUF-loaded K3Model trunk + an ExpertStore, one sequence state.

What the runtime sees (k3kit.runtime.protocols: a CausalModel, a Target, an ExpertBacked):
  forward(ids)            run and commit rows (prefill chunks, plain decode); logits
  verify(ids, ...)        run rows on top of the committed state WITHOUT committing: KDA
                          state untouched (rows captured), MLA rows appended as pending
  commit(n) / rollback()  keep the first n verified rows: KDA replays them (commit_rows),
                          MLA caches keep them by position (ReplaySSM, below)
  cost(n)                 estimated seconds of a verify pass of n rows: per-pass trunk and
                          per-row compute, plus reading (and dequantizing) the experts the
                          cache would not hold (runtime.speculative.schedule.verify_seconds)
  embed / head / tap_layers   what a draft borrows and reads
  expert_stats / memory / expert_kernel   the store's ledger and figures, for the CLI

ReplaySSM: verification never touches the committed KDA state; commit(n) applies the first n
rows' transitions from the per-row inputs verify captured (a "fast commit": no expert is read
again). If the capture cannot be used (it does not match the state), the accepted rows are
run again through the whole model from the committed state (a "full replay", which re-reads
their experts); if that fails too, the state is rebuilt from the committed token history (a
"failed fallback"). The three counters are reported with the decode statistics; in normal
operation only fast commits happen.

Routed experts: the MoE asks the provider once per distinct expert per forward and runs all
of that expert's rows together (route batching); the provider serves it from the store,
which reads the expert's bytes from the file only on a cache miss, and one expert at a time,
so a batch never holds more than one uncached expert's weights, plus (quantized cache) the
next planned miss being read in the background.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager, nullcontext
from functools import partial

import torch
from gguf import GGMLQuantizationType
from torch import Tensor, nn

from k3kit.adapters.kimi_k3_sequence import Pending as _Pending
from k3kit.adapters.kimi_k3_sequence import SequenceTarget
from k3kit.adapters.kimi_k3_state import SequenceSnapshots
from k3kit.adapters.store_experts import StoreExperts
from k3kit.kernels import threads as kthreads
from k3kit.kernels.gpu import supports as gpu_supports
from k3kit.kernels.qmatmul import DEFAULT_ARITH, NATIVE_TYPES, invariant_rows, kernel_label, native_simd
from k3kit.layers.moe import GROUPED_MAX_ROWS
from k3kit.layers.quantized_linear import QuantizedEmbedding, QuantizedLinear, quantized_modules
from k3kit.models.kimi_k3.config import K3ModelConfig
from k3kit.models.kimi_k3.gguf_load import (
    build_trunk,
    config_from_source,
    expert_tensor_names,
    ggml_input_kinds,
)
from k3kit.models.kimi_k3.mla import LatentHeads
from k3kit.models.kimi_k3.model import Captured, K3Model, commit_rows
from k3kit.models.kimi_k3.moe import set_expert_prefetch
from k3kit.models.kimi_k3.row_step import RowStep
from k3kit.models.kimi_k3.state import K3State, KDAState
from k3kit.runtime.experts import ExpertStats, ExpertStore
from k3kit.runtime.loader import (
    GGUFSource,
    LoadOptions,
    check_arith,
    check_trunk,
    cpu_moe_layers,
    expert_keep,
    expert_prefetch,
    layer_devices,
)
from k3kit.runtime.protocols import MemoryFigures, RoutedExperts, VerifyOutput
from k3kit.runtime.row_linear import use_row_linear
from k3kit.runtime.speculative.schedule import ExpertLayer, verify_seconds

# Passes of at most this many rows run torch's ops on one thread (the native kernels keep theirs):
# k3kit.kernels.threads says why.
SERIAL_ROWS = 64


def _pass_threads(rows: int) -> AbstractContextManager[None]:
    return kthreads.serial_torch() if rows <= SERIAL_ROWS else nullcontext()


class K3Adapter(SequenceSnapshots):
    """One K3 sequence over GGUF weights. Not thread-safe; one state per adapter."""

    def __init__(self, source: GGUFSource, cfg: K3ModelConfig, model: K3Model, store: ExpertStore,
                 options: LoadOptions, layer_dev: Sequence[torch.device]):
        self.source = source
        self.cfg = cfg
        self.model = model
        self.store = store
        self.options = options
        self.layer_dev = list(layer_dev)
        self.experts = StoreExperts(store, layer_dev)
        self.vocab_size = cfg.vocab_size
        self.context_length = cfg.max_position_embeddings
        self.hidden_size = cfg.hidden_size
        self.num_layers = cfg.num_layers
        self.tap_layers: tuple[int, ...] = ()
        self.capture_mode = "raw"
        self.dtype = options.dtype
        # held for compute: float parameters + the file bytes quantized layers keep (mapped: they
        # are resident once the first forward touched them)
        quantized: list[QuantizedLinear | QuantizedEmbedding | LatentHeads] = [
            *quantized_modules(model), *(m for m in model.modules() if isinstance(m, LatentHeads))]
        self.trunk = "quantized" if quantized else "float"
        self.trunk_bytes = (sum(p.numel() * p.element_size() for p in model.parameters())
                            + sum(m.nbytes for m in quantized))
        self.trunk_params = sum(p.numel() for p in model.parameters()) + sum(m.numel for m in quantized)
        self.trunk_file_bytes = source.trunk_bytes_read
        self.replay_fast_commits = 0
        self.replay_full_replays = 0
        self.replay_failed_fallbacks = 0
        self.history: list[int] = []          # committed token ids: the last-resort rebuild
        self._cost_geometry: tuple | None = None   # cost(): per-layer expert geometry, once
        self._cost_cached: tuple | None = None     # cost(): cached-expert counts per cache state
        self._pending: _Pending | None = None
        self._seqs: dict[int, K3State] = {}       # open_sequence's states, by handle
        self._seq_pending: dict[int, _Pending] = {}   # verify_batch's uncommitted blocks, by handle
        self._next_seq = 1
        self._invariant_rows: int | None = None
        self._row_steps: dict[bool, RowStep | None | bool] = {}   # row_step's, made at first use
        self.row_step_note = ""                          # why there is none, once asked
        if len(set(self.layer_dev)) > 1:
            _install_layer_split(model, self.layer_dev)
        self.state = self.new_state()

    # -- state --------------------------------------------------------------------------------
    def new_state(self) -> K3State:
        """Empty state in the compute dtype, each layer's tensors on its layer's device."""
        st = K3State.new(self.cfg, 1, self.layer_dev[0], self.dtype)
        for il, layer in enumerate(st.layers):
            dev = self.layer_dev[il]
            if isinstance(layer, KDAState):
                layer.S, layer.conv = layer.S.to(dev), layer.conv.to(dev)
            else:
                layer.to_(dev)
        return st

    def reset(self) -> None:
        self.state = self.new_state()
        self.history = []
        self._pending = None

    @property
    def position(self) -> int:
        return self.state.pos

    def set_taps(self, layers: Sequence[int], mode: str = "raw") -> None:
        """Layers whose inputs `verify(capture=True)` returns (il == num_layers: the final stream)."""
        if any(not 0 <= il <= self.cfg.num_layers for il in layers):
            raise ValueError(f"tap layers must be in 0..{self.cfg.num_layers}")
        self.tap_layers, self.capture_mode = tuple(int(i) for i in layers), mode

    # -- running ------------------------------------------------------------------------------
    def _id_list(self, ids: Sequence[int] | Tensor) -> list[int]:
        """The ids as Python ints, checked: a list is checked where it is (no tensor, no host
        read of one); a tensor is read once."""
        vals = ids.reshape(-1).tolist() if isinstance(ids, Tensor) else [int(i) for i in ids]
        if not vals:
            raise ValueError("no token ids")
        if min(vals) < 0 or max(vals) >= self.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        return vals

    def _ids(self, ids: Sequence[int] | Tensor) -> Tensor:
        return self._id_tensor(self._id_list(ids))

    def _id_tensor(self, vals: list[int]) -> Tensor:
        return torch.tensor(vals, dtype=torch.long).reshape(1, -1).to(self.layer_dev[0])

    @torch.no_grad()
    def forward(self, ids: Sequence[int] | Tensor, all_logits: bool = False) -> Tensor:
        """Run and commit `ids`; float32 logits [n, V] (all rows) or [1, V] (the last)."""
        self._pending = None
        vals = self._id_list(ids)
        with _pass_threads(len(vals)):
            step = self.row_step()
            out = step.run(vals, self.state, self.experts, logits="all" if all_logits else "last") \
                if step is not None else None
            if out is None:
                out = self.model(self._id_tensor(vals), self.state, experts=self.experts,
                                 logits="all" if all_logits else "last")
        assert out.logits is not None
        self.history += vals
        return out.logits[0].float()

    def row_step(self, segments: bool = False) -> RowStep | None:
        """The model's step for the rows of one sequence (models/kimi_k3/row_step.py; `segments`: in
        forward_segments' arithmetic), made at first use; None where it cannot run (`row_step_note`)."""
        made = self._row_steps.get(segments, False)
        if made is False:
            gpu = any(d.type != "cpu" for d in self.layer_dev)
            made, self.row_step_note = (None, "a GPU layer") if gpu else RowStep.build(self.model, segments)
            self._row_steps[segments] = made
        return made if isinstance(made, RowStep) else None

    @torch.no_grad()
    def forward_taps(self, ids: Sequence[int]) -> VerifyOutput:
        """`forward` of `ids`, committed, with every row's logits and tap features (a speculative
        decoder's plain pass: runtime.protocols.CommittingTarget)."""
        self._pending = None
        vals, taps = self._id_list(ids), self.tap_layers
        with _pass_threads(len(vals)):
            step = self.row_step()
            out = step.run(vals, self.state, self.experts, taps=taps, mode=self.capture_mode,
                           logits="all") if step is not None else None
            if out is None:
                out = self.model(self._id_tensor(vals), self.state, experts=self.experts, capture_layers=taps,
                                 capture_mode=self.capture_mode, logits="all")
        assert out.logits is not None
        self.history += vals
        feats = torch.cat([out.layer_inputs[il][0].to(self.layer_dev[-1]) for il in taps], dim=-1) if taps \
            else out.logits.new_zeros(len(vals), 0)
        return VerifyOutput(out.logits[0].float(), feats.float())

    @torch.no_grad()
    def verify(self, ids: Sequence[int], capture: bool = True, all_logits: bool = True) -> VerifyOutput:
        """Run rows after the committed state without committing (see module doc)."""
        taps = self.tap_layers if capture else ()
        vals = self._id_list(ids)
        with _pass_threads(len(vals)):
            step = self.row_step()
            out = step.run(vals, self.state, self.experts, commit=False, taps=taps, mode=self.capture_mode,
                           logits="all" if all_logits else "last") if step is not None else None
            if out is None:
                out = self.model(self._id_tensor(vals), self.state, experts=self.experts, capture_layers=taps,
                                 capture_mode=self.capture_mode, speculative=True,
                                 logits="all" if all_logits else "last")
        assert out.captured is not None and out.logits is not None
        self._pending = _Pending(out.captured, out.captured.n_rows, vals)
        feats = None
        if capture:
            if taps:
                feats = torch.cat([out.layer_inputs[il][0].to(self.layer_dev[-1]) for il in taps], dim=-1)
            else:
                feats = out.logits.new_zeros(out.captured.n_rows, 0)
        return VerifyOutput(out.logits[0].float(), feats.float() if feats is not None else None)

    @torch.no_grad()          # a replay runs the same (inference) kernels as the forward it redoes
    def commit(self, n: int) -> None:
        p = self._pending
        if p is None:
            if n:
                raise ValueError("commit without a pending verify")
            return
        if not 0 <= n <= p.n_rows:
            raise ValueError(f"cannot commit {n} of {p.n_rows} verified rows")
        self._pending = None
        if p.captured is not None and self._replayable(p.captured, n):
            commit_rows(self.state, p.captured, n)
            self.replay_fast_commits += n > 0
        else:
            self._full_replay(p.ids[:n])
        self.history += p.ids[:n]

    def _replayable(self, captured: Captured, n: int, state: K3State | None = None) -> bool:
        """Can commit_rows apply these captured rows to the committed state as it is now?"""
        state = self.state if state is None else state
        if captured.start_pos != state.pos or n > captured.n_rows:
            return False
        for il, layer in enumerate(state.layers):
            if isinstance(layer, KDAState):
                rows = captured.kda.get(il)
                if rows is None or rows.n_rows < n or rows.k.shape[0] != layer.S.shape[0]:
                    return False
            elif layer.length < state.pos + n:
                return False
        return True

    def _full_replay(self, ids: list[int]) -> None:
        """Run the accepted rows again from the committed state; if even that fails, rebuild
        the whole state from the committed history."""
        try:
            for layer in self.state.mla_caches():
                layer.truncate(self.state.pos)              # drop the verify's pending rows
            if ids:
                self.model(self._ids(ids), self.state, experts=self.experts, logits="none")
            self.replay_full_replays += 1
        except (RuntimeError, ValueError):
            self.replay_failed_fallbacks += 1
            self.state = self.new_state()
            tokens = self.history + ids
            for i in range(0, len(tokens), 256):
                self.model(self._ids(tokens[i:i + 256]), self.state, experts=self.experts, logits="none")

    def rollback(self) -> None:
        self.commit(0)

    # -- several sequences (runtime.protocols.BatchedModel) --------------------------------------
    # Each open sequence holds its own K3State (MLA latents, KDA recurrent + conv state); the
    # single-sequence API above keeps using `self.state` and never touches these.
    def open_sequence(self) -> int:
        """A new empty sequence; its handle for forward_batch / close_sequence."""
        sid = self._next_seq
        self._next_seq += 1
        self._seqs[sid] = self.new_state()
        return sid

    def close_sequence(self, seq: int) -> None:
        """Free a sequence's state (unknown handles are ignored: closing twice is harmless)."""
        self._seqs.pop(seq, None)
        self._seq_pending.pop(seq, None)

    @property
    def sequences(self) -> int:
        return len(self._seqs)

    def sequence_position(self, seq: int) -> int:
        return self._state_of(seq).pos

    def _state_of(self, seq: int) -> K3State:
        try:
            return self._seqs[seq]
        except KeyError:
            raise ValueError(f"no open sequence {seq}") from None

    @property
    def batch_invariant_rows(self) -> int:
        """Rows per pass up to which each row's logits do not depend on the other rows (0: not
        guaranteed at any count): the least of every trunk matrix's `invariant_rows` and, with a
        quantized expert cache, the experts' (kernels.qmatmul.invariant_rows of their type, in the
        store's arithmetic): any count in the ggml arithmetic, else the native float kernel's row
        limit (beyond it a product is dequantize + torch GEMM, whose per-row sums depend on the
        row count). In the ggml arithmetic a serving pass may thus take all its prompts at once.
        A float trunk (nn.Linear) or float experts multiply through torch's GEMM: no guarantee.
        The rest of a batched pass is row-invariant by construction (model.forward_batch)."""
        if self._invariant_rows is None:
            limits = []
            for m in quantized_modules(self.model):
                if isinstance(m, QuantizedLinear):
                    limits.append(int(m.invariant_rows))
            # a float Linear left in the row-wise part (MLA's kv_b is only read per sequence)
            if any(isinstance(m, nn.Linear) and not name.endswith("kv_b_proj")
                   for name, m in self.model.named_modules()):
                limits.append(0)
            arith = self.store.arith or DEFAULT_ARITH          # what the store's products run in
            for il, ts in self.store.layers.items():
                if self.store.keep_of(il) == "triton":        # a grouped GEMV per expert's rows
                    limits.append(GROUPED_MAX_ROWS)
                elif self.store.keep_of(il) != "quantized":
                    limits.append(0)
                else:
                    limits += [invariant_rows(GGMLQuantizationType(t.ggml_type), self.dtype, arith)
                               for t in ts]
            self._invariant_rows = max(min(limits, default=0), 0)
        return self._invariant_rows

    @torch.no_grad()
    def forward_batch(self, rows: Sequence[tuple[int, Sequence[int]]]) -> Tensor:
        """Run (sequence, token ids) entries in one pass, each committed to its sequence; float32
        logits [len(rows), V] of each entry's last row. A sequence appears at most once."""
        return torch.cat([o.logits for o in self.verify_batch(rows)])

    @torch.no_grad()
    def verify_batch(self, rows: Sequence[tuple[int, Sequence[int]]], *, verify: Collection[int] = (),
                     capture: Collection[int] = ()) -> list[VerifyOutput]:
        """forward_batch with speculative verification (runtime.protocols.SpeculativeBatchedModel).

        An entry whose sequence is in `verify` is a verify block [anchor, proposals...]: its rows
        are NOT committed (KDA state pristine, MLA rows pending; ReplaySSM as `verify`) and every
        row's logits come back; `commit_sequence(seq, n)` then keeps the first n. A one-row block
        commits at once (the row a plain decoding sequence would run: the same floats, and its
        commit can only be 1). Other entries commit and return their last row's logits. Entries
        whose sequence is in `capture` also return their rows' tap features (`set_taps`)."""
        seqs = [sid for sid, _ in rows]
        if len(set(seqs)) != len(seqs):
            raise ValueError("a sequence appears twice in one pass")
        segments, spec, cap, ids_of = [], [], [], []
        for sid, ids in rows:
            state = self._state_of(sid)
            vals = self._id_list(ids)
            t = self._id_tensor(vals)[0]
            if state.pos + t.numel() > self.context_length:
                raise ValueError(f"sequence {sid}: {state.pos + t.numel()} positions exceed the context "
                                 f"({self.context_length})")
            self._seq_pending.pop(sid, None)        # a new pass drops an uncommitted block
            segments.append((t, state))
            spec.append(sid in verify and t.numel() > 1)
            cap.append(sid in capture)
            ids_of.append(vals)
        with _pass_threads(sum(len(v) for v in ids_of)):
            step, outs = self.row_step(True), None
            if step is not None and len(rows) == 1:
                outs = step.segment(ids_of[0], segments[0][1], self.experts, spec[0],
                                    self.tap_layers if cap[0] else (), self.capture_mode)
            elif step is not None:
                outs = step.run_segments(ids_of, [st for _, st in segments], self.experts, spec, cap,
                                         self.tap_layers, self.capture_mode)
            if outs is None:
                outs = self.model.forward_segments(
                    segments, experts=self.experts, speculative=spec, capture=cap,
                    capture_layers=self.tap_layers, capture_mode=self.capture_mode)
        result = []
        for (sid, _), o, ids, sp, cp in zip(rows, outs, ids_of, spec, cap, strict=True):
            if sid in verify:
                self._seq_pending[sid] = _Pending(o.captured, len(ids), ids) if sp else _Pending(None, 1, ids)
            taps = o.taps
            if cp and taps is None:                 # no tap layers set: zero-width features
                taps = o.logits.new_zeros(len(ids), 0)
            result.append(VerifyOutput(o.logits.float(), taps.float() if taps is not None else None))
        return result

    @torch.no_grad()
    def commit_sequence(self, seq: int, n: int) -> None:
        """Keep the first n rows of `seq`'s last verify block (see `commit`): KDA replays them from
        the captured inputs; if the capture does not fit the state, the rows run again."""
        state = self._state_of(seq)
        p = self._seq_pending.pop(seq, None)
        if p is None:
            if n:
                raise ValueError(f"sequence {seq}: commit without a pending verify")
            return
        if not 0 <= n <= p.n_rows:
            raise ValueError(f"sequence {seq}: cannot commit {n} of {p.n_rows} verified rows")
        if p.captured is None:                      # a one-row block, committed by the pass
            if n != p.n_rows:
                raise ValueError(f"sequence {seq}: a one-row block commits its row, not {n}")
            return
        if self._replayable(p.captured, n, state):
            commit_rows(state, p.captured, n)
            self.replay_fast_commits += n > 0
        else:
            for layer in state.mla_caches():
                layer.truncate(state.pos)
            if n:
                self.model(self._ids(p.ids[:n]), state, experts=self.experts, logits="none")
            self.replay_full_replays += 1

    def sequence_target(self, seq: int) -> SequenceTarget:
        """Sequence `seq` seen as a runtime Target (what a SpeculativeDecoder drives): its verify
        is a one-entry verify_batch, its commit commit_sequence."""
        self._state_of(seq)
        return SequenceTarget(self, seq)

    # -- for the scheduler and the draft ---------------------------------------------------
    def cost(self, n_rows: int) -> float:
        """Estimated seconds of one verify pass of n rows (runtime.speculative.schedule's
        `verify_seconds`): per-pass and per-row trunk work, per distinct routed expert, and
        for the experts an LRU cache of this size would not hold, reading and dequantizing them
        (cold reads slower). Distinct experts follow uniform top-k routing. The scheduler asks
        for every width on every step, so the geometry is worked out once and the per-layer
        cache counts only when the cache has changed."""
        store = self.store
        geometry = self._cost_geometry
        if geometry is None:
            elem = torch.empty(0, dtype=self.dtype).element_size()
            geometry = (elem, [(il, store.n_experts(il), sum(int(torch.Size(t.shape).numel()) for t in ts),
                                store.expert_nbytes(il), store.cached_expert_nbytes(il))
                               for il, ts in store.layers.items()])
            self._cost_geometry = geometry
        elem, layers = geometry
        s = store.stats()       # the cache's contents change only on a miss, an eviction or a pin
        key = (s.misses, s.evictions, s.resident_experts, s.pinned_bytes, store.cache_bytes)
        memo = self._cost_cached
        if memo is None or memo[0] != key:
            memo = (key, [store.cached_count(il) for il, *_ in layers])
            self._cost_cached = memo
        k = self.cfg.num_experts_per_tok
        # an expert held at its file size is kept quantized: a miss is a copy, no dequantization
        moe = [ExpertLayer(n_exp, k, n, held, nbytes, cached, dequant_on_miss=held != nbytes)
               for (_, n_exp, n, nbytes, held), cached in zip(layers, memo[1], strict=True)]
        return verify_seconds(n_rows, layers=self.cfg.num_layers, trunk_params=self.trunk_params,
                              trunk_bytes=self.trunk_bytes, moe=moe, cache_bytes=store.cache_bytes,
                              cold=bool(store.cold))

    def embed(self, ids: Tensor) -> Tensor:
        return self.model.embed(ids.to(self.layer_dev[0]))

    def head(self, hidden: Tensor) -> Tensor:
        return self.model.lm_head(hidden.to(self.dtype)).float()

    def counters(self) -> dict[str, int]:
        s = self.store.stats()
        return {"replay_fast_commits": self.replay_fast_commits,
                "replay_full_replays": self.replay_full_replays,
                "replay_failed_fallbacks": self.replay_failed_fallbacks, "expert_hits": s.hits,
                "expert_misses": s.misses, "expert_bytes_read": s.bytes_read}

    def reset_counters(self) -> None:
        """Zero the ReplaySSM counters `counters()` reports (a warm-up's passes are not a run's)."""
        self.replay_fast_commits = self.replay_full_replays = self.replay_failed_fallbacks = 0

    def reset_expert_cache(self, cache_mib: float | None = None) -> None:
        """Empty the expert cache (optionally with a new budget) and zero its counters."""
        if cache_mib is not None:
            if cache_mib < 0:
                raise ValueError("cache_mib must be >= 0")
            self.store.cache_bytes = int(cache_mib * (1 << 20))
        self.store.clear()
        self.store.reset_stats()

    def expert_stats(self) -> ExpertStats:
        return self.store.stats()

    def preload_experts(self) -> bool:
        """Read every routed expert into the cache if they all fit it (ExpertStore.load_all_if_fits)."""
        return self.store.load_all_if_fits()

    @property
    def expert_kernel(self) -> str:
        """'native-avx512' (quantized cache, native kernel and its vector path), 'triton' (the
        bytes on a device, the Triton kernels), 'torch' (dequantized), or those in use joined by
        ' + ' (--n-cpu-moe: experts in RAM and in VRAM)."""
        names = {"quantized": f"native-{native_simd()}", "triton": "triton", "dequantized": "torch"}
        kept = {self.store.keep_of(il) for il in self.store.layers}
        return " + ".join(names[k] for k in names if k in kept)

    def kernels(self) -> dict[str, dict[str, str]]:
        """Which kernel multiplies each ggml type, for the trunk and for the routed experts
        (`generate --stats/--json`): what a user needs to see that a type has no fast path."""
        trunk: dict[str, str] = {}
        for m in quantized_modules(self.model):
            name = m.qtype.name
            if isinstance(m, QuantizedEmbedding):
                trunk.setdefault(name, "row gather (looked-up rows dequantized)")
            elif m.dense is not None:
                trunk[name] = "torch (float weights as stored)"
            elif m.matrix is not None and m.matrix.native:
                trunk[name] = kernel_label(m.qtype, m.matrix.arith)
            else:
                trunk[name] = "dequantize per product + torch GEMM"
        for h in (m for m in self.model.modules() if isinstance(m, LatentHeads)):
            for qh in (h.k_b, h.v_b):
                trunk.setdefault(qh.qtype.name, kernel_label(qh.qtype, qh.arith) if qh.native
                                 else "dequantize per product + torch")
        if not trunk:
            trunk["all"] = f"torch ({self.options.dtype}, dequantized at load)"
        experts: dict[str, str] = {}
        for il, tensors in self.store.layers.items():
            for t in tensors:
                qt = GGMLQuantizationType(t.ggml_type)
                if self.store.keep_of(il) == "quantized" and qt in NATIVE_TYPES:
                    label = kernel_label(qt, self.store.arith or DEFAULT_ARITH)
                elif self.store.keep_of(il) == "triton" and gpu_supports(qt):
                    label = f"triton (the file's bytes in {self.store.device_of(il)}, grouped GEMV)"
                else:
                    dev = self.store.device_of(il)
                    where = "" if dev.type == "cpu" else f", in {dev}"
                    label = f"torch (dequantized on a miss{where})"
                if experts.setdefault(qt.name, label) != label and label not in experts[qt.name]:
                    experts[qt.name] += f"; {label}"      # --n-cpu-moe: some layers each way
        return {"trunk": trunk, "experts": experts}

    def memory(self) -> MemoryFigures:
        store, s = self.store, self.store.stats()
        experts = tuple(RoutedExperts(il, store.n_experts(il), store.expert_nbytes(il),
                                      store.cached_expert_nbytes(il)) for il in store.layers)
        return MemoryFigures(trunk_bytes=self.trunk_bytes, trunk_file_bytes=self.trunk_file_bytes,
                             expert_cache_bytes=s.resident_bytes, expert_cache_budget=store.cache_bytes,
                             experts_per_token=self.cfg.num_experts_per_tok, experts=experts,
                             trunk=self.trunk, input_bytes=_module_bytes(self.model.embed))

    def close(self) -> None:
        self.store.close()
        self.source.close()


def _module_bytes(m: nn.Module) -> int:
    """What a module's weights hold: a quantized embedding's bytes, else its parameters'."""
    if isinstance(m, QuantizedEmbedding):
        return int(m.nbytes)
    return sum(p.numel() * p.element_size() for p in m.parameters())


def _install_layer_split(model: K3Model, layer_dev: Sequence[torch.device]) -> None:
    """Multi-device layer split without touching the model's forward: each layer's attention
    and FFN run on that layer's device (inputs moved there by a pre-hook) and hand their
    outputs back to the stream's device (the first). Untested here: CPU-only machine."""
    home = layer_dev[0]

    def to_dev(dev: torch.device):
        def pre(_mod, args):
            return tuple(a.to(dev) if isinstance(a, Tensor) else a for a in args)
        return pre

    def back(_mod, _args, out):
        if isinstance(out, tuple):
            return tuple(o.to(home) if isinstance(o, Tensor) else o for o in out)
        return out.to(home)

    for il, layer in enumerate(model.layers):
        for sub in (layer.get_submodule("attn"), layer.get_submodule("ffn")):
            sub.register_forward_pre_hook(to_dev(layer_dev[il]))
            sub.register_forward_hook(back)
    model.lm_head.register_forward_pre_hook(to_dev(layer_dev[-1]))


class _TrunkBytes:
    """The `raw` getter of a quantized trunk. On the CPU: a view of the mapped file, resident
    as the first products touch it and checked then (`check_on_first_use`). For a tensor placed
    on another device (CUDA): its bytes read once, checked (they are in RAM anyway) and copied
    to that device, one tensor at a time, so host memory holds at most one tensor's bytes."""

    def __init__(self, source: GGUFSource, layer_dev: Sequence[torch.device]):
        self.source, self.layer_dev = source, list(layer_dev)
        self.mapped: dict[int, str] = {}       # data_ptr of a mapped view -> its tensor name

    def device_of(self, name: str) -> torch.device:
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) > 1 and parts[1].isdigit():
            return self.layer_dev[int(parts[1])]
        return self.layer_dev[0] if name.startswith("token_embd") else self.layer_dev[-1]

    def __call__(self, name: str) -> Tensor:
        dev = self.device_of(name)
        if dev.type != "cpu":
            host = self.source.raw(name, copy=True)
            self.source.check_finite(name, host)
            return host.to(dev)
        t = self.source.raw(name)
        self.mapped[t.data_ptr()] = name
        return t

    def check_on_first_use(self, model: nn.Module) -> None:
        """Give every quantized layer over a mapped view its corruption check: a QuantizedLinear
        scans its tensor's scale bytes before its first product (which reads every page anyway,
        so the 60 GB K3 trunk is not read a second time at load); an embedding checks the rows
        it looks up. Both raise a one-line CorruptBlockError naming file, tensor and block."""
        for m in quantized_modules(model):
            raw = m.raw if isinstance(m, QuantizedLinear) else m.rows
            name = self.mapped.get(raw.data_ptr()) if raw.device.type == "cpu" else None
            if name is None:
                continue                  # on a device: checked when it was read
            if isinstance(m, QuantizedLinear):
                m.check = partial(self.source.check_finite, name)
            else:
                m.corrupt_row = partial(self.source.check_row_finite, name)
        for h in (m for m in model.modules() if isinstance(m, LatentHeads)):
            names = [self.mapped.get(r.data_ptr()) for r in (h.k_raw, h.v_raw) if r.device.type == "cpu"]
            checks = [partial(self.source.check_finite, n) for n in names if n is not None]
            if checks:
                h.check = partial(_run_all, checks)


def _run_all(checks: Sequence[Callable[[], None]]) -> None:
    for check in checks:
        check()


def load(source: GGUFSource, options: LoadOptions) -> K3Adapter:
    """The registry entry (k3kit.adapters.ADAPTERS): build the trunk and the expert store from
    an open GGUF. The adapter owns `source` from then on (its close() closes it)."""
    cfg = config_from_source(source)
    devices = options.devices
    quantized = check_trunk(options.trunk, devices) == "quantized"
    layer_dev = layer_devices(cfg.num_layers, devices)
    if len(devices) > 1:     # norms and scores used in the stream loop stay with the stream
        layer_dev_params = [devices[0]] * cfg.num_layers
    else:
        layer_dev_params = layer_dev
    trunk_bytes = _TrunkBytes(source, layer_dev) if quantized else None
    arith = check_arith(options.arith)
    model = build_trunk(source, cfg, options.dtype, layer_dev_params, raw=trunk_bytes, arith=arith)
    if trunk_bytes is not None:
        trunk_bytes.check_on_first_use(model)
    if len(devices) > 1:     # move each layer's attention and FFN weights to its device
        for il, layer in enumerate(model.layers):
            layer.attn.to(layer_dev[il])
            layer.ffn.to(layer_dev[il])
        model.lm_head.to(layer_dev[-1])
    if options.ggml_parity:
        model.set_ggml_q8_inputs(True, ggml_input_kinds(source, model))
    use_row_linear(model)     # decode rows as matrix-vector products (bf16/f16 only)
    names = expert_tensor_names(cfg)
    on_cpu = cpu_moe_layers(options.cpu_moe, names, devices)     # --cpu-moe / --n-cpu-moe
    cpu = [torch.device("cpu")]
    store_dev = cpu if on_cpu and on_cpu == set(names) else devices     # every expert in RAM
    store = source.expert_store(names, cache_mib=options.expert_cache_mib, dtype=options.dtype,
                                device=store_dev[0], cold=options.cold,
                                keep=expert_keep(options.expert_kernel, store_dev),
                                arith=options.expert_arith, cpu_layers=on_cpu if store_dev is devices else (),
                                cpu_keep=expert_keep(options.expert_kernel.replace("triton", "auto"), cpu))
    set_expert_prefetch(model.modules(), expert_prefetch(options.expert_prefetch, store))
    return K3Adapter(source, cfg, model, store, options, layer_dev)
