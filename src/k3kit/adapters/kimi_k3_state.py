"""Copies of a K3 sequence's state out of and back into the adapter (runtime.protocols.SnapshotModel).

What the server's prompt cache keeps between requests: per KDA layer the recurrent S and the
conv window (valid at exactly one position), per MLA layer the latent kv and pe rows (row i
depends only on tokens 0..i, so any prefix of them serves a sequence sharing that prefix).
A mixin of K3Adapter, kept apart so that the adapter's module stays about running passes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from k3kit.models.kimi_k3.config import K3ModelConfig
from k3kit.models.kimi_k3.state import K3State, KDAState
from k3kit.runtime.protocols import SequenceState

RESTORE_HEADROOM = 1024    # MLA positions a restored state holds room for: a conversation's next turn


class SequenceSnapshots:
    """sequence_state / load_sequence_state over the adapter's per-handle K3States."""

    cfg: K3ModelConfig
    dtype: torch.dtype
    context_length: int
    _seqs: dict[int, K3State]
    _seq_pending: dict[int, Any]               # the adapter's uncommitted verify blocks
    _state_of: Callable[[int], K3State]      # the adapter's: a handle's state, ValueError if unknown
    new_state: Callable[[], K3State]         # the adapter's: an empty state on the layers' devices

    def sequence_state(self, seq: int, positional: bool = True) -> SequenceState:
        """Sequence `seq`'s committed state copied to the CPU: each KDA layer's S and conv window
        (recurrent), each MLA layer's latent kv and pe rows [0, pos) (positional, if asked)."""
        st = self._state_of(seq)
        rec: list[Tensor] = []
        rows: list[Tensor] = []
        for layer in st.layers:
            if isinstance(layer, KDAState):
                rec += [layer.S[0].to("cpu", copy=True), layer.conv[0].to("cpu", copy=True)]
            elif positional:
                rows += [layer.kv[0, :st.pos].to("cpu", copy=True), layer.pe[0, :st.pos].to("cpu", copy=True)]
        return SequenceState(st.pos, tuple(rec), tuple(rows))

    def load_sequence_state(self, seq: int, recurrent: Sequence[Tensor], positional: Sequence[Tensor],
                            pos: int) -> None:
        """Replace `seq`'s state by the one at `pos` (see SnapshotModel); checked before anything
        changes: a copy that does not fit this model raises ValueError."""
        self._state_of(seq)
        if pos < 0 or pos > self.context_length:
            raise ValueError(f"position {pos} outside the context ({self.context_length})")
        st = self.new_state()
        rec, rows = list(recurrent), list(positional)
        n_kda = sum(isinstance(x, KDAState) for x in st.layers)
        if len(rec) != 2 * n_kda or len(rows) != 2 * (len(st.layers) - n_kda):
            raise ValueError("the saved state has another layer layout")
        ri = pi = 0
        for layer in st.layers:
            if isinstance(layer, KDAState):
                for name, want in (("S", layer.S[0]), ("conv", layer.conv[0])):
                    got = rec[ri]
                    ri += 1
                    if got.shape != want.shape or got.dtype != want.dtype:
                        raise ValueError(f"KDA {name}: saved {tuple(got.shape)} {got.dtype}, "
                                         f"model {tuple(want.shape)} {want.dtype}")
            else:
                for name, want in (("kv", layer.kv), ("pe", layer.pe)):
                    got = rows[pi]
                    pi += 1
                    if got.dim() != 2 or got.shape[0] < pos or got.shape[1] != want.shape[2] \
                            or got.dtype != want.dtype:
                        raise ValueError(f"MLA {name}: saved {tuple(got.shape)} {got.dtype} does not "
                                         f"give {pos} rows of {want.shape[2]} {want.dtype}")
        ri = pi = 0
        for layer in st.layers:
            if isinstance(layer, KDAState):
                layer.S[0].copy_(rec[ri])
                layer.conv[0].copy_(rec[ri + 1])
                ri += 2
            else:
                if pos:
                    dev = layer.kv.device
                    layer.reserve(pos + RESTORE_HEADROOM)
                    layer.append(rows[pi][:pos].to(dev).unsqueeze(0), rows[pi + 1][:pos].to(dev).unsqueeze(0))
                pi += 2
        st.pos = pos
        self._seqs[seq] = st
        self._seq_pending.pop(seq, None)

    @property
    def positional_row_bytes(self) -> int:
        """Bytes one position adds to the MLA caches (all MLA layers)."""
        el = torch.empty((), dtype=self.dtype).element_size()
        n_mla = sum(not self.cfg.is_kda(il) for il in range(self.cfg.num_layers))
        return n_mla * (self.cfg.kv_lora_rank + self.cfg.qk_rope_head_dim) * el

    @property
    def recurrent_bytes(self) -> int:
        """Bytes of one copy of the KDA states (S and conv windows, all KDA layers)."""
        el = torch.empty((), dtype=self.dtype).element_size()
        H, D = self.cfg.num_heads, self.cfg.kda_head_dim
        n_kda = sum(self.cfg.is_kda(il) for il in range(self.cfg.num_layers))
        return n_kda * (H * D * D + 3 * (self.cfg.conv_kernel - 1) * self.cfg.kda_dim) * el
